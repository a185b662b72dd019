import os

import pytest
import torch

# Ranks and tests share two cores: one thread each keeps them from fighting over them.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
