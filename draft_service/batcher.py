"""Draft batcher: the drafting of concurrent sessions shares forwards (continuous batching, one token a step).

Policy
- Every Draft/DraftStream call becomes a `DraftCall` in the active set. Each step is ONE padded forward of the
  draft (`DraftWorker.advance`) in which every active call drafts one token; a finished call leaves at once and
  a newly arrived one joins at the next step boundary, so nobody waits for another session's whole draft.
- A unary call alone, with one torch thread, is drafted on the event loop's thread (`draft_here`).
- A call alone runs the exact single-session forward. The model thread hands each completed block to its
  consumer as it completes (`call_soon_threadsafe`) and drafts on; it returns to the event loop only when a call
  finishes or the set of calls changes (one arrived, one was abandoned). So a block costs no thread hop: the
  model thread never idles between the blocks of a call, exactly as in the in-process engine.
- One call per session at a time: a newer call of a session waits until its older call has left (PEARL cuts the
  shadow draft and immediately drafts again; the cut lands at the older call's next step).
- More than `max_queue` waiting calls → CapacityError (RESOURCE_EXHAUSTED). At most `max_batch_size` calls share
  a forward; the rest wait their turn.
Blocks go to each call's consumer through an asyncio queue, so a stream sends block k while block k+1 drafts.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specdec.common.errors import CapacityError
from specdec.workers.drafting import DraftBlock
from specdec_rpc.aio import cancel_and_wait
from specdec_rpc.interceptor import ServiceDraining

_END = object()


def _join(a: DraftBlock, b: DraftBlock) -> DraftBlock:
    """Two consecutive blocks of one call as one (b's end state: final, stop reason, score)."""
    return DraftBlock(a.tokens + b.tokens, a.q + b.q, b.stop_reason, a.draft_ns + b.draft_ns, b.final, b.score,
                      a.looked_up + b.looked_up, b.block_size)


@dataclass(eq=False)
class DraftEntry:
    session_id: str
    args: tuple  # DraftWorker.begin(*args)
    blocks: asyncio.Queue = field(default_factory=asyncio.Queue)  # DraftBlock | Exception | _END
    call: object | None = None  # the DraftCall once begun
    abandoned: bool = False  # the consumer went away: leave at the next step
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    admitted_ns: int = 0  # when it joined the step loop: it waited from `submitted_ns` (a trace's batch_wait)

    def wait_ns(self) -> int:
        return max(0, self.admitted_ns - self.submitted_ns) if self.admitted_ns else 0


class DraftBatcher:
    def __init__(self, worker, runner, max_batch_size: int = 16, max_queue: int = 256, metrics=None):
        self.worker, self.runner, self.metrics = worker, runner, metrics
        self.max_batch_size, self.max_queue = max_batch_size, max_queue
        self._pending: list[DraftEntry] = []
        self._active: list[DraftEntry] = []
        self._arrived = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        for e in self._pending + self._active:
            e.blocks.put_nowait(ServiceDraining("the draft replica is shutting down; retry on another"))
        self._pending.clear()
        self._active.clear()

    def submit(self, session_id: str, *args) -> DraftEntry:
        """Queue one call (args of `DraftWorker.begin`); read its blocks with `blocks(entry)`."""
        if len(self._pending) >= self.max_queue:
            raise CapacityError(f"draft queue is full ({self.max_queue} calls waiting); back off and retry, use "
                                f"another draft replica, or raise max_queue")
        e = DraftEntry(session_id, (session_id, *args))
        self._pending.append(e)
        self._depth()
        self._arrived.set()
        return e

    def draft_here(self, session_id: str, *args):
        """A lone unary call, drafted right here on the event loop's thread: no hand-off to the model thread and
        back, no block hops. Only when nothing else drafts or waits and the model thread is idle
        (`ModelThread.can_run_here`); the loop is busy for the call's few tokens, and a call that arrives meanwhile
        starts right after it. → the whole draft as one DraftBlock, or None: `submit` it instead."""
        if self._active or self._pending or not self.runner.can_run_here():
            return None
        if self.metrics is not None:
            self.metrics.batch_size.observe(1)
        return self.worker.draft(session_id, *args)

    async def draft_whole(self, session_id: str, *args) -> tuple[list[DraftBlock], DraftEntry | None]:
        """A draft nobody cuts, whole: drafted here when `draft_here` may, else submitted and collected. → its
        blocks, and its entry (its wait for the step loop; None where drafted here)."""
        blk = self.draft_here(session_id, *args)
        if blk is not None:
            return [blk], None
        entry = self.submit(session_id, *args)
        try:
            return [b async for b in self.blocks(entry)], entry
        finally:
            entry.abandoned = True

    def _depth(self) -> None:
        if self.metrics is not None:  # the draft pool's HPA scales on this (deploy/base/draft/hpa.yaml)
            self.metrics.queue_depth.set(len(self._pending))

    async def blocks(self, entry: DraftEntry):
        """The call's DraftBlocks, the last one final. Blocks that completed while the consumer was busy come
        as one (a message less on the wire; the tokens, their q and order are the same). Leaving early abandons
        the call."""
        held = None
        try:
            while True:
                if held is not None:
                    item, held = held, None
                else:
                    item = await entry.blocks.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                while not item.final and not entry.blocks.empty():
                    nxt = entry.blocks.get_nowait()
                    if not isinstance(nxt, DraftBlock):
                        held = nxt  # an error or the end: after this block
                        break
                    item = _join(item, nxt)
                yield item
                if item.final:
                    return
        finally:
            entry.abandoned = True
            self._arrived.set()

    # ---- the step loop ---------------------------------------------------------------------------------------
    def _admit(self) -> list[DraftEntry]:
        busy = {e.session_id for e in self._active}
        room = self.max_batch_size - len(self._active)
        admitted, rest = [], []
        for e in self._pending:
            if e.abandoned:
                e.blocks.put_nowait(_END)
            elif room > 0 and e.session_id not in busy:
                busy.add(e.session_id)
                e.admitted_ns = time.perf_counter_ns()
                admitted.append(e)
                room -= 1
            else:
                rest.append(e)
        self._pending = rest
        self._depth()
        return admitted

    def _steps(self, new: list[DraftEntry], active: list[DraftEntry], emit):
        """On the model thread: begin the new calls, then advance everyone, handing each completed block to
        `emit(entry, block)`, until some call finishes (or a call arrives or leaves). → {entry: exception}."""
        errors = {}
        for e in new:
            try:
                e.call = self.worker.begin(*e.args)
                active.append(e)
            except Exception as exc:  # noqa: BLE001 - reported to that call's consumer
                errors[e] = exc
        finished = False
        while active and not finished:
            if any(e.abandoned for e in active):
                break  # someone left: free its place first
            for e, blocks in zip(active, self.worker.advance([e.call for e in active])):
                for b in blocks:
                    emit(e, b)
                    finished = finished or b.final
            if self._pending:
                break
        return errors

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()

        def emit(e: DraftEntry, block) -> None:  # on the model thread; the loop runs these in order, before
            loop.call_soon_threadsafe(e.blocks.put_nowait, block)  # it sees the step's result

        while True:
            self._active = [e for e in self._active if not e.abandoned]
            new = self._admit()
            if not new and not self._active:
                self._arrived.clear()
                if not self._pending:
                    await self._arrived.wait()
                continue
            active = list(self._active)
            try:
                errors = await self.runner.run(self._steps, new, active, emit)
            except Exception as exc:  # noqa: BLE001 - an unexpected failure fails every call in the step
                errors = {e: exc for e in new + active}
                active = []
            for e, exc in errors.items():
                e.blocks.put_nowait(exc)
            self._active = [e for e in active if not e.call.done and e not in errors]
            if self.metrics is not None and active:
                self.metrics.batch_size.observe(len(active))
