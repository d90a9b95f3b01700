import torch

from tests.helpers_models import build_tiny_model


def test_engine_thread_counts_stick_per_engine():
    """An engine's compute thread keeps its own torch thread count even when a later engine sets another one
    before the first ever computed (torch initialises a thread's count lazily from a process-wide default)."""
    from specdec.engine import Engine

    m = build_tiny_model(vocab_size=32)
    one = Engine(m, None, threads_per_model=1)
    two = Engine(m, None, threads_per_model=2)
    assert one.target.thread.submit(torch.get_num_threads) == 1
    assert two.target.thread.submit(torch.get_num_threads) == 2
    one.close()
    two.close()


def _calls_by_thread(engine):
    """Wrap the engine's worker entry points to record the thread each call ran on."""
    import threading

    seen = []
    for w, names in ((engine.target_worker, ("start_session", "verify")), (engine.draft_worker, ("draft_blocks",))):
        for name in names:
            fn = getattr(w, name)

            def wrapped(*a, _fn=fn, _name=name, **k):
                seen.append((_name, threading.current_thread().name))
                return _fn(*a, **k)
            setattr(w, name, wrapped)
    return seen


def test_sequential_modes_run_inline_and_overlapping_modes_on_worker_threads():
    """With 1 torch thread per model, `sd` runs its worker calls on the caller's thread (no hand-offs) and gives
    the same tokens as on the worker threads; `pearl` needs the overlap and keeps the threads."""
    import threading

    from specdec.decoding.sampling import SamplingParams
    from specdec.engine import Engine
    from specdec.scheduling.request import GenerationRequest
    from tests.helpers_models import tiny_pair

    target, draft = tiny_pair()
    auto, threaded = Engine(target, draft, threads_per_model=1), Engine(target, draft, threads_per_model=1,
                                                                        inline=False)
    seen = _calls_by_thread(auto)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the caller computes with what each model is given
    try:
        req = dict(prompt_ids=[1, 2, 3], max_new_tokens=12, gamma=3, params=SamplingParams(temperature=0.0))
        me = threading.current_thread().name
        out = auto.generate(GenerationRequest(mode="sd", **req))
        assert seen and all(t == me for _, t in seen), seen
        assert out.token_ids == threaded.generate(GenerationRequest(mode="sd", **req)).token_ids
        seen.clear()
        auto.generate(GenerationRequest(mode="pearl", **req))
        assert not any(t == me for name, t in seen if name in ("verify", "draft_blocks")), "pearl overlaps"
        if before != 1:  # a caller computing with more threads than the models are given: no inline
            torch.set_num_threads(before)
            seen.clear()
            auto.generate(GenerationRequest(mode="sd", **req))
            assert not any(t == me for name, t in seen if name == "verify")
    finally:
        torch.set_num_threads(before)
        auto.close()
        threaded.close()


def test_inline_waits_for_work_queued_on_the_worker_thread():
    """A call may only run on the caller's thread when nothing is queued or running on the worker's own thread
    (a worker is never driven from two threads at once)."""
    import threading

    from specdec.engine import _INLINE_OK, _LocalWorker

    class Idle:  # a worker with a model that needs no tuning
        model = torch.nn.Module()

    owner = _LocalWorker(Idle(), "t", 1)
    gate = threading.Event()
    running = owner.thread.post(gate.wait)
    token = _INLINE_OK.set(True)
    try:
        assert not owner.runs_inline()
        gate.set()
        running.result(timeout=5)
        assert owner.runs_inline()
    finally:
        _INLINE_OK.reset(token)
    assert not owner.runs_inline()
    owner.thread.close()
