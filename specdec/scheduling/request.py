"""What a generation request is (modes, defaults, validation) and what it returns (tokens, statistics). Its fields'
ranges are specdec/scheduling/field_rules.py's, the one table of them that the coordinator applies too.

The schedules that run a request are in `specdec.scheduling.schedule`; these types are shared by the engine, the
coordinator, the benchmarks and the tests.
"""
from __future__ import annotations

import enum
import uuid
from dataclasses import asdict, dataclass, field, fields

from specdec.decoding.sampling import SamplingParams

MODES = ("ar", "sd", "pacer", "pearl", "pacer_pearl")
# gamma when a request leaves it unset. sd: the draft length. pacer: the most it may draft (the pre-verifier
# decides; a bf16 verify of 9 rows costs about what 1 row does on the default target). PEARL modes: the window,
# an upper bound only, since drafting runs while the target verifies and is cut off when the verify returns;
# 8 draft tokens take about as long as one target verify of the default pair (8.3 ms vs ~76-100 ms).
MAX_SPEC_OFF_BATCH = 1024  # largest spec_off_batch a request (or the coordinator's default) may set
# pacer_pearl, drafting in the shadow of a verify: the pre-verifier stops it when its score falls below θ_post. If a
# shadow draft token cost only its extra verify row, θ_post = (cost of a row) / (wall time per generated token)
# ≈ 0.01 here. But where draft and target share a host's cores and memory bandwidth (the 2-core CPU deployment,
# `specdec serve`), every shadow token also slows the verify it hides behind. In process, greedy, θ_post 0.3 / 0.6 /
# 0.9: 42.3 / 48.4 / 49.7 tok/s over 16 prompts, 44.5 / 47.2 / 45.8 over 8; 0.6 and 0.9 tie, 0.3 loses 6-17 %
# (docs/design/pacer.md, "Shadow drafting θ"). Replicas on machines of their own should set a low value
# (COORDINATOR_PACER_POST_THRESHOLD, or per request).
DEFAULT_POST_THRESHOLD = 0.6
PEARL_OVERLAP = ("auto", "always")
DEFAULT_GAMMA = {"ar": 4, "sd": 4, "pacer": 8, "pearl": 8, "pacer_pearl": 8}


class DraftStop(enum.Enum):
    """How a round's draft ends: one half of a mode."""
    NONE = "none"  # no draft (ar)
    FIXED = "fixed"  # gamma tokens (sd, pearl)
    PREVERIFIER = "preverifier"  # PACER's pre-verifier ends it (pacer, pacer_pearl)


class Overlap(enum.Enum):
    """Whether the draft runs while the target verifies: the other half of a mode. AUTO and ALWAYS are PEARL's
    (pearl_overlap auto and always); OFF is sequential rounds."""
    OFF = "off"
    AUTO = "auto"
    ALWAYS = "always"


# the modes' names for the (draft stop, overlapped) pairs: sd, pacer, pearl and pacer_pearl are the four
# combinations of a drafting stop rule with overlap off or on; ar drafts nothing
MODE_PAIRS = {"ar": (DraftStop.NONE, False), "sd": (DraftStop.FIXED, False), "pacer": (DraftStop.PREVERIFIER, False),
              "pearl": (DraftStop.FIXED, True), "pacer_pearl": (DraftStop.PREVERIFIER, True)}
_MODE_OF = {pair: name for name, pair in MODE_PAIRS.items()}


def mode_name(stop: DraftStop, overlap: Overlap) -> str:
    """The mode a (draft stop, overlap) pair is; ValueError for ar with overlap (nothing to overlap)."""
    key = (stop, overlap is not Overlap.OFF)
    if key not in _MODE_OF:
        raise ValueError("a request that drafts nothing (ar) has no draft to overlap")
    return _MODE_OF[key]


def mode_pair(mode: str, pearl_overlap: str = "auto") -> tuple[DraftStop, Overlap]:
    """A mode's (draft stop, overlap) pair; `pearl_overlap` (auto | always) applies to the overlapped modes."""
    stop, overlapped = MODE_PAIRS[mode]
    return stop, Overlap(pearl_overlap) if overlapped else Overlap.OFF


@dataclass(frozen=True)
class Speculation:
    """How a request speculates, typed: the mode as its (draft_stop, overlap) pair and the settings that go with it
    (None: the mode's or the replica's default). A GenerationRequest carries the same as flat fields, for the
    schedules; `GenerationRequest.speculation` and `Speculation.request_fields` go between the two."""
    draft_stop: DraftStop = DraftStop.FIXED
    overlap: Overlap = Overlap.OFF
    gamma: int | None = None
    block_size: int | None = None
    pacer_threshold: float | None = None
    pacer_skip_below: float | None = None
    pacer_post_threshold: float | None = None
    pearl_first_block: int | None = None
    spec_off_batch: int | None = None
    verify_method: str = "block"  # specdec.decoding.verify.METHODS

    @property
    def mode(self) -> str:
        return mode_name(self.draft_stop, self.overlap)

    @property
    def pearl_overlap(self) -> str:
        """PEARL's overlap setting (auto | always); sequential modes keep the default."""
        return "auto" if self.overlap is Overlap.OFF else self.overlap.value

    def request_fields(self) -> dict:
        """GenerationRequest's keyword arguments for this speculation."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("draft_stop", "overlap")}
        return {**out, "mode": self.mode, "pearl_overlap": self.pearl_overlap}


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    params: SamplingParams = field(default_factory=SamplingParams)
    mode: str = "sd"
    gamma: int | None = None  # sd: draft length; pearl: draft window; pacer: gamma_max (None: DEFAULT_GAMMA)
    block_size: int | None = None  # pacer: tokens per pre-verifier check (None: the pre-verifier's trained B)
    verify_method: str = "block"  # ignored (greedy) at temperature 0
    pacer_threshold: float | None = None
    pacer_post_threshold: float | None = None  # pacer_pearl while a verify runs (None: DEFAULT_POST_THRESHOLD)
    pacer_skip_below: float | None = None  # pacer: first block below this → draft nothing, an `ar` step (None: never)
    pearl_first_block: int | None = None  # PEARL modes: PRE round length, 0 = pre-verify (None: chosen per round)
    # load-adaptive speculation (vLLM's speculative_disable_by_batch_size): a round is a plain target step while
    # the target's last forward batched at least this many sessions; speculation resumes when it batches fewer.
    # Lossless either way (an `ar` step samples from the target). None/0: always speculate
    spec_off_batch: int | None = None
    # pearl, pacer_pearl (greedy, pearl_first_block unset): "auto" runs each round overlapped or sequentially,
    # whichever has been faster in this request (specdec/scheduling/overlap.py); "always" keeps PEARL's overlap
    pearl_overlap: str = "auto"
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # services: while the pools are full, waiting requests are served lower values first
    session_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def resolve_defaults(self) -> "GenerationRequest":
        """Sets an unset gamma to its mode's default (the schedules read it set)."""
        if self.gamma is None:
            self.gamma = DEFAULT_GAMMA.get(self.mode)
        return self

    @property
    def method(self) -> str:
        return "greedy" if self.params.greedy else self.verify_method

    @property
    def speculation(self) -> Speculation:
        """The request's mode and speculation settings, typed."""
        stop, overlap = mode_pair(self.mode, self.pearl_overlap)
        keep = {f.name: getattr(self, f.name) for f in fields(Speculation) if f.name not in ("draft_stop", "overlap")}
        return Speculation(stop, overlap, **keep)

    @property
    def sequential_calls(self) -> bool:
        """Whether each replica call of this request is answered before the next is made, with no call cancelled
        mid-flight: ar, sd and pacer. The PEARL modes overlap a draft stream with verifies and cancel what a
        rejection makes moot (a transport must keep such calls of one session in order: specdec_rpc/frames.py)."""
        return self.mode in ("ar", "sd", "pacer")


@dataclass
class PipelineRequest:
    """A request as a front door hands it to a pipeline (coordinator/backends/pipeline.py `Pipeline.stream`): the core's
    request, typed, and what the pipeline does around it. Its request id is the request's session id. It goes to the
    pipeline as it is: in process, or pickled whole to a Ray pipeline actor (coordinator/actor.py)."""
    generation: GenerationRequest
    draft_fallback: bool = True  # no draft replica reachable: run target-only (COORDINATOR_DRAFT_FALLBACK)
    final_only: bool = False  # the caller reads only the last event (a whole answer without stop strings)
    trace_headers: dict[str, str] = field(default_factory=dict)  # W3C trace context for the replica calls

    @property
    def request_id(self) -> str:
        return self.generation.session_id


@dataclass
class GenerationStats:
    mode: str = ""
    rounds: int = 0
    target_forwards: int = 0
    draft_tokens: int = 0  # proposed
    accepted_tokens: int = 0
    wasted_draft_tokens: int = 0  # proposed but never verified (cancelled or discarded speculation)
    target_only_rounds: int = 0  # rounds run as plain target steps because the target was busy (spec_off_batch)
    sequential_rounds: int = 0  # PEARL modes: rounds that adaptive overlap ran sequentially (pearl_overlap auto)
    # PEARL modes, greedy, direct data plane: chained verifies answered (specdec/scheduling/chained.py)
    chained_rounds: int = 0
    mean_accepted_length: float = 0.0  # generated tokens per target forward (counts the bonus/recovered token)
    draft_busy_s: float = 0.0
    target_busy_s: float = 0.0
    network_s: float = 0.0  # filled by remote backends: time in calls minus compute reported by servers
    cached_prompt_tokens: int = 0  # prompt positions the target reused from its prefix cache (not prefilled)
    wall_s: float = 0.0
    # vLLM's spec-decode counters, per request: drafted blocks the target verified (one per round that drafted),
    # the draft tokens it checked (`draft_tokens` also counts those proposed and never checked), and of the
    # accepted tokens those at each position of their block (index 0: a block's first token; sums to accepted)
    drafts: int = 0
    verified_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    # PACER's decisions (pacer, pacer_pearl; docs/operations/metrics.md, "What only a disaggregated stack shows"):
    # after each block of a draft the pre-verifier stops or continues. A false stop: it stopped a draft the target
    # then accepted whole; a false continue: it continued, and the target accepted none of the block it went into
    pacer_stops: int = 0
    pacer_false_stops: int = 0
    pacer_continues: int = 0
    pacer_false_continues: int = 0
    # PEARL modes, overlapped rounds only: their wall time, and how much of it each side spent not computing
    overlap_wall_s: float = 0.0
    draft_idle_s: float = 0.0
    target_idle_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # length | stop | cancelled
    stats: GenerationStats
    # per token of token_ids: (logprob, top ids, top logprobs) under the target (SamplingParams.logprobs >= 0)
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    # the prompt's tokens after the first (SamplingParams.prompt_logprobs >= 0): a
    # specdec.decoding.sampling.TokenLogprobs
    prompt_logprobs: object | None = None
