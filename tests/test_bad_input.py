"""Bad input and faults: each gets a clear error naming the cause and the fix, nothing hangs."""
import datetime
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan import PlanError, Plan, RuntimeMismatchError, ShardplanError, compile, parallelize, zoo
from shardplan.sizes import parse_bytes
from shardplan.runtime.launch import free_port


@pytest.fixture(scope="module")
def gpt_plan() -> Plan:
    entry = zoo.gpt()
    return compile(entry.model, 1, entry.args, entry.kwargs, hardware="cpu-gloo")


@pytest.fixture(scope="module")
def world_of_one():
    """A one-rank gloo world in this process: enough for parallelize's own checks."""
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_plan_for_another_model_is_refused(gpt_plan, world_of_one):
    other = zoo.gpt(zoo.GPTConfig(n_layer=5))
    with pytest.raises(PlanError, match="made for another model.*re-plan"):
        parallelize(other.model, gpt_plan)


def test_a_batch_of_another_shape_is_refused(gpt_plan, world_of_one):
    entry = zoo.gpt()
    program = parallelize(entry.model, gpt_plan)
    ids = entry.args[0][:2]
    with pytest.raises(RuntimeMismatchError, match=r"shape \[2, 32\], the plan was made for \[4, 32\]"):
        program.step(ids, labels=ids)
    assert torch.isfinite(program.step(*entry.args, **entry.kwargs))


@pytest.mark.parametrize("text, fragment", [("12 parsecs", "cannot read memory size"), ("-3GiB", "cannot read"),
                                             (0, "must be positive"), ("0.5 KiB", "512")])
def test_memory_budgets_are_read_or_refused(text, fragment):
    if fragment.isdigit():
        assert parse_bytes(text) == int(fragment)
    else:
        with pytest.raises(ShardplanError, match=fragment):
            parse_bytes(text)


@pytest.mark.parametrize("world_size", [0, -2, 2.5])
def test_world_size_must_be_a_positive_integer(world_size):
    entry = zoo.residual_mlp()
    with pytest.raises(ShardplanError, match="world_size"):
        compile(entry.model, world_size, entry.args, entry.kwargs)


def _mutations(text: str):
    data = json.loads(text)
    paths = list(_leaf_paths(data))
    junk = st.one_of(st.none(), st.booleans(), st.integers(-2, 10**12), st.floats(allow_nan=True),
                     st.text(max_size=8), st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=4),
                                                                                                st.integers(),
                                                                                                max_size=2))
    replace = st.tuples(st.sampled_from(paths), junk).map(lambda change: _replaced(data, *change))
    delete = st.sampled_from(paths).map(lambda path: _replaced(data, path, _DELETE))
    truncate = st.integers(0, len(text) - 1).map(lambda cut: text[:cut])
    flip = st.tuples(st.integers(0, len(text) - 1), st.characters()).map(
        lambda change: text[:change[0]] + change[1] + text[change[0] + 1:])
    return st.one_of(replace, delete, truncate, flip)


_DELETE = object()


def _leaf_paths(value, path=()):
    yield path
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from _leaf_paths(child, path + (key,))


def _replaced(data, path, new):
    if not path:
        return json.dumps(None if new is _DELETE else new)
    copy = json.loads(json.dumps(data))
    parent = copy
    for key in path[:-1]:
        parent = parent[key]
    if new is _DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new
    return json.dumps(copy)


def test_fuzzed_plan_files_raise_only_plan_error(gpt_plan):
    @settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_mutations(gpt_plan.to_json()))
    def load(text):
        try:
            Plan.from_json(text)
        except PlanError:
            pass

    load()


def _dying_rank(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    # the timeout the README tells users to set: the bound on how long a rank waits for a dead one
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    torch.manual_seed(0)
    entry = zoo.gpt()
    from shardplan.runtime.manual import manual_plan
    plan = manual_plan(entry.model, [("wte", "wpe"), ("h.0", "h.1"), ("h.2", "h.3"), ("ln_f", "lm_head")], dp=2)
    program = parallelize(entry.model, plan)
    program.step(*entry.args, **entry.kwargs)
    if rank == 1:
        os._exit(3)  # dies mid-training, without a word to the others
    start = time.perf_counter()
    try:
        program.step(*entry.args, **entry.kwargs)
        outcome = "no error"
    except Exception as error:  # whatever the backend raises: the point is that it raises
        outcome = f"{type(error).__name__}: {error}"
    with open(os.path.join(folder, "rank0.json"), "w") as handle:
        json.dump({"outcome": outcome, "seconds": time.perf_counter() - start}, handle)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_that_dies_makes_the_others_fail_not_hang(tmp_path):
    # Spawned by hand, not by run_world: when a rank dies, run_world (mp.spawn's join) terminates the
    # others at once, and what this test watches is how the survivor fails on its own.
    port = free_port()
    context = mp.get_context("spawn")
    ranks = [context.Process(target=_dying_rank, args=(rank, port, str(tmp_path))) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        for process in ranks:
            process.join(timeout=100)
        assert not any(process.is_alive() for process in ranks)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()  # a hang is the failure; leave no process behind it
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["outcome"] != "no error" and report["seconds"] < 60, report
