import os

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SPECDEC_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny random target and a different tiny random draft sharing a 32-token vocabulary."""
    from tests.helpers_models import build_tiny_model

    return build_tiny_model(vocab_size=32, seed=1, logit_scale=2.0), build_tiny_model(vocab_size=32, seed=2,
                                                                                        logit_scale=2.0)
