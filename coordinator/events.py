"""What a pipeline (coordinator/backends/pipeline.py `Pipeline.stream`) yields for one request, and the stats of a
finished request that the front door, the metrics, the traces and the request log read.

A request's events, in order:
    TokensEvent   newly verified tokens (and their logprobs), the replicas it holds where they changed
    ServedEvent   only the replicas it holds, where they changed (a caller that reads only the last event)
    DoneEvent     the last event: the whole answer and its `RequestStats`
    ErrorEvent    the last event on failure: a gRPC status name and a message

Plain dataclasses: they pickle, so they cross from a Ray pipeline actor (coordinator/actor.py) to the driver.
"""
from __future__ import annotations

import dataclasses

from specdec.scheduling.request import GenerationStats


@dataclasses.dataclass(frozen=True)
class Served:
    """What a request holds: its prompt's tokens, the prompt positions its first target replica had cached, and the
    replicas that served it (addresses, comma-separated after a move; '' for none)."""
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    target_replica: str = ""
    draft_replica: str = ""


@dataclasses.dataclass
class RequestStats(GenerationStats):
    """A finished request's stats: the schedule's (`GenerationStats`; `network_s` and `cached_prompt_tokens` as the
    coordinator measured them: every link, the target replica the request started on), the coordinator's own, and
    what the front door adds (`completion_tokens` as it sent them, `request_id`, `reasoning_tokens`). The gRPC
    GenerationStats message carries the fields it has of the same names."""
    draft_network_s: float = 0.0  # coordinator <-> draft, per link
    target_network_s: float = 0.0  # coordinator <-> target
    peer_network_s: float = 0.0  # draft <-> target (direct data plane)
    draft_model: str = ""
    target_model: str = ""
    queued_s: float = 0.0  # waiting for replica sessions (admission) and pinning them
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_replica: str = ""
    target_replica: str = ""
    draft_unavailable: bool = False  # it went on target-only: no draft replica, or past the draft's context
    draft_fallback: str = ""  # why: "unreachable" or "context"
    preemptions: int = 0
    request_id: str = ""
    reasoning_tokens: int = 0  # the generated tokens up to and including the end of reasoning (separate_reasoning)

    @classmethod
    def of(cls, generation: GenerationStats, **fields) -> RequestStats:
        """The schedule's stats with the coordinator's `fields` (these replace the schedule's of the same name)."""
        own = {f.name: getattr(generation, f.name) for f in dataclasses.fields(GenerationStats)}
        return cls(**(own | fields))


@dataclasses.dataclass(frozen=True)
class TokensEvent:
    """Newly verified tokens, in order; `logprobs`: per token, (logprob, top ids, top logprobs) where the request
    asked for them; `served`: the replicas the request holds, where they changed since the last event."""
    tokens: list[int]
    logprobs: list | None = None
    served: Served | None = None


@dataclasses.dataclass(frozen=True)
class ServedEvent:
    """The replicas the request holds changed (a caller that reads only the last event gets no tokens before it:
    a request that ends without it, a client's abort, is logged with them)."""
    served: Served


@dataclasses.dataclass(frozen=True)
class DoneEvent:
    """The last event of a request that generated to its end. `finish_reason`: length, stop or cancelled;
    `prompt_logprobs`: per prompt token after the first, (logprob, top ids, top logprobs), where asked for."""
    token_ids: list[int]
    finish_reason: str
    stats: RequestStats
    logprobs: list | None = None
    prompt_logprobs: list | None = None


@dataclasses.dataclass(frozen=True)
class ErrorEvent:
    """The last event of a request that failed: `code`, a gRPC status name (INVALID_ARGUMENT, UNAVAILABLE, ...)."""
    code: str
    message: str


Event = TokensEvent | ServedEvent | DoneEvent | ErrorEvent
