"""TargetService settings: `TARGET_*` environment variables, CLI flags override."""
from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from specdec.common.defaults import DEFAULT_TARGET, PROMPT_LOOKUP_MIN_NGRAM, TARGET_METRICS_PORT, TARGET_PORT
from specdec.decoding.lookup import prompt_lookup
from specdec_rpc.settings import ServerSettings


class TargetSettings(ServerSettings):
    model_config = SettingsConfigDict(env_prefix="TARGET_",
                                      cli_prog_name="python -m target_service")

    model: str = DEFAULT_TARGET
    port: int = Field(TARGET_PORT, ge=0, le=65535)
    metrics_port: int = Field(TARGET_METRICS_PORT, ge=0, le=65535)
    max_context: int = Field(2048, ge=0, description="positions per session (0: the model's maximum; KV memory grows with it)")
    batch_window_ms: float = Field(100.0, ge=0, le=1000, description="max wait for other sessions' verify calls "
                                   "(only sessions expected back soon are waited for; 0: never wait)")
    max_batch_size: int = Field(16, ge=1, description="sessions per batched forward")
    max_queue: int = Field(256, ge=1, description="queued verify calls before RESOURCE_EXHAUSTED")
    step_lookup_min_ngram: int = Field(
        PROMPT_LOOKUP_MIN_NGRAM, ge=0, description="chained rounds (the direct data plane across a network): a chained "
        "verify that turns into a target step also checks the tokens prompt lookup finds after the committed ones, "
        "where their last N tokens (N >= this) occurred before (specdec/decoding/lookup.py); 0 turns it off")

    def step_lookup(self):
        """The PromptLookup a target step proposes with, or None (off)."""
        return prompt_lookup(self.step_lookup_min_ngram)
