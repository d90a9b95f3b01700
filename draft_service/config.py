"""DraftService settings: `DRAFT_*` environment variables, CLI flags override."""
from __future__ import annotations

import importlib

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from specdec.common.defaults import DEFAULT_DRAFT, DRAFT_METRICS_PORT, DRAFT_PORT, PROMPT_LOOKUP_MIN_NGRAM, QUANT_MODES
from specdec.decoding.lookup import prompt_lookup
from specdec_rpc.settings import ServerSettings


class DraftSettings(ServerSettings):
    model_config = SettingsConfigDict(env_prefix="DRAFT_",
                                      cli_prog_name="python -m draft_service")

    model: str = DEFAULT_DRAFT
    port: int = Field(DRAFT_PORT, ge=0, le=65535)
    metrics_port: int = Field(DRAFT_METRICS_PORT, ge=0, le=65535)
    max_context: int = Field(2048, ge=0, description="positions per session (0: the model's maximum; KV memory grows with it)")
    quant: str = Field("auto", description="weight quantization: auto (int8 weights on a CPU serving bf16, where "
                                           "the int8 GEMV is ~3x faster), none, int8")
    preverifier: str = Field("", description="PACER pre-verifier dir ('' none, 'default' the shipped one)")
    pacer_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="θ of PACER's stop rule for requests that set none (default: the "
        "pre-verifier's own, tuned on the host its card names). The best θ follows the host's draft/target cost "
        "ratio (docs/design/pacer.md, 'Choosing θ')")
    q_top_k: int = Field(64, ge=1, description="the draft samples from its top-k, so q is exactly sparse")
    target_vocab_size: int = Field(
        0, ge=0, description="the target model's vocabulary size where the draft checkpoint has fewer rows of the "
        "same tokenizer (Qwen2.5-0.5B's 151936 for Qwen2.5-7B's 152064): the draft then takes every target id and "
        "proposes none past its rows (specdec/text/vocab.py); 0: the draft's own")
    prompt_lookup_min_ngram: int = Field(
        PROMPT_LOOKUP_MIN_NGRAM, ge=0, description="prompt lookup: where the context's last N tokens (N >= this) occurred before, draft "
        "the token that followed them instead of the model's (q one-hot: lossless); 0 turns it off "
        "(specdec/decoding/lookup.py)")
    prompt_lookup_max_ngram: int = Field(6, ge=1, description="prompt lookup: the longest n-gram compared")
    target_routes: str = Field(
        "", description="direct data plane (COORDINATOR_DATA_PLANE=direct): the address this replica dials for a "
        "target endpoint the coordinator names, as 'endpoint=address,...' (a proxy or relay between the pools, as "
        "`specdec serve --emulate-rtt-ms` puts there); an endpoint not listed is dialed as named")
    peer_frames: bool = Field(True, description="direct data plane: send the verifies to a target replica's frame "
                              "port (a plain TCP or TLS socket beside gRPC, specdec_rpc/frames.py) where it serves "
                              "one and its endpoint has no target_routes entry, else on its gRPC stream")
    max_batch_size: int = Field(16, ge=1, description="sessions drafting in one batched forward")
    max_queue: int = Field(256, ge=1, description="queued draft calls before RESOURCE_EXHAUSTED")
    worker_factory: str = Field(
        "", description="the replica's draft worker as 'module:callable', called as DraftWorker is (the model, "
        "then its keyword arguments) and returning a DraftWorker: a subclass that changes what is proposed, such as "
        "the benchmarks' synthetic-acceptance draft (specdec_bench.synthetic:replica_worker); '' DraftWorker itself")

    def prompt_lookup(self):
        """The drafting's PromptLookup, or None when turned off."""
        return prompt_lookup(self.prompt_lookup_min_ngram, self.prompt_lookup_max_ngram)

    def draft_worker(self):
        """The callable that builds this replica's draft worker: DraftWorker, or the one `worker_factory` names."""
        if not self.worker_factory:
            from specdec.workers.draft import DraftWorker  # lazy: the settings load without torch

            return DraftWorker
        module, name = self.worker_factory.split(":")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"worker_factory {self.worker_factory!r}: {e}") from None

    @field_validator("worker_factory")
    @classmethod
    def _factory(cls, v: str) -> str:
        if v and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"worker_factory must be 'module:callable' (or empty), got {v!r}")
        return v

    @field_validator("quant")
    @classmethod
    def _quant(cls, v: str) -> str:
        if v not in QUANT_MODES:
            raise ValueError(f"quant must be one of {', '.join(QUANT_MODES)}, got {v!r}")
        return v
