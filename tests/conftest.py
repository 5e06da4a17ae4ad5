import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("NUMBA_NUM_THREADS", "1")


@pytest.fixture
def identity():
    from diloco.protocol.identity import Identity

    return Identity.generate()
