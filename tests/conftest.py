import contextlib
import os

import pytest
import torch

from specdec.common import settings

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))
settings.prepare_process()  # oneDNN's cache sizes, as a server sets them, before the tests' first oneDNN call


@pytest.fixture
def runtime_settings():
    """Change `specdec.common.settings` fields for one test, e.g. `runtime_settings(kernel_tune=False)`; restored after.
    """
    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(settings.override(**changes))


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny random target and a different tiny random draft sharing a 32-token vocabulary."""
    from tests.helpers_models import build_tiny_model

    return build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0), build_tiny_model(vocab_size=32, seed=2,
                                                                                        logit_scale=2.0)
