import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from shardplan import Plan, compile
from shardplan.models import zoo

# Ranks and tests share two cores: one thread each keeps them from fighting over them.
torch.set_num_threads(1)
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo world in this process: enough for parallelize's own checks."""
    # A store in this process: a rendezvous on a TCP port could lose the port to another world.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def gpt_plan() -> Plan:
    """compile's plan of the zoo GPT for one rank (frozen: the modules that read it share one)."""
    entry = zoo.gpt()
    return compile(entry.model, 1, entry.args, entry.kwargs, hardware="cpu-gloo")


def _benchmark(name: str):
    """benchmarks/<name>.py as a module: the published runs' models and pricing live there, beside their tables."""
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would: inspect finds its classes' source
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def published_bench():
    return _benchmark("bench_published")


@pytest.fixture(scope="session")
def published_fsdp_bench():
    return _benchmark("bench_published_fsdp")


@pytest.fixture(scope="session")
def published_torchtitan_bench():
    return _benchmark("bench_published_torchtitan")


@pytest.fixture(scope="session")
def gpu_check():
    return _benchmark("gpu_check")
