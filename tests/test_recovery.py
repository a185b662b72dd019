"""Failed steps (see [Note: failed steps] in program.py), optimizers over replaced parameters, input dtypes.

One spawned world of 2 gloo ranks runs a grid of faults (every strategy × one or two micro-batches ×
a fault in forward or in backward, raised alike on both ranks): training on after the fault must
give exactly (torch.equal) the parameters of a run that skipped the batch; so must a failed
loss.backward() of program(...) followed by zero_grad. A failed pipelined step, and ranks that fail
at different points, must refuse to go on; the latter are out of step, so the world exits without
leaving its process group (as a user restarts such ranks). So must both ranks when one fails alone
in backward and the other runs into the process group's timeout (a world of its own).
"""

import copy
import datetime
import json
import os
import types

import pytest
import torch
import torch.distributed as dist
from parity import ADAMW, spawn_world

from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Mesh, ShardStrategy
from shardplan.runtime import collectives, parallelize
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.program import admit_input

UNITS = zoo.gpt_units(zoo.GPTConfig().n_layer)


class Fault(Exception):
    """What the tests raise inside a step."""


def _program(model, world: int, strategy: ShardStrategy, micro_batches: int):
    plan = manual_plan(
        model,
        UNITS,
        dp=world,
        strategies=(strategy,),
        checkpoints=(Checkpoint.NONE,),
        micro_batches=micro_batches,
    )
    return parallelize(model, plan)


def _arm(block: torch.nn.Module, where: str, on_call: int):
    """A forward hook on `block` that, once armed, raises on its `on_call`-th call from then: in its
    forward (a KeyboardInterrupt, as Ctrl-C would), or in the backward of its output."""
    state = {"armed": False, "calls": 0}

    def raise_in_backward(grad):
        raise Fault("injected in backward")

    def hook(module, args, output):
        if not state["armed"]:
            return
        state["calls"] += 1
        if state["calls"] != on_call:
            return
        state["armed"] = False
        if where == "forward":
            raise KeyboardInterrupt
        output.register_hook(raise_in_backward)

    block.register_forward_hook(hook)
    return state


def _train(
    program, batches, fail_at: int | None, armed: dict | None, set_to_none: bool = True
) -> list[float]:
    """Steps over `batches`, pairs of (ids, whether the optimizer steps after it: gradients accumulate
    over steps in between), the step at `fail_at` failing; returns the losses of the steps that ran.
    `set_to_none=False` zeroes `.grad` in place: the next step takes its gradients into it."""
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    losses = []
    for index, (ids, optimizer_steps) in enumerate(batches):
        if index == fail_at:
            armed["armed"] = True
            try:
                program.step(ids, labels=ids)
            except (Fault, KeyboardInterrupt):
                continue
            raise AssertionError("the injected fault did not raise")
        losses.append(float(program.step(ids, labels=ids)))
        if optimizer_steps:
            optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return losses


def run_fault_case(rank: int, world: int, case: dict) -> dict:
    """Train once with a fault at the third step, once skipping that batch; compare exactly."""
    torch.manual_seed(0)
    model = zoo.gpt(batch=2).model
    batches = [
        (
            torch.randint(
                0,
                256,
                (2 * case["micro_batches"], 32),
                generator=torch.Generator().manual_seed(10 * step + rank),
            ),
            step in (0, 3, 5),
        )
        for step in range(6)
    ]  # the failing step's gradients join step 1's
    faulty = copy.deepcopy(model)
    armed = _arm(
        faulty.h[1], case["where"], on_call=case["micro_batches"]
    )  # the step's last micro-batch
    program = _program(faulty, world, case["strategy"], case["micro_batches"])
    fail_at, set_to_none = case.get("fail_at", 2), case.get("set_to_none", True)
    losses = _train(program, batches, fail_at=fail_at, armed=armed, set_to_none=set_to_none)
    facts = {
        "states": sorted({unit.state.value for unit in program.units}),
        "out_of_step": program.out_of_step,
    }
    skipping = _program(copy.deepcopy(model), world, case["strategy"], case["micro_batches"])
    expected_losses = _train(
        skipping,
        batches[:fail_at] + batches[fail_at + 1 :],
        fail_at=None,
        armed=None,
        set_to_none=set_to_none,
    )
    state, expected = program.export_full_state_dict(), skipping.export_full_state_dict()
    facts["equal_losses"] = losses == expected_losses
    facts["equal_parameters"] = rank != 0 or all(
        torch.equal(state[name], expected[name]) for name in expected
    )
    return facts


def check_failed_raw_backward(rank: int, world: int, folder: str) -> dict[str, bool]:
    """A loss.backward() of program(...) that raises, then (as in plain PyTorch) zero_grad, or first a clip
    or a save that must not build on the half-reduced step: the next steps train as if that batch was
    skipped, whatever came first."""
    torch.manual_seed(0)
    model = zoo.gpt(batch=2).model
    batches = [
        torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(10 * step + rank))
        for step in range(4)
    ]
    after_failure = {
        "zero_grad": lambda program: None,
        "clip": lambda program: program.clip_grad_norm_(1.0),
        "save": lambda program: program.save(os.path.join(folder, "after_failed_backward")),
    }
    expected = None
    equal = {}
    for name, action in (("skipped", None), *after_failure.items()):
        faulty = copy.deepcopy(model)
        armed = _arm(faulty.h[1], "backward", on_call=1)
        program = _program(faulty, world, ShardStrategy.FULL_SHARD, 1)
        optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
        for index, ids in enumerate(batches):
            if index == 1:
                if action is None:
                    continue
                armed["armed"] = True
                loss = program(ids, labels=ids)
                with pytest.raises(Fault):
                    loss.backward()
                action(program)
                optimizer.zero_grad()
                continue
            program.step(ids, labels=ids)
            optimizer.step()
            optimizer.zero_grad()
        state = program.export_full_state_dict()
        if action is None:
            expected = state
        else:
            equal[name] = rank != 0 or all(
                torch.equal(state[key], expected[key]) for key in expected
            )
    return equal


def check_optimizer_over_model_parameters(rank: int, world: int) -> str | None:
    model = zoo.gpt(batch=2).model
    program = _program(model, world, ShardStrategy.FULL_SHARD, 1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    program.step(ids, labels=ids)
    try:
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    except ShardplanError as error:
        return str(error)
    return None


def check_failed_pipelined_step(rank: int, world: int) -> str | None:
    """A pipelined step failing (here after its schedule, alike on both stages, so the world stays in step)
    refuses every later step: a stage cannot know where its neighbours stopped."""
    model = zoo.gpt(batch=2).model
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    plan = manual_plan(
        model,
        UNITS,
        dp=1,
        pp=world,
        micro_batches=2,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    program = parallelize(model, plan)
    program.step(ids, labels=ids)
    original = collectives.all_reduce_sum

    def failing(*args, **kwargs):
        raise Fault("injected after the schedule")

    collectives.all_reduce_sum = failing
    try:
        with pytest.raises(Fault):
            program.step(ids, labels=ids)
    finally:
        collectives.all_reduce_sum = original
    try:
        program.step(ids, labels=ids)
    except RuntimeMismatchError as error:
        return str(error)
    return None


def check_fsdp2_failed_step(rank: int, world: int) -> dict:
    """backend="fsdp2": an optimizer over the replaced parameters raises; a failed step refuses every later
    call (FSDP2's state cannot be read back), until a load."""
    model = zoo.gpt(batch=2).model
    before = torch.optim.SGD(
        model.parameters(), lr=0.1
    )  # built before parallelize: over what it replaces
    plan = manual_plan(model, UNITS, dp=world)
    program = parallelize(model, plan, backend="fsdp2")
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    program.step(ids, labels=ids)
    found = {}
    try:
        before.step()
    except ShardplanError as error:
        found["optimizer"] = str(error)
    _arm(model.h[1], "backward", on_call=1)["armed"] = True
    with pytest.raises(Fault):
        program.step(ids, labels=ids)
    try:
        program.step(ids, labels=ids)
    except RuntimeMismatchError as error:
        found["refusal"] = str(error)
    return found


def check_out_of_step(rank: int, world: int) -> dict:
    """Rank 0 fails in block 0's forward, rank 1 in block 1's, after one more gather: they must refuse."""
    model = zoo.gpt(batch=2).model
    armed = _arm(model.h[rank], "forward", on_call=1)
    program = _program(model, world, ShardStrategy.FULL_SHARD, 1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    program.step(ids, labels=ids)
    armed["armed"] = True
    try:
        program.step(ids, labels=ids)
    except KeyboardInterrupt:
        pass
    refusals = []
    for call in (
        lambda: program.step(ids, labels=ids),
        lambda: program(ids, labels=ids),
        lambda: program.clip_grad_norm_(1.0),
    ):
        try:
            call()
            refusals.append(None)
        except RuntimeMismatchError as error:
            refusals.append(str(error))
    return {"refusals": refusals, "states": sorted({unit.state.value for unit in program.units})}


def _one_rank_fails(rank: int, world: int, folder: str) -> None:
    """Rank 1 fails in backward, rank 0 goes on into a gather rank 1 never issues: the world's timeout
    (cut to 5 s) ends it, and both refuse. Each rank writes what happened, then exits (out of step)."""
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=5))
    model = zoo.gpt(batch=2).model
    armed = _arm(model.h[1], "backward", on_call=1)
    program = _program(model, world, ShardStrategy.FULL_SHARD, 1)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(rank))
    program.step(ids, labels=ids)
    armed["armed"] = rank == 1
    facts = {}
    try:
        program.step(ids, labels=ids)
    except (Fault, RuntimeError) as error:  # rank 0: gloo's timeout
        facts["failure"] = type(error).__name__
    try:
        program.step(ids, labels=ids)
    except RuntimeMismatchError as error:
        facts["refusal"] = str(error)
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as file:
        json.dump(facts, file)
    os._exit(0)


def _all_checks(rank: int, world: int, cases: dict, path: str) -> None:
    results = {name: run_fault_case(rank, world, case) for name, case in cases.items()}
    results["raw_backward"] = check_failed_raw_backward(rank, world, os.path.dirname(path))
    results["optimizer"] = check_optimizer_over_model_parameters(rank, world)
    results["pipelined"] = check_failed_pipelined_step(rank, world)
    results["fsdp2"] = check_fsdp2_failed_step(rank, world)
    results["out_of_step"] = check_out_of_step(
        rank, world
    )  # last: the world is out of step after it
    if rank == 0:
        with open(path, "w") as file:
            json.dump(results, file)
    # ranks out of step cannot leave the process group cleanly (its next collective would pair with
    # a stale one on the peer): exit, as a user restarts such ranks
    os._exit(0)


CASES = {
    f"{strategy.value}/m{micro_batches}/{where}": {
        "strategy": strategy,
        "micro_batches": micro_batches,
        "where": where,
    }
    for strategy in ShardStrategy
    for micro_batches in (1, 2)
    for where in ("forward", "backward")
}
CASES.update(
    {
        f"{strategy.value}/m2/backward/zeroed grad": {
            "strategy": strategy,
            "micro_batches": 2,
            "where": "backward",
            "set_to_none": False,
            "fail_at": 1,
        }
        for strategy in (ShardStrategy.FULL_SHARD, ShardStrategy.REPLICATE)
    }
)
"""A step failing right after zero_grad(set_to_none=False): it took its gradients into the zeroed `.grad`."""


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_failed_steps_recover_exactly_or_refuse(tmp_path):
    path = tmp_path / "results.json"
    spawn_world(2, _all_checks, (CASES, str(path)))
    results = json.loads(path.read_text())
    wrong = {
        name: results[name]
        for name in CASES
        if results[name]
        != {
            "states": ["sharded"],
            "out_of_step": None,
            "equal_losses": True,
            "equal_parameters": True,
        }
    }
    assert not wrong, wrong
    assert results["raw_backward"] == {"zero_grad": True, "clip": True, "save": True}
    assert results["pipelined"] is not None and "program.load(" in results["pipelined"]
    assert results["optimizer"] == (
        "optimizer steps the model's original parameters, which parallelize "
        "replaced: build it over program.parameters()"
    )
    assert "program.parameters()" in results["fsdp2"].get("optimizer", "")
    assert "program.load(" in results["fsdp2"].get("refusal", "")
    out_of_step = results["out_of_step"]
    assert out_of_step["states"] == ["sharded"]
    assert all(
        refusal is not None
        and "KeyboardInterrupt" in refusal
        and "program.load(" in refusal
        and "\n" not in refusal
        for refusal in out_of_step["refusals"]
    ), out_of_step


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_rank_failing_alone_leaves_every_rank_refusing(tmp_path):
    spawn_world(2, _one_rank_fails, (str(tmp_path),))
    facts = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [rank_facts.get("failure") for rank_facts in facts] == ["RuntimeError", "Fault"], facts
    assert all("program.load(" in rank_facts.get("refusal", "") for rank_facts in facts), facts


def test_step_refuses_an_input_of_another_dtype():
    plan = types.SimpleNamespace(
        mesh=Mesh(),
        inputs=(InputSpec(name="0", shape=(2, 8), dtype="int64"),),
        tensor_parallel=types.SimpleNamespace(sequence_parallel=False),
        sequence_limits=(),
    )
    admit_input(plan, (torch.zeros(4, 8, dtype=torch.int64),), {})
    with pytest.raises(
        RuntimeMismatchError,
        match=r"input '0' is int32, the plan was made for int64: pass it "
        r"as int64 \(\.to\(torch\.int64\)\), or re-plan for int32",
    ):
        admit_input(plan, (torch.zeros(2, 8, dtype=torch.int32),), {})
