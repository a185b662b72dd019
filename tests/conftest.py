import os

import pytest
import torch
import torch.distributed as dist

from shardplan import Plan, compile, zoo
from shardplan.runtime.launch import free_port

# Ranks and tests share two cores: one thread each keeps them from fighting over them.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo world in this process: enough for parallelize's own checks."""
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    """compile's plan of the zoo GPT for one rank."""
    entry = zoo.gpt()
    return compile(entry.model, 1, entry.args, entry.kwargs, hardware="cpu-gloo")
