"""The solvers against brute force on the same decision space and cost model, and constraints."""

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardplan.costmodel.cost import CostContext, evaluate_stage
from shardplan.costmodel.hardware import get_hardware
from shardplan.frontend.chain import Block, TensorParallelFacts
from shardplan.plan import Checkpoint, Mesh, Schedule, ShardStrategy
from shardplan.solver.brute_force import count_candidates, solve_chain_brute_force, unit_partitions
from shardplan.solver.chain_dp import (
    _PARETO_CHUNK,
    ChainSolver,
    StageFloors,
    UnitCosts,
    _Front,
    _pareto,
    block_signatures,
)
from shardplan.solver.search import (
    Configuration,
    Setting,
    boundary_time_s,
    context,
    samples_per_step,
    search,
    solve_configuration,
)
from shardplan.solver.space import Constraints, SearchSpace, resolve_rules
from shardplan.solver.stages import cut_stages

H100 = get_hardware("h100-80g")
CPU_GLOO = get_hardware("cpu-gloo")
"""Its collectives take the compute's cores: exposed, and a reduce-scatter in flight holds only its shard."""
MAX_CANDIDATES = 3000
"""Brute-force plans per example: keeps the property test near a minute on two cores."""


@st.composite
def blocks_strategy(draw, max_blocks=10):
    n = draw(st.integers(1, max_blocks))
    blocks = []
    for i in range(n):
        numel = draw(st.sampled_from([0, 10**6, 3 * 10**7, 2 * 10**8]))
        fwd = draw(st.sampled_from([10**9, 3 * 10**11, 10**13]))
        blocks.append(
            Block(
                index=i,
                name=f"layers.{i}",
                modules=(f"layers.{i}",),
                param_names=(f"layers.{i}.w",) if numel else (),
                param_numel=numel,
                param_bytes=4 * numel,
                buffer_bytes=0,
                fwd_flops=fwd,
                bwd_flops=2 * fwd,
                saved_bytes=draw(st.sampled_from([10**6, 3 * 10**8, 2 * 10**9])),
                input_bytes=draw(st.sampled_from([10**6, 5 * 10**7])),
                output_bytes=5 * 10**7,
                fwd_transient_bytes=draw(st.sampled_from([0, 10**8, 10**9])),
                bwd_transient_bytes=draw(st.sampled_from([0, 3 * 10**8, 2 * 10**9])),
                first_node="a",
                last_node="b",
            )
        )
    return tuple(blocks)


@st.composite
def spaces(draw):
    return SearchSpace(
        strategies=tuple(
            draw(
                st.lists(st.sampled_from(list(ShardStrategy)), min_size=1, max_size=2, unique=True)
            )
        ),
        checkpoints=tuple(
            draw(st.lists(st.sampled_from(list(Checkpoint)), min_size=1, max_size=2, unique=True))
        ),
        prefetch=tuple(draw(st.lists(st.booleans(), min_size=1, max_size=2, unique=True))),
        allow_offload=draw(st.booleans()),
        max_unit_blocks=draw(st.integers(1, 4)),
    )


@st.composite
def contexts(draw):
    m = draw(st.sampled_from([1, 2, 4]))
    return CostContext(
        hardware=draw(st.sampled_from([H100, CPU_GLOO])),
        dp=draw(st.sampled_from([1, 2, 8, 64])),
        num_micro_batches=m,
        in_flight=draw(st.integers(1, m)),
        pipeline_degree=draw(st.sampled_from([1, 2])),
        param_dtype=draw(st.sampled_from(["float32", "bfloat16"])),
    )


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(
    blocks=blocks_strategy(),
    space=spaces(),
    ctx=contexts(),
    budget_bytes=st.sampled_from([2 * 10**9, 8 * 10**9, 3 * 10**10, 10**12]),
)
def test_chain_dp_equals_brute_force(blocks, space, ctx, budget_bytes):
    rules = resolve_rules(blocks, None)
    assume(count_candidates(rules, space) <= MAX_CANDIDATES)
    expected = solve_chain_brute_force(blocks, rules, ctx, budget_bytes, space)
    found = ChainSolver(blocks, rules, ctx, budget_bytes, space).solve(0, len(blocks))
    assert (found is None) == (expected is None)
    if found is None:
        return
    # The search's pp == 1 form: look-ahead canonical states and a time bound as tight as the optimum.
    bounded = ChainSolver(
        blocks, rules, ctx, budget_bytes, space, time_bound_s=expected.time_s, only_end=len(blocks)
    ).solve(0, len(blocks))
    assert math.isclose(bounded.time_s, expected.time_s, rel_tol=1e-9)
    walked = evaluate_stage(blocks, found.bounds, found.decisions, ctx)
    assert walked.peak_bytes == found.peak_bytes <= budget_bytes
    assert math.isclose(walked.step_time_s, found.time_s, rel_tol=1e-9)
    assert math.isclose(
        found.time_s, expected.time_s, rel_tol=1e-9
    )  # gap 0 (up to float summation order)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(
    blocks=blocks_strategy(max_blocks=5),
    ctx=contexts(),
    prefetch=st.sampled_from([(True,), (False,), (True, False)]),
    budget_bytes=st.sampled_from([2 * 10**9, 8 * 10**9, 10**12]),
)
def test_time_floors_with_exposed_communication_stay_below_the_best_plan(
    blocks, ctx, prefetch, budget_bytes
):
    """Over units of one block the floors count each unit's least exposed communication (least_exposed_s):
    the stage cut's floor and the DP's bound on the time to come never exceed the best plan's time."""
    space = SearchSpace(
        strategies=(ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP, ShardStrategy.REPLICATE),
        checkpoints=(Checkpoint.NONE, Checkpoint.FULL),
        prefetch=prefetch,
        max_unit_blocks=1,
    )
    rules = resolve_rules(blocks, None)
    assume(count_candidates(rules, space) <= MAX_CANDIDATES)
    best = solve_chain_brute_force(blocks, rules, ctx, budget_bytes, space)
    assume(best is not None)
    slack = 1 + 1e-9  # the same times summed in another order
    assert (
        StageFloors(UnitCosts(blocks, rules, space, ctx), budget_bytes).least(0, len(blocks))
        <= best.time_s * slack
    )
    solver = ChainSolver(
        blocks, rules, ctx, budget_bytes, space, time_bound_s=best.time_s, only_end=len(blocks)
    )
    allowances = solver.prices * budget_bytes  # the bound from block 0, nothing held yet (Q = 0)
    assert (solver.time_to_end_s[:, 0] - allowances).max() <= best.time_s * slack
    assert math.isclose(solver.solve(0, len(blocks)).time_s, best.time_s, rel_tol=1e-9)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)
@given(
    blocks=blocks_strategy(max_blocks=6),
    budget_bytes=st.sampled_from([8 * 10**9, 3 * 10**10]),
    m=st.sampled_from([1, 2, 4]),
    pp=st.sampled_from([2, 3]),
)
def test_stage_cuts_equal_brute_force_over_cuts(blocks, budget_bytes, m, pp):
    assume(len(blocks) >= pp)
    space = SearchSpace(
        strategies=(ShardStrategy.FULL_SHARD, ShardStrategy.REPLICATE),
        checkpoints=(Checkpoint.NONE, Checkpoint.FULL),
        prefetch=(True,),
        max_unit_blocks=2,
    )
    rules = resolve_rules(blocks, None)
    setting = Setting(world_size=pp * 2, batch_size=m)
    configuration = Configuration(
        mesh=Mesh(dp_shard=2, pp=pp), schedule=Schedule(num_micro_batches=m, name="1f1b")
    )
    found = solve_configuration(blocks, rules, setting, configuration, H100, budget_bytes, space)
    costs = UnitCosts(blocks, rules, space, context(setting, configuration, H100, 0))
    time_floors = StageFloors(costs, budget_bytes)
    memory_floors = StageFloors(costs, budget_bytes, minimize_memory=True)
    best = None
    for cut in itertools.combinations(range(1, len(blocks)), pp - 1):
        edges = (0,) + cut + (len(blocks),)
        worst = 0.0
        for stage, (start, end) in enumerate(zip(edges, edges[1:])):
            ctx = context(setting, configuration, H100, stage)
            solution = solve_chain_brute_force(
                blocks[start:end], rules[start:end], ctx, budget_bytes, space
            )
            if solution is None:
                worst = math.inf
                break
            time_s = solution.time_s + ctx.pipeline_factor * boundary_time_s(
                blocks, start, end, setting, configuration, H100
            )
            # The floors the stage cut skips spans by are lower bounds (what makes skipping exact).
            assert time_floors.least(start, end) <= time_s * (1 + 1e-9)
            assert memory_floors.least(start, end) <= solution.peak_bytes
            worst = max(worst, time_s)
        best = worst if best is None else min(best, worst)
    if best == math.inf:
        assert found is None
        return
    assert math.isclose(found.step_time_s, best, rel_tol=1e-9)
    # A time bound as tight as the optimum keeps it; a tighter one leaves nothing.
    bounded = solve_configuration(
        blocks,
        rules,
        setting,
        configuration,
        H100,
        budget_bytes,
        space,
        time_bound_s=found.step_time_s,
    )
    assert bounded.step_time_s == found.step_time_s
    assert (
        solve_configuration(
            blocks,
            rules,
            setting,
            configuration,
            H100,
            budget_bytes,
            space,
            time_bound_s=found.step_time_s * (1 - 1e-6),
        )
        is None
    )


@settings(max_examples=200, deadline=None)
@given(
    points=st.one_of(
        st.lists(
            st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
            max_size=_PARETO_CHUNK,
        ),
        # past one chunk, large fronts take a first strike in time order alone
        st.lists(
            st.tuples(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4)),
            min_size=_PARETO_CHUNK + 1,
            max_size=300,
        ),
    ),
    runs=st.booleans(),
)
def test_pareto_keeps_exactly_the_states_no_other_beats(points, runs):
    if runs:  # as the DP hands fronts over: runs sorted by time, each a source key's states
        points = sorted(points[: len(points) // 2]) + sorted(points[len(points) // 2 :])
    time_s, r, q = (
        np.array([p[k] for p in points], dtype=dtype)
        for k, dtype in ((0, float), (1, np.int64), (2, np.int64))
    )
    indices = np.arange(len(points))
    kept = _pareto(
        _Front(time_s=time_s, r=r, q=q, parent_source=indices, parent_index=indices)
    ).parent_index
    # Beaten: another state is as good in all three and is better in one, or is equal and comes first.
    expected = [
        i
        for i, p in enumerate(points)
        if not any(
            o != p and all(a <= b for a, b in zip(o, p)) or (o == p and j < i)
            for j, o in enumerate(points)
        )
    ]
    # in (T, R, Q) order, equal states in input order: the order the DP's parent indices and ties follow
    assert kept.tolist() == sorted(expected, key=lambda i: (points[i], i))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    blocks=blocks_strategy(max_blocks=6),
    budget_bytes=st.sampled_from([8 * 10**9, 3 * 10**10]),
    global_batch=st.sampled_from([None, 16]),
)
def test_a_search_for_the_fastest_plan_alone_finds_the_same_first_plan(
    blocks, budget_bytes, global_batch
):
    """runner_ups=False bounds each configuration by the fastest plan found so far, not RUNNER_UP_SLACK
    above it (compile's reasoning takes only the first): the same first plan, only as fast ones after it."""
    space = SearchSpace(
        strategies=(ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
        checkpoints=(Checkpoint.NONE, Checkpoint.FULL),
        prefetch=(True,),
        max_unit_blocks=2,
    )
    rules = resolve_rules(blocks, None)
    setting = Setting(world_size=8, batch_size=4, global_batch_size=global_batch)
    everything = search(blocks, rules, setting, H100, budget_bytes, space)
    fastest = search(blocks, rules, setting, H100, budget_bytes, space, runner_ups=False)
    assert fastest[:1] == everything[:1]
    per_sample = [c.step_time_s / samples_per_step(setting, c.configuration) for c in fastest]
    assert all(math.isclose(s, per_sample[0], rel_tol=1e-9) for s in per_sample)


def test_min_max_cut_on_hand_costs():
    rules = resolve_rules(_uniform_blocks(5), None)
    times = [3.0, 1.0, 1.0, 1.0, 3.0]

    def stage_cost(stage, start, end):
        return object(), sum(times[start:end])

    cuts = cut_stages(rules, 3, stage_cost)
    assert [(c.start, c.end) for c in cuts] == [(0, 1), (1, 4), (4, 5)]


def _uniform_blocks(n: int, names=None) -> tuple[Block, ...]:
    names = names or [f"model.layers.{i}" for i in range(n)]
    return tuple(
        Block(
            index=i,
            name=name,
            modules=(name,),
            param_names=(f"{name}.weight",),
            param_numel=10**7,
            param_bytes=4 * 10**7,
            buffer_bytes=0,
            fwd_flops=10**12,
            bwd_flops=2 * 10**12,
            saved_bytes=10**9,
            input_bytes=10**7,
            output_bytes=10**7,
            fwd_transient_bytes=10**8,
            bwd_transient_bytes=10**8,
            first_node="a",
            last_node="b",
        )
        for i, name in enumerate(names)
    )


def _solve(
    blocks, constraints, budget_bytes=10**12, space=SearchSpace(max_unit_blocks=3, prefetch=(True,))
):
    rules = resolve_rules(blocks, constraints)
    ctx = CostContext(hardware=H100, dp=8)
    return ChainSolver(blocks, rules, ctx, budget_bytes, space).solve(0, len(blocks))


def test_constraints_pin_and_forbid_unit_boundaries():
    blocks = _uniform_blocks(6)
    pinned = _solve(
        blocks,
        Constraints(unit_boundary=(r"layers\.[24]$",), no_unit_boundary=(r"layers\.[135]$",)),
    )
    assert pinned.bounds == (0, 2, 4)


def test_constraints_pin_checkpointing_and_strategy():
    blocks = _uniform_blocks(4)
    found = _solve(
        blocks,
        Constraints(
            checkpoint=((r"layers\.1$", (Checkpoint.FULL,)),),
            strategy=((r"layers\.[23]", (ShardStrategy.FULL_SHARD,)),),
        ),
    )
    ends = found.bounds[1:] + (4,)
    for start, end, decision in zip(found.bounds, ends, found.decisions):
        if start <= 1 < end:
            assert decision.checkpoint is Checkpoint.FULL
        if any(i in (2, 3) for i in range(start, end)):
            assert decision.strategy is ShardStrategy.FULL_SHARD


def test_constraints_cut_stages_where_pinned():
    blocks = _uniform_blocks(6)
    rules = resolve_rules(blocks, Constraints(stage_boundary=(r"layers\.5$",)))
    setting = Setting(world_size=4, batch_size=4)
    configuration = Configuration(
        mesh=Mesh(dp_shard=2, pp=2), schedule=Schedule(num_micro_batches=4, name="1f1b")
    )
    found = solve_configuration(
        blocks, rules, setting, configuration, H100, 10**12, SearchSpace(prefetch=(True,))
    )
    assert [(c.start, c.end) for c in found.stages] == [(0, 5), (5, 6)]
    forbid = resolve_rules(blocks, Constraints(no_stage_boundary=(r"layers\.[1-5]$",)))
    assert (
        solve_configuration(
            blocks, forbid, setting, configuration, H100, 10**12, SearchSpace(prefetch=(True,))
        )
        is None
    )


def test_contradicting_or_bad_constraints_are_refused():
    from shardplan.errors import ShardplanError

    with pytest.raises(ShardplanError, match="pin and forbid"):
        resolve_rules(
            _uniform_blocks(3),
            Constraints(unit_boundary=("layers.1",), no_unit_boundary=("layers.1",)),
        )
    with pytest.raises(ShardplanError, match="regular expression"):
        resolve_rules(_uniform_blocks(3), Constraints(unit_boundary=("layers.[",)))
    with pytest.raises(ShardplanError, match="no checkpoint mode"):
        resolve_rules(_uniform_blocks(3), Constraints(checkpoint=(("layers", ()),)))


def test_identical_layers_share_work_and_give_the_same_answer_as_distinct_names():
    blocks = _uniform_blocks(12)
    renamed = _uniform_blocks(12, names=[f"x{i}" for i in range(12)])
    assert _solve(blocks, None, budget_bytes=6 * 10**9) == _solve(
        renamed, None, budget_bytes=6 * 10**9
    )


def test_layers_whose_tensor_parallel_facts_name_their_own_modules_share_unit_costs():
    # An analyzed chain's facts list each layer's linears and the sizes tp must divide by name; the
    # names cost nothing, so 80 equal layers must cost once, not 80 times.
    blocks = tuple(
        dataclasses.replace(
            b,
            tensor_parallel=TensorParallelFacts(
                divides=8,
                sliced_numel=10**7,
                sharded=((f"{b.name}.q_proj", "colwise"),),
                divisors=((8, f"kv heads of {b.name}.k_proj"),),
            ),
        )
        for b in _uniform_blocks(4)
    )
    assert len(set(block_signatures(blocks))) == 1
    other = dataclasses.replace(
        blocks[0],
        tensor_parallel=dataclasses.replace(blocks[0].tensor_parallel, divisors=((4, "heads"),)),
    )
    assert block_signatures((blocks[0], other)) == (0, 1)  # a size is a fact, not a name


def test_dp_prices_the_backward_with_the_prefetched_unit_before_and_the_reduction_after():
    """A unit's backward holds the unit before it (prefetched) and the next unit's reduction in flight
    (cost.in_flight_bwd_bytes): three units in one event, which the DP's key carries (the prefetched
    bytes). Every plan is walked once; budgets at plans' own peaks decide which ones fit."""
    sizes = (10**6, 2 * 10**8, 3 * 10**7, 2 * 10**8, 10**6, 3 * 10**7)
    blocks = tuple(
        Block(
            index=i,
            name=f"layers.{i}",
            modules=(f"layers.{i}",),
            param_names=(f"layers.{i}.w",),
            param_numel=numel,
            param_bytes=4 * numel,
            buffer_bytes=0,
            fwd_flops=10**12,
            bwd_flops=2 * 10**12,
            saved_bytes=10**8,
            input_bytes=10**6,
            output_bytes=10**6,
            fwd_transient_bytes=10**8,
            bwd_transient_bytes=(i % 3) * 10**9,
            first_node="a",
            last_node="b",
        )
        for i, numel in enumerate(sizes)
    )
    space = SearchSpace(
        strategies=(ShardStrategy.FULL_SHARD, ShardStrategy.REPLICATE),
        checkpoints=(Checkpoint.NONE,),
        prefetch=(True, False),
        max_unit_blocks=2,
    )
    rules = resolve_rules(blocks, None)
    ctx = CostContext(hardware=H100, dp=8)
    plans = []  # (peak, time) of every plan
    for bounds in unit_partitions(rules, space):
        ends = bounds[1:] + (len(blocks),)
        for decisions in itertools.product(
            *(space.decisions(rules[a:b]) for a, b in zip(bounds, ends))
        ):
            step = evaluate_stage(blocks, bounds, decisions, ctx)
            plans.append((step.peak_bytes, step.step_time_s))
    peaks = sorted({peak for peak, _ in plans})
    for budget_bytes in peaks[:: max(1, len(peaks) // 40)]:
        found = ChainSolver(blocks, rules, ctx, budget_bytes, space).solve(0, len(blocks))
        assert found is not None
        assert (
            evaluate_stage(blocks, found.bounds, found.decisions, ctx).peak_bytes
            == found.peak_bytes
            <= budget_bytes
        )
        assert math.isclose(
            found.time_s,
            min(time_s for peak, time_s in plans if peak <= budget_bytes),
            rel_tol=1e-9,
        )


def test_pipelines_over_fewer_micro_batches_than_stages_are_searched_and_priced_as_they_run():
    """1F1B over fewer micro-batches than stages runs (runtime/pipeline_schedules.py): the search offers it, and
    prices each stage's activations as the runtime holds them (test_pipeline), min(m, pp - stage) micro-batches."""
    blocks = _uniform_blocks(8)
    rules = resolve_rules(blocks, None)
    space = SearchSpace(checkpoints=(Checkpoint.NONE,), prefetch=(True,))
    # one sample a replica: data parallelism holds every block's activations, a pipeline a stage's
    one_sample = Setting(world_size=4, batch_size=1)
    assert (
        search(
            blocks,
            rules,
            dataclasses.replace(one_sample, allow_pipeline=False),
            H100,
            4 * 10**9,
            space,
        )
        == []
    )
    found = [c.configuration for c in search(blocks, rules, one_sample, H100, 4 * 10**9, space)]
    assert [(c.mesh.pp, c.schedule) for c in found[:1]] == [
        (4, Schedule(num_micro_batches=1, name="1f1b"))
    ]
    # two micro-batches over four stages: the last stage holds one under 1F1B, both under GPipe, in the same time
    two_samples = Setting(world_size=4, batch_size=2)
    one_f_one_b, gpipe = (
        Configuration(
            mesh=Mesh(dp_shard=1, pp=4), schedule=Schedule(num_micro_batches=2, name=name)
        )
        for name in ("1f1b", "gpipe")
    )
    last = solve_configuration(
        blocks, rules, two_samples, one_f_one_b, H100, math.inf, space
    ).stages[-1]
    walked = {
        c.schedule.name: evaluate_stage(
            blocks[last.start :],
            tuple(b - last.start for b in last.solution.bounds),
            last.solution.decisions,
            context(two_samples, c, H100, 3),
        )
        for c in (one_f_one_b, gpipe)
    }
    assert walked["1f1b"].peak_bytes == last.solution.peak_bytes
    assert walked["1f1b"].peak_bytes + blocks[-1].saved_bytes <= walked["gpipe"].peak_bytes
    assert walked["1f1b"].step_time_s == walked["gpipe"].step_time_s


def test_a_starved_pipeline_is_the_last_resort_even_where_it_would_be_faster():
    """The zoo's encoder-decoder on two CPU ranks within 3 MiB: over one micro-batch its two stages pay half
    the fixed costs a step and plan 23% faster than over two, but a pipeline that idles half its step is taken
    only when nothing else fits (search.starved_pipeline), so solves stay in seconds on large meshes."""
    from shardplan.cli.model_spec import load_model
    from shardplan.compile import compile as compile_plan

    entry = load_model("encoder-decoder")
    plan = compile_plan(
        entry.model, 2, entry.args, entry.kwargs, hardware="cpu-gloo", memory_budget="3MiB"
    )
    assert plan.schedule.num_micro_batches >= plan.mesh.pp, plan.summary().splitlines()[0]
