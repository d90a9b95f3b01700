"""Coordinator settings: `COORDINATOR_*` environment variables, CLI flags override (python -m coordinator).

Pool endpoints: either a static comma list (`COORDINATOR_DRAFT_ENDPOINTS=host:port,host:port`) or the DNS name of
a headless Service (`COORDINATOR_DRAFT_DNS=draft-headless.ns.svc.cluster.local:50061`), re-resolved every
`dns_refresh_s` so pools grow and shrink without a restart. Same for the target pool.
"""
from __future__ import annotations

from pathlib import PurePath
from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specdec.common.defaults import COORDINATOR_METRICS_PORT, COORDINATOR_PORT, DEFAULT_TARGET, DEFAULT_TARGET_NAME
from specdec.scheduling.field_rules import MAX_GAMMA
from specdec.scheduling.request import DEFAULT_POST_THRESHOLD, MAX_SPEC_OFF_BATCH, MODES
from specdec_rpc.settings import ProcessSettings


class CoordinatorSettings(ProcessSettings):
    model_config = SettingsConfigDict(env_prefix="COORDINATOR_", cli_prog_name="python -m coordinator")

    port: int = Field(COORDINATOR_PORT, ge=0, le=65535)
    metrics_port: int = Field(COORDINATOR_METRICS_PORT, ge=0, le=65535)
    # the tokenizer (and EOS ids) come from the target model spec; "" or "none": token-id prompts only
    tokenizer: str = Field(DEFAULT_TARGET, description="model spec whose tokenizer the coordinator uses")
    draft_endpoints: str = Field("", description="static draft pool: comma-separated host:port list")
    target_endpoints: str = Field("", description="static target pool: comma-separated host:port list")
    draft_dns: str = Field("", description="draft pool: host:port of a headless Service, re-resolved")
    target_dns: str = Field("", description="target pool: host:port of a headless Service, re-resolved")
    dns_refresh_s: float = Field(5.0, gt=0, description="how often pools are re-resolved and health-checked")
    health_timeout_s: float = Field(1.0, gt=0, description="per-replica health check timeout")
    ray_address: str = Field("", description="'' starts a local Ray instance; 'auto' attaches to a running one")
    ray_num_cpus: int = Field(2, ge=1, description="CPUs of the local Ray instance")
    ray: bool = Field(True, description="run pipelines in Ray actors (--no-ray: in the driver process, for tests)")
    pipelines: int = Field(0, ge=0, description="pipeline actors, requests round-robin (0: one per Ray CPU, "
                                                "min 2, re-checked as Ray workers join)")
    default_mode: Literal[MODES] = Field("sd", description="the mode of requests that leave it unset (OpenAI clients send none): "
                                                "ar, sd, pacer, pearl or pacer_pearl")
    gamma: int = Field(0, ge=0, le=MAX_GAMMA, description="the draft length (sd), most tokens drafted (pacer) or draft "
                                                   "window (PEARL modes) of requests that set none; vLLM's "
                                                   "num_speculative_tokens (0: each mode's own default, "
                                                   "specdec/scheduling/request.py DEFAULT_GAMMA)")
    verify_method: Literal["token", "block"] = Field("block", description="how sampled drafts of requests that "
                                                     "set none are verified: token (per-token rejection sampling) "
                                                     "or block (block verification; accepts at least as much); "
                                                     "greedy requests are verified by argmax either way")
    pacer_threshold: float | None = Field(None, ge=0.0, le=1.0, description="θ of PACER's stop rule for requests "
                                          "that set none (unset: the draft replica's DRAFT_PACER_THRESHOLD, else "
                                          "its pre-verifier's own)")
    max_new_tokens_cap: int = Field(4096, ge=1, description="largest max_new_tokens a request may ask for")
    # measured on the default pair (2-core CPU, docs/benchmarks.md, "Load-adaptive speculation"): speculation wins
    # at 2-4 sessions per forward (c = 2: +25-35 %, c = 4: +25-35 % against a threshold of 2), plain batched target
    # steps at 8
    spec_off_batch: int = Field(4, ge=0, le=MAX_SPEC_OFF_BATCH,
                                description="requests that leave spec_off_batch unset get this: rounds are plain "
                                            "target steps while the target batches at least this many sessions "
                                            "(0: always speculate)")
    pacer_post_threshold: float = Field(DEFAULT_POST_THRESHOLD, ge=0.0, le=1.0,
                                        description="pacer_pearl requests that leave it unset get this θ for drafting "
                                                    "in a verify's shadow: high where draft and target share a host's "
                                                    "cores, low where they run on separate machines")
    rpc_timeout_s: float = Field(60.0, gt=0, description="timeout of one replica call")
    queue_wait_s: float = Field(60.0, ge=0, description="how long a request waits for a free session when every "
                                                        "replica of a pool holds its max_sessions (then "
                                                        "RESOURCE_EXHAUSTED)")
    max_waiting: int = Field(256, ge=0, description="requests that may wait for a free session at once; more get "
                                                    "RESOURCE_EXHAUSTED at once")
    preempt: bool = Field(True, description="a request waiting for a free session takes the session of a running "
                          "request of lower priority (a larger `priority`), which ends it, waits for room again and "
                          "then resumes from its verified tokens (exact; costs it a re-prefill). Equal priorities "
                          "never preempt each other")
    replica_streams: bool = Field(True, description="send each session's Draft/Verify calls as messages on one "
                                                    "open stream per replica (VerifyRounds/DraftRounds); off: "
                                                    "unary calls")
    replica_frames: bool = Field(True, description="send those per-round messages on the replicas' frame ports "
                                 "(a plain TCP or TLS socket beside gRPC, specdec_rpc/frames.py) where they serve one, "
                                 "else on the gRPC streams. Off: gRPC only (the direct data plane's draft replicas "
                                 "choose for their own calls: their --peer-frames)")
    data_plane: Literal["coordinator", "direct", "auto"] = Field(
        "auto", description="who carries a speculative request's rounds: 'coordinator' (each round's draft and "
        "verify calls go coordinator -> replica -> coordinator), 'direct' (the pinned draft replica runs the rounds and "
        "calls the pinned target replica itself; the coordinator keeps placement, preemption, failover and the "
        "client's stream; one network round trip per round instead of two or more), or 'auto': direct for sd and "
        "pacer, whose rounds are sequential, the coordinator's rounds for the PEARL modes, whose draft stream and "
        "verifies overlap (docs/operations/network.md; the round trip measured: docs/benchmarks.md)")
    chain_window: int = Field(4, ge=0, le=16, description="the direct data plane, greedy pearl and pacer_pearl "
                              "requests: verifies in flight at once (chained rounds): the target verifies the next "
                              "block while the answer to the last one travels back; 0 or 1: PEARL's rounds, one "
                              "verify at a time")
    pool_view_refresh_s: float = Field(0.5, gt=0, description="how often pipelines refresh pool membership")
    prefix_affinity_chunk: int = Field(128, ge=0, description="prefix-aware routing: a request goes to the replica "
                                       "its prompt's longest whole-chunk prefix went to (its prefix cache reuses it); "
                                       "positions per chunk, set to the replicas' --prefill-chunk (0: least loaded "
                                       "only)")
    prefix_affinity_slack: int = Field(2, ge=0, description="prefix-aware routing yields to the least-loaded replica "
                                       "when the preferred one holds more than this many sessions beyond it")
    grace_s: float = Field(30.0, ge=0, description="drain time for in-flight requests on shutdown")
    http_port: int = Field(0, ge=0, le=65535, description="OpenAI-compatible HTTP API (/v1/chat/completions, "
                                                          "/v1/completions, /v1/models) on this port of --host "
                                                          "(0: off)")
    served_model_name: str = Field("", description="the model id the HTTP API serves and lists, or several, "
                                   "comma-separated: the first is the id it lists and answers with, a request may name "
                                   "any ('': the tokenizer's model name)")
    http_max_in_flight: int = Field(1024, ge=1, description="HTTP requests answered at once (a stream counts until "
                                                            "its end); more get 429")
    http_client_timeout_s: float = Field(30.0, gt=0, description="the HTTP API waits this long for a request's "
                                         "headers (then it closes the connection), for its body (then 408) and for "
                                         "a client to take each piece of its answer (then it gives up on the client "
                                         "and ends its generation)")
    http_api_key: str = Field("", description="when set, HTTP requests (all but /health, /metrics and /version) must "
                                              "send 'Authorization: Bearer "
                                              "<key>' (401 otherwise)")
    api_key: str = Field("", description="when set, required on both front doors: gRPC GenerationService calls "
                                         "send the metadata 'authorization: Bearer <key>' (UNAUTHENTICATED "
                                         "otherwise; health and reflection stay open), HTTP requests the header "
                                         "(http_api_key, if set, is the HTTP API's key instead)")
    responses_store: int = Field(1000, ge=0, description="Responses API: responses kept in memory for "
                                 "previous_response_id and GET /v1/responses/{id} (the least recently used go "
                                 "first; 0: none are stored, and store: true is refused)")
    responses_store_ttl_s: float = Field(3600.0, gt=0, description="Responses API: a stored response is dropped "
                                         "after this many seconds without use")
    responses_store_max_mb: int = Field(256, ge=1, description="Responses API: the stored responses' size in all "
                                        "(their JSON, MiB); the least recently used go to make room")
    draft_fallback: bool = Field(True, description="when no draft replica can be reached, at a request's start "
                                                   "or mid-request, go on target-only (ar: the same output "
                                                   "distribution, slower; stats.draft_unavailable) instead of "
                                                   "failing UNAVAILABLE")
    otlp_traces_endpoint: str = Field("", description="export one OpenTelemetry span per generation to this "
                                                       "OTLP/gRPC endpoint (e.g. http://otel-collector:4317); '': "
                                                       "no tracing")
    tool_call_parser: Literal["", "hermes", "llama3_json", "pythonic", "mistral"] = Field(
        "", description="the HTTP API's tool_choice 'auto': how this model writes tool calls (hermes: "
                        "<tool_call>{json}</tool_call>, Qwen2.5 / Hermes / SmolLM3; llama3_json: Llama 3.1+; "
                        "pythonic: [f(a=1)], Llama 3.2 / 4; mistral: [TOOL_CALLS]). '': 'auto' is refused")
    reasoning_parser: Literal["", "deepseek_r1", "qwen3"] = Field(
        "", description="a reasoning model's <think>...</think> apart from its answer: the HTTP chat routes' "
                        "`reasoning`, gRPC's separate_reasoning (deepseek_r1: DeepSeek-R1 and distills, QwQ, "
                        "Qwen3 Thinking-2507; qwen3: Qwen3's hybrid models). '': the text is left whole")

    def model_names(self) -> tuple[str, ...]:
        """The model ids the HTTP API answers to, the one it lists first: `served_model_name`'s, else the tokenizer
        spec's name."""
        names = tuple(dict.fromkeys(n.strip() for n in self.served_model_name.split(",") if n.strip()))
        return names or (served_name(self.tokenizer),)

    def model_name(self) -> str:
        """The model id the HTTP API lists and answers with (the first of `model_names`)."""
        return self.model_names()[0]

    def pool_spec(self, kind: str) -> str:
        """'dns:host:port' | 'static:a,b' | '' (no pool configured)."""
        dns, static = (self.draft_dns, self.draft_endpoints) if kind == "draft" else (self.target_dns,
                                                                                      self.target_endpoints)
        if dns and static:
            raise ValueError(f"set either COORDINATOR_{kind.upper()}_DNS or COORDINATOR_{kind.upper()}_ENDPOINTS, "
                             f"not both")
        return f"dns:{dns}" if dns else (f"static:{static}" if static else "")


def served_names(spec: str) -> str:
    """A model spec's ids for the HTTP API (`served_model_name`'s form): a hub id as given (as vLLM serves it) and its
    short name, which both answer; else `served_name`."""
    short = served_name(spec)
    full = spec.rstrip("/")
    hub_id = full.count("/") == 1 and not full.startswith((".", "/", "~")) and not full.endswith(".gguf")
    return f"{full},{short}" if hub_id and full != short else short


def served_name(spec: str) -> str:
    """A model spec's id for the HTTP API: default-target's model name, else its last path part (no .gguf)."""
    spec = spec.rstrip("/")
    if spec == DEFAULT_TARGET:
        return DEFAULT_TARGET_NAME
    return PurePath(spec).name.removesuffix(".gguf") or "specdec"
