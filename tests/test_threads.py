import torch

from tests.helpers_models import build_tiny_model


def test_engine_thread_counts_stick_per_engine():
    """An engine's compute thread keeps its own torch thread count even when a later engine sets another one
    before the first ever computed (torch initialises a thread's count lazily from a process-wide default)."""
    from specdec.engine import Engine

    m = build_tiny_model(vocab_size=32)
    one = Engine(m, None, threads_per_model=1)
    two = Engine(m, None, threads_per_model=2)
    assert one.target.pool.submit(torch.get_num_threads).result() == 1
    assert two.target.pool.submit(torch.get_num_threads).result() == 2
    one.close()
    two.close()
