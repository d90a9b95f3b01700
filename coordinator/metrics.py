"""Coordinator metrics, every name in one place, registered next to the shared server metrics on the same /metrics
port.

Speculative decoding follows vLLM's metrics one for one under our prefix: vLLM's `vllm:spec_decode_<name>` is
`specdec_spec_decode_<name>` here (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos with its `position` label), so a vLLM dashboard ports by changing the prefix
(docs/operations/metrics.md shows the PromQL side by side). They count finished requests (each request's own
stats), by `mode` and model pair (`draft_model`, `target_model`: the replicas' model names). Beside them, what only
a disaggregated PEARL/PACER deployment has: PACER's false stops and continues, each side's idle time in overlapped
rounds, and the time a request spends on each network link.
"""
from __future__ import annotations

from pathlib import PurePath
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from specdec.scheduling.request import MODES

if TYPE_CHECKING:
    from coordinator.events import RequestStats

_SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# a whole request: up to the token cap (4096 by default) at 0.05-0.1 s a token under load
_REQUEST_SECONDS = _SECONDS[:-1] + (60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's finish_reason label values; "abort": the client went away
PACER_MODES = ("pacer", "pacer_pearl")
PEARL_MODES = ("pearl", "pacer_pearl")
# the draft replica calls the target replica itself only with the direct data plane (COORDINATOR_DATA_PLANE=direct)
LINKS = ("coordinator-draft", "coordinator-target", "draft-target")
_NETWORK_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


def model_label(spec: str) -> str:
    """A replica's model (ModelInfo.model: a name, a directory or a .gguf file) as a label value: its last path
    part."""
    spec = (spec or "").rstrip("/")
    return PurePath(spec).name.removesuffix(".gguf") if spec else ""


class CoordinatorMetrics:
    def __init__(self, registry):
        self._request_metrics(registry)
        self._fallback_metrics(registry)
        self._spec_decode_metrics(registry)
        self._pacer_metrics(registry)
        self._overlap_metrics(registry)
        self._network_metrics(registry)
        self._pairs: set[tuple[str, str]] = set()
        self._known_series()

    def _request_metrics(self, r) -> None:
        """vLLM's request metrics: requests running, waiting, finished and failed, their tokens and latencies."""
        # set_function'ed by the server: requests in flight less those waiting for sessions
        self.running = Gauge("specdec_num_requests_running", "Requests being generated (holding replica sessions)",
                             registry=r)
        self.requests = Counter("specdec_request_success", "Finished requests: generated to a stop or the length "
                                "limit, or given up when the client went away (abort)", ["finish_reason"],
                                registry=r)
        # every failed request, from either door, by gRPC status name (a fixed set): INVALID_ARGUMENT and the other
        # client mistakes apart from UNAVAILABLE / INTERNAL / DEADLINE_EXCEEDED, which the alerts watch
        self.errors = Counter("specdec_request_errors", "Requests that failed, by status", ["code"], registry=r)
        self.tokens = Counter("specdec_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Time to the first verified token",
                              buckets=_SECONDS, registry=r)
        # rounds by kind: `speculative` (draft + verify) or `target_only` (load-adaptive speculation switched off)
        self.rounds = Counter("specdec_rounds", "Decoding rounds of finished requests", ["kind"], registry=r)
        self.waiting = Gauge("specdec_num_requests_waiting", "Requests waiting for free replica sessions",
                             registry=r)
        # time a request waited for free replica sessions (pools at capacity; coordinator/routing/pool.py, "Admission")
        self.queue_time = Histogram("specdec_request_queue_time_seconds", "Time waiting for free replica sessions",
                                    buckets=(0.001,) + _SECONDS, registry=r)
        self.e2e = Histogram("specdec_e2e_request_latency_seconds", "Request latency (finished and aborted "
                             "requests)", buckets=_REQUEST_SECONDS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter("specdec_cached_prompt_tokens", "Of the prompt tokens, those the target "
                                            "replica reused from its prefix cache", registry=r)
        # vLLM's time_per_output_token: a streamed request's (e2e - TTFT) / (tokens - 1); speculation delivers
        # tokens in bursts, so this is the rate a reader sees, not the gap between two deliveries
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "Time per generated token after the first "
                              "(streamed requests of 2+ tokens)",
                              buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
                              registry=r)

    def _fallback_metrics(self, r) -> None:
        """Requests served short of what they asked: target-only fallbacks, sessions preempted."""
        # requests that ran target-only, wholly or from some point on, because no draft replica was reachable
        # (reason "unreachable": alert on it, deploy/monitoring/prometheus-rules.yaml) or the request is past the
        # draft replicas' context ("context"; COORDINATOR_DRAFT_FALLBACK): exact but slower
        self.draft_unavailable = Counter("specdec_draft_unavailable", "Requests that fell back to target-only "
                                         "decoding: no draft replica reachable, or past the draft's context",
                                         ["reason"], registry=r)
        # sessions given up to requests of higher priority (COORDINATOR_PREEMPT; coordinator/routing/preemption.py)
        self.preemptions = Counter("specdec_preemptions", "Replica sessions requests gave up to requests of higher "
                                   "priority, to resume later", registry=r)

    def _spec_decode_metrics(self, r) -> None:
        """vLLM's speculative-decoding counters, by mode and model pair."""
        # vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _num_accepted_tokens_per_pos
        # (+ _num_emitted_tokens of vLLM V0, and target forwards), from each finished request's stats, by mode and
        # model pair. Draft tokens: those the target verified (vLLM's meaning: acceptance rate = accepted / draft
        # tokens; PEARL's discarded speculation is not in it); mean acceptance length = 1 + accepted / drafts
        pair = ["mode", "draft_model", "target_model"]
        self.spec_drafts = Counter("specdec_spec_decode_num_drafts", "Drafted blocks the target verified",
                                   pair, registry=r)
        self.spec_draft_tokens = Counter("specdec_spec_decode_num_draft_tokens", "Draft tokens the target verified",
                                         pair, registry=r)
        self.spec_accepted_tokens = Counter("specdec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            pair, registry=r)
        self.spec_accepted_per_pos = Counter("specdec_spec_decode_num_accepted_tokens_per_pos", "Draft tokens "
                                             "accepted, by their position in their block (0: a block's first)",
                                             pair + ["position"], registry=r)
        self.spec_emitted_tokens = Counter("specdec_spec_decode_num_emitted_tokens", "Tokens generated", pair,
                                           registry=r)
        self.spec_target_forwards = Counter("specdec_spec_decode_num_target_forwards", "Target forwards", pair,
                                            registry=r)

    def _pacer_metrics(self, r) -> None:
        """PACER's pre-verifier decisions, by mode."""
        # PACER's decisions after each block of a draft the target verified whole (pacer, pacer_pearl): a false stop
        # stopped a draft the target accepted whole; a false continue drafted a block the target accepted none of
        self.pacer_stops = Counter("specdec_pacer_stops", "Drafts the pre-verifier stopped", ["mode"], registry=r)
        self.pacer_false_stops = Counter("specdec_pacer_false_stops", "Drafts the pre-verifier stopped that the "
                                         "target accepted whole", ["mode"], registry=r)
        self.pacer_continues = Counter("specdec_pacer_continues", "Blocks the pre-verifier let a draft go on "
                                       "into", ["mode"], registry=r)
        self.pacer_false_continues = Counter("specdec_pacer_false_continues", "Blocks the pre-verifier let a draft "
                                             "go on into that the target accepted none of", ["mode"], registry=r)

    def _overlap_metrics(self, r) -> None:
        """PEARL's overlapped rounds and each side's idle time in them, by mode."""
        # PEARL's overlap (pearl, pacer_pearl): overlapped rounds, their wall time, and of it each side's idle time
        self.overlap_rounds = Counter("specdec_overlap_rounds", "Rounds run overlapped (PEARL)", ["mode"],
                                      registry=r)
        self.overlap_seconds = Counter("specdec_overlap_seconds", "Wall time of overlapped rounds", ["mode"],
                                       registry=r)
        self.draft_idle = Counter("specdec_overlap_draft_idle_seconds", "Of the overlapped rounds' wall time, the "
                                  "draft replica's time not drafting", ["mode"], registry=r)
        self.target_idle = Counter("specdec_overlap_target_idle_seconds", "Of the overlapped rounds' wall time, "
                                   "the target replica's time not verifying", ["mode"], registry=r)

    def _network_metrics(self, r) -> None:
        """Network time, per link between the processes (LINKS)."""
        # a request's time in replica calls less the compute (and queueing) the replicas report, per link
        self.network = Histogram("specdec_request_network_seconds", "A request's network time, per link", ["link"],
                                 buckets=_NETWORK_SECONDS, registry=r)

    def _known_series(self) -> None:
        """Every known series from the start, as vLLM does: no "No data" panels (a model pair's spec-decode series
        start at its first request, `_new_pair`)."""
        for reason in FINISH_REASONS:
            self.requests.labels(reason)
        for kind in ("speculative", "target_only"):
            self.rounds.labels(kind)
        for mode in PACER_MODES:
            for c in (self.pacer_stops, self.pacer_false_stops, self.pacer_continues, self.pacer_false_continues):
                c.labels(mode)
        for mode in PEARL_MODES:
            for c in (self.overlap_rounds, self.overlap_seconds, self.draft_idle, self.target_idle):
                c.labels(mode)
        for link in LINKS:
            self.network.labels(link)

    def _new_pair(self, draft: str, target: str) -> None:
        """A model pair's spec-decode series for every mode, at its first request (the pair is known only then)."""
        self._pairs.add((draft, target))
        for mode in MODES:
            for c in (self.spec_drafts, self.spec_draft_tokens, self.spec_accepted_tokens, self.spec_emitted_tokens,
                      self.spec_target_forwards):
                c.labels(mode, draft, target)

    def finished(self, stats: RequestStats, finish: str, n_tokens: int, e2e: float, ttft: float | None) -> None:
        """A request that generated to its end (`finish`: stop, length, ...)."""
        self.requests.labels(finish).inc()
        self.tokens.inc(n_tokens)
        self.e2e.observe(e2e)
        if ttft is not None and n_tokens > 1:
            self.tpot.observe((e2e - ttft) / (n_tokens - 1))
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.queue_time.observe(stats.queued_s)
        if stats.draft_unavailable:
            self.draft_unavailable.labels(stats.draft_fallback or "unreachable").inc()
        self.preemptions.inc(stats.preemptions)
        off = stats.target_only_rounds
        self.rounds.labels("target_only").inc(off)
        mode = stats.mode
        if mode != "ar":
            self.rounds.labels("speculative").inc(max(0, stats.rounds - off))
        if mode in MODES:
            draft, target = model_label(stats.draft_model), model_label(stats.target_model)
            if (draft, target) not in self._pairs:
                self._new_pair(draft, target)
            pair = (mode, draft, target)
            self.spec_drafts.labels(*pair).inc(stats.drafts)
            self.spec_draft_tokens.labels(*pair).inc(stats.verified_draft_tokens)
            self.spec_accepted_tokens.labels(*pair).inc(stats.accepted_tokens)
            for pos, n in enumerate(stats.accepted_per_position):
                self.spec_accepted_per_pos.labels(*pair, str(pos)).inc(n)
            self.spec_emitted_tokens.labels(*pair).inc(n_tokens)
            self.spec_target_forwards.labels(*pair).inc(stats.target_forwards)
        if mode in PACER_MODES:
            self.pacer_stops.labels(mode).inc(stats.pacer_stops)
            self.pacer_false_stops.labels(mode).inc(stats.pacer_false_stops)
            self.pacer_continues.labels(mode).inc(stats.pacer_continues)
            self.pacer_false_continues.labels(mode).inc(stats.pacer_false_continues)
        if mode in PEARL_MODES:
            self.overlap_rounds.labels(mode).inc(max(0, stats.rounds - off - stats.sequential_rounds))
            self.overlap_seconds.labels(mode).inc(stats.overlap_wall_s)
            self.draft_idle.labels(mode).inc(stats.draft_idle_s)
            self.target_idle.labels(mode).inc(stats.target_idle_s)
        if stats.draft_replica:
            self.network.labels("coordinator-draft").observe(stats.draft_network_s)
        if stats.target_replica and not stats.peer_network_s:
            self.network.labels("coordinator-target").observe(stats.target_network_s)
        if stats.peer_network_s:
            self.network.labels("draft-target").observe(stats.peer_network_s)
