"""Virtual pipeline stages and the zero-bubble schedule: planned, priced, run.

Interleaved 1F1B runs v stages per rank (stage i on pipeline rank i mod pp); the zero-bubble schedule
(torch's ScheduleInterleavedZeroBubble) splits each backward into its input gradient and a deferred weight
gradient. One spawned world of 2 ranks (pp 2) trains the zoo GPT under each next to one process, measures
each case's peak memory against the cost model's, saves a checkpoint under one schedule and loads it under
another, and collects the refusals.
"""

import copy
import dataclasses
import functools
import itertools
import json
from unittest import mock

import pytest
import torch
from parity import assert_parity, spawn_world, train_next_to_reference

from shardplan import get_hardware
from shardplan.costmodel import cost
from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Decision, Plan, Schedule, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan
from shardplan.solver import search
from shardplan.solver.assemble import predict
from shardplan.solver.evaluate import evaluate_stages
from shardplan.solver.space import SearchSpace, block_rules, default_space

STEPS = 3
REPLICA_BATCH = 4
UNITS = zoo.gpt_units(zoo.GPTConfig().n_layer)
"""wte..wpe, h.0 .. h.3, ln_f..lm_head: six units, cut into pp · v stages."""
MIXED = {"strategies": tuple(ShardStrategy), "checkpoints": tuple(Checkpoint)}
SPLIT_MIXED = {
    "strategies": tuple(ShardStrategy),
    "checkpoints": (Checkpoint.NONE, Checkpoint.FULL),
}


def virtual_plan(
    model: torch.nn.Module,
    ids: torch.Tensor,
    *,
    pp: int,
    schedule: str,
    virtual_stages: int,
    micro_batches: int,
    strategies=(ShardStrategy.FULL_SHARD,),
    checkpoints=(Checkpoint.NONE,),
    units=UNITS,
) -> Plan:
    """A GPT's units cut into pp · virtual_stages stages, stage i on pipeline rank i mod pp."""
    plan = manual_plan(
        model,
        units,
        dp=1,
        pp=pp * virtual_stages,
        schedule="1f1b",
        micro_batches=micro_batches,
        strategies=strategies,
        checkpoints=checkpoints,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    return dataclasses.replace(
        plan,
        world_size=pp,
        mesh=dataclasses.replace(plan.mesh, pp=pp),
        schedule=Schedule(
            num_micro_batches=micro_batches, name=schedule, virtual_stages=virtual_stages
        ),
    )


CASES = {
    "interleaved_1f1b/v2/m2": {"schedule": "interleaved_1f1b", "virtual_stages": 2, "m": 2},
    "interleaved_1f1b/v2/m4/mixed": {
        "schedule": "interleaved_1f1b",
        "virtual_stages": 2,
        "m": 4,
        **MIXED,
    },
    "zero_bubble/v1/m4/mixed": {
        "schedule": "zero_bubble",
        "virtual_stages": 1,
        "m": 4,
        **SPLIT_MIXED,
    },
    "zero_bubble/v2/m2": {"schedule": "zero_bubble", "virtual_stages": 2, "m": 2},
    "zero_bubble/v2/m4/mixed": {
        "schedule": "zero_bubble",
        "virtual_stages": 2,
        "m": 4,
        **SPLIT_MIXED,
    },
}


MEMORY_KINDS = {
    "interleaved_1f1b/v2/m4": ("interleaved_1f1b", 2, 4),
    "zero_bubble/v1/m4": ("zero_bubble", 1, 4),
    "zero_bubble/v2/m4": ("zero_bubble", 2, 4),
}
"""The demo GPT (8 units) under the new schedules, FULL_SHARD at dp 1, as the pipelined kinds of
calibration.accuracy: each rank's peak memory beside the cost model's."""
MEMORY_TOLERANCE = 0.03


def _batches(vocab_size: int) -> list[torch.Tensor]:
    return [
        torch.randint(
            0, vocab_size, (REPLICA_BATCH, 32), generator=torch.Generator().manual_seed(step)
        )
        for step in range(STEPS)
    ]


def run_case(rank: int, world: int, case: dict) -> dict:
    torch.manual_seed(0)
    reference = zoo.gpt(batch=REPLICA_BATCH).model
    model = copy.deepcopy(reference)
    batches = _batches(reference.config.vocab_size)
    plan = virtual_plan(
        model,
        batches[0],
        pp=world,
        schedule=case["schedule"],
        virtual_stages=case["virtual_stages"],
        micro_batches=case["m"],
        strategies=case.get("strategies", (ShardStrategy.FULL_SHARD,)),
        checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
    )
    program = parallelize(model, plan)
    return train_next_to_reference(program, reference, [(ids, ids) for ids in batches])


def checkpoint_across_schedules(rank: int, world: int, directory: str) -> float:
    """Trained a step under interleaved 1F1B (v 2), saved; loaded under the zero-bubble schedule (v 1) and
    under 1F1B: the largest difference of any parameter from the saved ones."""
    torch.manual_seed(0)
    model = zoo.gpt(batch=REPLICA_BATCH).model
    ids = _batches(model.config.vocab_size)[0]
    kinds = (("interleaved_1f1b", 2), ("zero_bubble", 1), ("1f1b", 1))
    programs = []
    for schedule, virtual_stages in kinds:
        torch.manual_seed(len(programs))  # other initial weights: the checkpoint must replace them
        fresh = copy.deepcopy(model) if not programs else zoo.gpt(batch=REPLICA_BATCH).model
        plan = virtual_plan(
            fresh,
            ids,
            pp=world,
            schedule=schedule,
            virtual_stages=virtual_stages,
            micro_batches=2,
        )
        programs.append(parallelize(fresh, plan))
    saved = programs[0]
    optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    saved.step(ids, labels=ids)
    optimizer.step()
    saved.save(f"{directory}/ckpt", optimizer)
    expected = saved.export_full_state_dict()
    worst = 0.0
    for program in programs[1:]:
        program.load(f"{directory}/ckpt")
        state = program.export_full_state_dict()
        if rank == 0:
            worst = max(
                worst,
                max((state[name] - value).abs().max().item() for name, value in expected.items()),
            )
    return worst


def refusals(rank: int, world: int) -> dict:
    """What parallelize says of plans the runtime does not run, each in one line."""
    model = zoo.gpt(batch=REPLICA_BATCH).model
    ids = _batches(model.config.vocab_size)[0]
    found = {}
    for name, (schedule, backend, checkpoints) in {
        "fsdp2/interleaved": ("interleaved_1f1b", "fsdp2", (Checkpoint.NONE,)),
        "zero_bubble/selective": ("zero_bubble", "shardplan", (Checkpoint.SELECTIVE,)),
    }.items():
        plan = virtual_plan(
            copy.deepcopy(model),
            ids,
            pp=world,
            schedule=schedule,
            virtual_stages=2,
            micro_batches=2,
            checkpoints=checkpoints,
        )
        try:
            parallelize(copy.deepcopy(model), plan, backend=backend)
            found[name] = None
        except ShardplanError as error:
            found[name] = str(error)
    return found


def memory_peaks(rank: int, world: int) -> dict:
    """Each MEMORY_KINDS plan's peak on every rank, after a warm-up step (as calibration.accuracy measures
    the pipelined kinds), without MemTracker's module hooks: their multi-grad hooks refuse autograd.grad,
    which the zero-bubble schedule's input-gradient pass calls, and the totals do not need them."""
    from torch.distributed._tools.mod_tracker import ModTracker

    from shardplan.calibration.accuracy import _train_step
    from shardplan.runtime.collectives import all_gather_object
    from shardplan.runtime.measure import peak_step_bytes

    peaks = {}
    for name, (schedule, virtual_stages, m) in MEMORY_KINDS.items():
        torch.manual_seed(0)
        entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
        ids = entry.args[0]
        plan = demo_plan(schedule, virtual_stages, m, pp=world)
        program = parallelize(entry.model, plan)
        optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
        step = functools.partial(_train_step, program, optimizer, ids)
        step()
        grads = [p.grad for p in program.parameters() if p.grad is not None]
        with (
            mock.patch.object(ModTracker, "__enter__", lambda tracker: tracker),
            mock.patch.object(ModTracker, "__exit__", lambda tracker, *error: None),
        ):
            peak = peak_step_bytes(step, entry.model, optimizer, *program.parameters(), *grads)
        peaks[name] = all_gather_object(peak)
    return peaks


def demo_plan(schedule: str, virtual_stages: int, m: int, pp: int = 2) -> Plan:
    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    return virtual_plan(
        entry.model,
        entry.args[0],
        pp=pp,
        schedule=schedule,
        virtual_stages=virtual_stages,
        micro_batches=m,
        units=zoo.gpt_units(zoo.DEMO_GPT.n_layer),
    )


def _all_checks(rank: int, world: int, cases: dict, directory: str) -> dict:
    results = {name: run_case(rank, world, case) for name, case in cases.items()}
    results["checkpoint"] = checkpoint_across_schedules(rank, world, directory)
    results["refusals"] = refusals(rank, world)
    results["memory"] = memory_peaks(rank, world)
    return results


@pytest.fixture(scope="module")
def world_results(tmp_path_factory) -> dict:
    return spawn_world(2, _all_checks, (CASES, str(tmp_path_factory.mktemp("virtual"))))


@pytest.mark.timeout(300)
def test_virtual_stages_and_zero_bubble_match_one_process(world_results):
    assert_parity(world_results, CASES)


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_under_one_schedule_loads_under_another(world_results):
    assert world_results["checkpoint"] == 0.0


@pytest.mark.timeout(300)
def test_what_the_runtime_does_not_run_is_refused_in_one_line(world_results):
    found = world_results["refusals"]
    assert "backend='shardplan' only" in found["fsdp2/interleaved"]
    assert "selective" in found["zero_bubble/selective"]
    assert all("\n" not in message for message in found.values())


@pytest.mark.timeout(300)
def test_each_rank_peak_memory_is_predicted_within_3_percent(world_results):
    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    ratios = {}
    for name, (schedule, virtual_stages, m) in MEMORY_KINDS.items():
        _, stages = evaluate_stages(chain, demo_plan(schedule, virtual_stages, m), "cpu-gloo")
        ranks = cost.pipeline_ranks(list(stages))
        ratios[name] = [
            round(rank.peak_bytes / measured, 3)
            for rank, measured in zip(ranks, world_results["memory"][name], strict=True)
        ]
    assert all(
        abs(ratio - 1) <= MEMORY_TOLERANCE for by_rank in ratios.values() for ratio in by_rank
    ), ratios


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_the_cost_model_orders_operations_as_torch_does(schedule):
    """cost.schedule_order against the order torch's schedule class computes for every rank (its
    pipeline_order, bubbles and communication left out), over pp, v and m."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    from torch.distributed.pipelining.schedules import _ComputationType as Kind

    kinds = {
        Kind.FORWARD: "F",
        Kind.FULL_BACKWARD: "B",
        Kind.BACKWARD_INPUT: "B",
        Kind.BACKWARD_WEIGHT: "W",
    }
    made = {
        "interleaved_1f1b": ScheduleInterleaved1F1B,
        "zero_bubble": ScheduleInterleavedZeroBubble,
    }
    compared = 0
    for pp, virtual_stages, m in itertools.product((2, 3, 4), (1, 2, 3), (2, 4, 6, 8)):
        if m < pp or not search.multi_stage_micro_batches(schedule, pp, m):
            continue
        if schedule == "interleaved_1f1b" and virtual_stages == 1:
            continue
        order = made[schedule].__new__(
            made[schedule]
        )  # its order alone: no stages, no process group
        order.pp_group_size, order.n_local_stages, order._n_microbatches = pp, virtual_stages, m
        order.number_of_rounds = max(1, m // pp)
        order.microbatches_per_round = m // order.number_of_rounds
        for rank in range(pp):
            theirs = [
                (kinds[action.computation_type], action.stage_index // pp)
                for action in order._calculate_single_rank_operations(rank)
                if action is not None
            ]
            assert cost.schedule_order(schedule, pp, virtual_stages, m, rank) == theirs
            compared += 1
    assert compared > 20


def test_interleaving_divides_the_bubble_and_zero_bubble_fills_it():
    """One stage's blocks priced under 1F1B, interleaved 1F1B and the zero-bubble schedule (pp 4, m 8): the
    bubble is (pp - 1) micro-batch times, (pp - 1) / v of them interleaved, and the zero-bubble schedule
    takes (pp - 1) / v times the backward's compute off it."""
    entry = zoo.gpt(batch=8)
    blocks = analyze(entry.model, entry.args, entry.kwargs).blocks[1:3]
    decisions = (Decision(),) * len(blocks)
    hardware = get_hardware("cpu-gloo")

    def priced(schedule: str, v: int) -> dict:
        context = cost.CostContext(
            hardware=hardware,
            dp=1,
            num_micro_batches=8,
            pipeline_degree=4,
            schedule=schedule,
            virtual_stages=v,
        )
        steps = cost.evaluate_stage(blocks, tuple(range(len(blocks))), decisions, context)
        units = [
            cost.unit_cost(blocks[i : i + 1], decisions[i], context) for i in range(len(blocks))
        ]
        return {**steps.time_s, "backward": sum(unit.compute_bwd_s for unit in units)}

    one = priced("1f1b", 1)
    assert priced("interleaved_1f1b", 2)["bubble"] == pytest.approx(one["bubble"] / 2)
    assert priced("interleaved_1f1b", 3)["bubble"] == pytest.approx(one["bubble"] / 3)
    zero = priced("zero_bubble", 2)
    assert zero["bubble"] == pytest.approx((one["bubble"] - 3 * one["backward"]) / 2)
    assert 0 < zero["bubble"] < one["bubble"] / 2
    # the zero-bubble schedule holds every micro-batch of its warm-up until its weight gradient: at pp 2
    # both ranks hold 2, where 1F1B's last rank holds 1
    holds = [cost.in_flight_at_peak("zero_bubble", 2, 1, 4, stage) for stage in (0, 1)]
    one_f_one_b = Schedule(num_micro_batches=4, name="1f1b")
    assert holds == [2, 2] and [one_f_one_b.in_flight(stage, 2) for stage in (0, 1)] == [2, 1]


def test_the_solver_searches_virtual_stages_and_says_so():
    configurations = search.configurations(search.Setting(world_size=2, batch_size=8), n_blocks=6)
    pipelined = {
        (c.schedule.name, c.schedule.virtual_stages, c.schedule.num_micro_batches)
        for c in configurations
        if c.mesh.pp == 2
    }
    assert ("interleaved_1f1b", 2, 4) in pipelined and ("interleaved_1f1b", 3, 2) in pipelined
    assert ("zero_bubble", 1, 4) in pipelined and ("zero_bubble", 3, 8) in pipelined
    assert ("interleaved_1f1b", 4, 2) not in pipelined  # 8 stages of 6 blocks
    assert not any(name == "interleaved_1f1b" and m < 2 for name, _, m in pipelined)
    tied = search.Setting(world_size=2, batch_size=8, tied_edges=((0, 5),))
    assert all(c.schedule.virtual_stages == 1 for c in search.configurations(tied, n_blocks=6))
    # each is solved as any configuration is, and named so in the reasoning's runner-ups
    entry = zoo.gpt(batch=8)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    setting = search.Setting(world_size=2, batch_size=8, skip_edges=chain.skip_edges)
    for schedule, virtual_stages in (
        ("interleaved_1f1b", 2),
        ("zero_bubble", 1),
        ("zero_bubble", 2),
    ):
        configuration = search.Configuration(
            mesh=search.Mesh(pp=2),
            schedule=Schedule(num_micro_batches=4, name=schedule, virtual_stages=virtual_stages),
        )
        candidate = search.solve_configuration(
            chain.blocks,
            block_rules(chain, None),
            setting,
            configuration,
            get_hardware("cpu-gloo"),
            float("inf"),
            default_space(len(chain.blocks)),
        )
        assert candidate is not None and len(candidate.stages) == 2 * virtual_stages
        assert schedule in configuration.describe()
        if schedule == "zero_bubble":  # torch's selective checkpointing takes one backward
            assert all(
                decision.checkpoint is not Checkpoint.SELECTIVE
                for cut in candidate.stages
                for decision in cut.solution.decisions
            )


def test_a_plan_with_virtual_stages_is_priced_as_the_solver_priced_it():
    entry = zoo.gpt(batch=8)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    setting = search.Setting(world_size=2, batch_size=8, skip_edges=chain.skip_edges)
    space = default_space(len(chain.blocks))
    rules = block_rules(chain, None)
    configuration = search.Configuration(
        mesh=search.Mesh(pp=2),
        schedule=Schedule(num_micro_batches=4, name="interleaved_1f1b", virtual_stages=2),
    )
    hardware = get_hardware("cpu-gloo")
    candidate = search.solve_configuration(
        chain.blocks, rules, setting, configuration, hardware, float("inf"), space
    )
    assert candidate is not None and len(candidate.stages) == 4
    predicted = predict(chain, candidate, setting, hardware)
    assert (predicted.peak_bytes, predicted.step_time_s) == pytest.approx(
        (candidate.peak_bytes, candidate.step_time_s)
    )


def test_plans_name_their_virtual_stages_and_older_plans_load_as_one():
    entry = zoo.gpt(batch=REPLICA_BATCH)
    ids = entry.args[0]
    plan = virtual_plan(
        entry.model, ids, pp=2, schedule="interleaved_1f1b", virtual_stages=2, micro_batches=2
    )
    assert Plan.from_json(plan.to_json()) == plan
    assert [plan.schedule.stages_of_rank(rank, 2) for rank in (0, 1)] == [(0, 2), (1, 3)]
    assert "(2 stages per rank)" in plan.summary()
    older = json.loads(plan.to_json())
    del older["schedule"]["virtual_stages"]
    older["schedule"]["name"] = "1f1b"
    older["stages"] = [
        {"index": 0, "units": older["stages"][0]["units"] + older["stages"][1]["units"]},
        {"index": 1, "units": older["stages"][2]["units"] + older["stages"][3]["units"]},
    ]
    assert Plan.from_json(json.dumps(older)).schedule == Schedule(num_micro_batches=2, name="1f1b")
    with pytest.raises(PlanError, match="give pp \\* virtual_stages = 4 stages"):
        dataclasses.replace(plan, stages=plan.stages[:2])
    with pytest.raises(PlanError, match="virtual_stages >= 2"):
        Schedule(num_micro_batches=2, name="interleaved_1f1b")
    with pytest.raises(PlanError, match="more than 1 under"):
        Schedule(num_micro_batches=2, name="1f1b", virtual_stages=2)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zero_bubble"])
def test_a_ranks_stages_share_its_budget(schedule):
    """The zoo GPT's 8 blocks cut into 8 stages of a block, 4 a rank (pp 2), each checkpointed or not:
    every plan of the space walked and each rank's order added up (cost.pipeline_ranks) is the oracle.
    With each stage's fastest decision that fits the budget alone, a rank holds more than the budget;
    the search lowers its stages' budgets until the rank fits ([Note: a rank's stages share its budget]
    in solver/search.py): at the least budget any plan fits it finds the oracle's plan, and at every
    budget some plan fits it finds one that fits, never faster than the oracle's."""
    entry = zoo.gpt(batch=8)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    blocks, rules = chain.blocks, block_rules(chain, None)
    space = SearchSpace(
        strategies=(ShardStrategy.FULL_SHARD,),
        checkpoints=(Checkpoint.NONE, Checkpoint.FULL),
        prefetch=(True,),
        max_unit_blocks=1,
    )
    setting = search.Setting(world_size=2, batch_size=8, skip_edges=chain.skip_edges)
    configuration = search.Configuration(
        mesh=search.Mesh(pp=2),
        schedule=Schedule(num_micro_batches=2, name=schedule, virtual_stages=4),
    )
    hardware = get_hardware("cpu-gloo")
    walked = [
        [
            search.walk_stage(
                blocks, stage, stage, stage + 1, (0,), (decision,), setting, configuration, hardware
            )
            for decision in space.decisions(rules[stage : stage + 1])
        ]
        for stage in range(len(blocks))
    ]
    plans = []
    for stages in itertools.product(*walked):
        ranks = cost.pipeline_ranks(list(stages))
        plans.append(
            (max(rank.step_time_s for rank in ranks), max(rank.peak_bytes for rank in ranks))
        )
    budgets = sorted({peak for _, peak in plans})
    least = budgets[0]
    each_alone = [
        min((step for step in options if step.peak_bytes <= least), key=lambda s: s.step_time_s)
        for options in walked
    ]
    assert max(rank.peak_bytes for rank in cost.pipeline_ranks(each_alone)) > least
    for budget in budgets:
        fastest = min(step_time_s for step_time_s, peak in plans if peak <= budget)
        found = search.solve_configuration(
            blocks, rules, setting, configuration, hardware, budget, space
        )
        assert found is not None and found.peak_bytes <= budget
        assert found.step_time_s >= fastest * (1 - 1e-9)
        if budget == least:
            assert found.step_time_s == pytest.approx(fastest, rel=1e-9)
