"""What the schedules (`specdec.scheduling.schedule`) share: the two backends' interfaces, and one request's run state
(its token history, the commit and stop logic, statistics, and the target logprobs waiting for their tokens)."""
from __future__ import annotations

from typing import AsyncIterator, Callable, Protocol

from specdec.decoding.sampling import SamplingParams
from specdec.decoding.stop import StopSpec
from specdec.decoding.verify import SparseDist
from specdec.scheduling.request import GenerationRequest, GenerationStats
from specdec.state.feature_state import TargetFeatures
from specdec.workers.drafting import DraftBlock
from specdec.workers.target import VerifyOutcome


class DraftBackend(Protocol):
    reads_features: bool  # a feature draft: send it the target's features (docs/design/feature_draft.md)

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    features: list[TargetFeatures] | None = None) -> None: ...
    def draft_stream(self, session_id: str, base_position: int, append: list[int], gamma_max: int,
                     stop: StopSpec, block_size: int,
                     features: list[TargetFeatures] | None = None) -> AsyncIterator[DraftBlock]: ...
    async def draft(self, session_id: str, base_position: int, append: list[int], gamma_max: int, stop: StopSpec,
                    block_size: int, features: list[TargetFeatures] | None = None) -> DraftBlock:
        """A draft nobody cuts (the stop rule or gamma_max ends it), returned whole: one message, no blocks."""
    async def cancel(self, session_id: str) -> None: ...
    async def end(self, session_id: str) -> None: ...


class TargetBackend(Protocol):
    # verifies a greedy PEARL request may keep in flight (> 1: chained rounds, specdec/scheduling/chained.py; the direct
    # data plane's target across a network); 0 or 1: one verify at a time
    chain_window: int

    async def start(self, session_id: str, prompt_ids: list[int], params: SamplingParams,
                    want_features: bool = False) -> TargetFeatures | None: ...
    async def verify(self, session_id: str, base_position: int, feed: list[int], draft: list[int],
                     q: list[SparseDist] | None, method: str, feed_draft: bool = True,
                     sample_bonus: bool = True) -> VerifyOutcome: ...
    async def end(self, session_id: str) -> None: ...


class _Run:
    """The per-request state shared by the schedules: history, commit logic, stop conditions, stats."""

    def __init__(self, req: GenerationRequest, on_tokens: Callable[[list[int], list | None], bool] | None):
        self.req = req
        self.history = list(req.prompt_ids)  # committed tokens; the last one is the pending token
        self.n_prompt = len(req.prompt_ids)
        self.on_tokens = on_tokens
        self.finish: str | None = None
        self.stats = GenerationStats(mode=req.mode)
        self.draft_fed = self.target_fed = self.n_prompt - 1
        self.features: list[TargetFeatures] = []  # target features the (feature) draft has not been sent yet
        self.last_batch = 1  # sessions in the target forward of the last verify (PEARL's PRE round reads it)
        # logprobs (req.params.logprobs >= 0): what verifies returned, by absolute position, until committed
        self.wants_logprobs = req.params.logprobs >= 0
        self.logprob_at: dict[int, tuple[int, tuple[float, list[int], list[float]]]] = {}
        self.logprobs: list[tuple[float, list[int], list[float]]] = []

    def take_features(self) -> list[TargetFeatures] | None:
        out, self.features = self.features, []
        return out or None

    @property
    def generated(self) -> list[int]:
        return self.history[self.n_prompt:]

    def commit(self, tokens: list[int]) -> None:
        room = self.req.max_new_tokens - len(self.generated)
        out = []
        for t in tokens[:room]:
            out.append(t)
            if t in self.req.eos_token_ids:
                self.finish = "stop"
                break
        new_logprobs = self._take_logprobs(out) if self.wants_logprobs else None
        self.history.extend(out)
        if self.finish is None and len(self.generated) >= self.req.max_new_tokens:
            self.finish = "length"
        if out and self.on_tokens is not None and self.on_tokens(out, new_logprobs):
            self.finish = self.finish or "stop"

    def _take_logprobs(self, tokens: list[int]) -> list:
        """The logprobs of `tokens`, about to be committed at the next positions (every committed token came from a
        verify that returned its logprob)."""
        pos = len(self.history)
        out = []
        for i, t in enumerate(tokens):
            token, entry = self.logprob_at.pop(pos + i, (None, None))
            if token != t:
                raise RuntimeError(f"no target logprob for token {t} at position {pos + i}")
            out.append(entry)
        for stale in [p for p in self.logprob_at if p < pos + len(tokens)]:
            del self.logprob_at[stale]
        self.logprobs.extend(out)
        return out

    def draft_args(self) -> tuple[int, list[int]]:
        base = min(self.draft_fed, len(self.history) - 1)
        return base, self.history[base:]

    def target_args(self) -> tuple[int, list[int]]:
        if self.target_fed >= len(self.history):  # everything fed: the target's stored row predicts what's next
            return len(self.history), []
        return self.target_fed, self.history[self.target_fed:]

    def on_verify(self, out: VerifyOutcome, n_checked: int, position: int = 0) -> None:
        """`n_checked` draft tokens were verified, the first at `position` of its drafted block (PEARL checks a
        block in pieces); a block whose first token is checked is one draft."""
        st = self.stats
        st.target_forwards += int(out.forwarded)
        st.target_busy_s += (out.forward_ns + out.verify_ns) / 1e9
        st.accepted_tokens += out.num_accepted
        if n_checked:
            st.drafts += position == 0
            st.verified_draft_tokens += n_checked
            per_pos = st.accepted_per_position
            if len(per_pos) < position + out.num_accepted:
                per_pos.extend([0] * (position + out.num_accepted - len(per_pos)))
            for i in range(position, position + out.num_accepted):
                per_pos[i] += 1
        if out.forwarded:
            self.last_batch = out.batch_size
        if out.features is not None and len(out.features):
            self.features.append(out.features)
        if self.wants_logprobs and out.logprobs is not None:
            lp = out.logprobs
            for i, t in enumerate(lp.token_ids):
                self.logprob_at[lp.position + i] = (t, (lp.logprobs[i], lp.top_ids[i], lp.top_logprobs[i]))

    def judge_pacer(self, block: DraftBlock, accepted: int) -> None:
        """PACER's decisions in a draft the target verified whole (`accepted` of its tokens, from its first): after
        each of its blocks but the last it continued, after the last it stopped (stop reason `preverifier`) or ran
        into gamma_max / a cut. A stop is false where the target accepted the whole draft (drafting on might have
        paid); a continue is false where the target accepted none of the block it continued into."""
        n, size = len(block.tokens), block.block_size
        if not n or size <= 0:
            return
        st = self.stats
        blocks = -(-n // size)
        st.pacer_continues += blocks - 1
        if accepted < n:  # the continues into blocks that start at or past the first rejection
            st.pacer_false_continues += max(0, blocks - max(1, -(-accepted // size)))  # i*size >= accepted
        if block.stop_reason == "preverifier":
            st.pacer_stops += 1
            st.pacer_false_stops += accepted >= n
