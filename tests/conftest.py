import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")


@pytest.fixture
def identity():
    from diloco.protocol.identity import Identity

    return Identity.generate()


@pytest.fixture
def nodes():
    """In-process learners a test made (tests/test_recovery.py `Node`): killed at the end if still running."""
    made: list = []
    yield made
    for n in made:
        if n.learner.swarm is not None and n.learner.swarm.healthy:
            n.kill()
