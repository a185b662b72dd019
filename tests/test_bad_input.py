"""Bad input and faults: each gets a clear error naming the cause and the fix, nothing hangs."""

import dataclasses
import datetime
import json
import os

import pytest
import torch
import torch.distributed as dist

from shardplan import Plan, PlanError, RuntimeMismatchError, ShardplanError, compile, parallelize
from shardplan.common.forkserver import forkserver_context
from shardplan.common.sizes import parse_bytes
from shardplan.compile import solve
from shardplan.frontend.passes import analyze
from shardplan.models import zoo


def test_a_plan_for_another_model_is_refused(gpt_plan, world_of_one):
    other = zoo.gpt(zoo.GPTConfig(n_layer=5))
    with pytest.raises(PlanError, match="made for another model.*re-plan"):
        parallelize(other.model, gpt_plan)


def test_a_plan_fingerprinted_by_another_version_is_told_to_replan(gpt_plan, world_of_one):
    entry = zoo.gpt()
    unversioned = dataclasses.replace(gpt_plan, fingerprint=gpt_plan.fingerprint.partition("-")[2])
    with pytest.raises(PlanError, match="computed by another version of shardplan.*re-plan"):
        parallelize(entry.model, unversioned, verify_graph=True)
    with pytest.raises(PlanError, match="computed by another version of shardplan.*re-plan"):
        parallelize(entry.model, dataclasses.replace(unversioned, signature=""))  # a format-2 plan


def test_a_batch_of_another_length_trains_and_one_of_other_dims_is_refused(gpt_plan, world_of_one):
    entry = zoo.gpt()
    program = parallelize(entry.model, gpt_plan)
    ids = entry.args[0][:, :16]  # dynamic padding: a shorter sequence than planned
    assert torch.isfinite(program.step(ids, labels=ids))
    with pytest.raises(RuntimeMismatchError, match="input '0' has 1 dims"):
        program.step(ids[0], labels=ids[0])
    assert torch.isfinite(program.step(*entry.args, **entry.kwargs))


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("12 parsecs", "cannot read memory size"),
        ("-3GiB", "cannot read"),
        ("nan", "cannot read"),
        (0, "out of range: write between 1 B and 1 PiB"),
        ("1e400GiB", "out of range"),
        ("1e30", "out of range"),
        (0.001, "out of range"),
        (float("nan"), "out of range"),
        (float("inf"), "out of range"),
        (10**400, "out of range"),
        ("0.5 KiB", "512"),
        ("1024 TiB", str(2**50)),
        (1.9, "1"),
    ],
)
def test_memory_budgets_are_read_or_refused(text, fragment):
    if fragment.isdigit():
        assert parse_bytes(text) == int(fragment)
    else:
        with pytest.raises(ShardplanError, match=fragment):
            parse_bytes(text)


@pytest.mark.parametrize("world_size", [0, -2, 2.5, True, 2**30])
@pytest.mark.timeout(
    30
)  # 2**30 ranks once searched every pipeline degree up to the world size: minutes
def test_world_size_must_be_a_whole_number_of_ranks_within_the_ceiling(world_size):
    entry = zoo.residual_mlp()
    with pytest.raises(
        ShardplanError, match="world_size must be a whole number of ranks from 1 to 1048576"
    ):
        compile(entry.model, world_size, entry.args, entry.kwargs)


def test_a_misspelt_option_is_refused_naming_the_options():
    entry = zoo.residual_mlp()
    expected = r"unknown option 'memory_bugdet' \(did you mean 'memory_budget'\?\): the options are hardware, memory_budget"
    with pytest.raises(ShardplanError, match=expected):
        compile(entry.model, 2, entry.args, entry.kwargs, memory_bugdet="1GiB")  # type: ignore[call-arg]
    with pytest.raises(ShardplanError, match=expected):
        solve(analyze(entry.model, entry.args, entry.kwargs), 2, memory_bugdet="1GiB")  # type: ignore[call-arg]


@pytest.mark.timeout(120)  # a guard against a search that never ends, not a measure of its speed
def test_the_largest_worlds_plan():
    entry = zoo.residual_mlp()
    chain = analyze(entry.model, entry.args, entry.kwargs)
    for world_size in (2**20, 720720):  # the ceiling, and a world with 240 divisors
        assert solve(chain, world_size, hardware="h100-80g").world_size == world_size


def _freeze(model, *prefixes: str) -> None:
    for name, parameter in model.named_parameters():
        if name.startswith(prefixes):
            parameter.requires_grad_(False)


def test_frozen_blocks_are_planned_in_units_parallelize_accepts(world_of_one):
    entry = zoo.gpt()
    _freeze(entry.model, "h.1.", "h.2.")
    plan = compile(entry.model, 1, entry.args, entry.kwargs, hardware="cpu-gloo")
    frozen = {
        name for name, parameter in entry.model.named_parameters() if not parameter.requires_grad
    }
    assert [u.name for u in plan.units if set(u.params) <= frozen] == ["h.1..h.2"]
    assert all(set(u.params) <= frozen or not set(u.params) & frozen for u in plan.units)
    program = parallelize(entry.model, plan)
    assert [u.shard.requires_grad for u in program.units] == [
        not set(u.params) <= frozen for u in plan.units
    ]
    before = [u.shard.detach().clone() for u in program.units]
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-2)
    program.step(*entry.args, **entry.kwargs)
    optimizer.step()
    assert [not torch.equal(old, u.shard) for old, u in zip(before, program.units)] == [
        u.shard.requires_grad for u in program.units
    ]  # the frozen unit alone keeps its values


def test_a_block_mixing_frozen_and_trainable_parameters_is_named_at_compile():
    entry = zoo.gpt()
    _freeze(entry.model, "h.1.attn.")
    with pytest.raises(
        ShardplanError,
        match="block 'h.1' holds frozen parameters .*h.1.attn.qkv.weight.* beside "
        "trainable ones.*set requires_grad alike for the whole block",
    ):
        compile(entry.model, 1, entry.args, entry.kwargs, hardware="cpu-gloo")


def test_a_plan_missing_parameters_is_called_incomplete_not_foreign(gpt_plan, world_of_one):
    data = json.loads(gpt_plan.to_json())
    dropped = data["units"][1]["params"].pop(0)
    with pytest.raises(
        PlanError,
        match=f"1 parameters of the model are in no unit of the plan .*{dropped}.*"
        "the plan is incomplete",
    ):
        parallelize(zoo.gpt().model, Plan.from_json(json.dumps(data)))


def _dying_rank(rank: int, port: int, folder: str) -> None:
    torch.set_num_threads(1)
    # the timeout the README tells users to set: the bound on how long a rank waits for a dead one
    timeout = datetime.timedelta(seconds=30)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    torch.manual_seed(0)
    entry = zoo.gpt()
    from shardplan.runtime.manual import manual_plan

    plan = manual_plan(
        entry.model, [("wte", "wpe"), ("h.0", "h.1"), ("h.2", "h.3"), ("ln_f", "lm_head")], dp=2
    )
    program = parallelize(entry.model, plan)
    program.step(*entry.args, **entry.kwargs)
    if rank == 1:
        os._exit(3)  # dies mid-training, without a word to the others
    try:
        program.step(*entry.args, **entry.kwargs)
        outcome = "no error"
    except Exception as error:  # whatever the backend raises: the point is that it raises
        outcome = f"{type(error).__name__}: {error}"
    with open(os.path.join(folder, "rank0.json"), "w") as handle:
        json.dump({"outcome": outcome}, handle)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_that_dies_makes_the_others_fail_not_hang(tmp_path):
    # Started by hand, not by run_world: when a rank dies, run_world (torch.multiprocessing's join)
    # terminates the others at once, and what this test watches is how the survivor fails on its own.
    # The store listens here, on a port the OS picked as it bound it (as run_world's does).
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = forkserver_context()  # run_world's: its server has imported torch already
    ranks = [
        context.Process(target=_dying_rank, args=(rank, store.port, str(tmp_path)))
        for rank in range(2)
    ]
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
    assert report["outcome"] != "no error", (
        report
    )  # it raised, and exited: a hang would still be joined above
