"""The runtime's own kernels around its collectives in the step time: each strategy's, by its
bytes, at its op's factor ([Note: the runtime's kernels] in cost.py)."""

import pytest
from test_cost import LinearHardware, block, ctx

from shardplan.costmodel.cost import (
    CostContext,
    RuntimeKernels,
    UnitSizes,
    evaluate_stage,
    own_time_s,
    runtime_kernels,
    unit_cost,
)
from shardplan.plan import Decision, ShardStrategy

NUMEL = 10**6
"""A float32 unit's parameters: 4 MB, 1 MB a shard over 4 ranks."""


def kernels(strategy: ShardStrategy, **changes):
    context = ctx(**changes)
    return runtime_kernels(
        UnitSizes.of((block(numel=NUMEL),), context), Decision(strategy=strategy), context
    )


@pytest.mark.parametrize(
    "strategy, backward, step",
    [
        # the gradient assembled (a cat), averaged in place before its reduce-scatter, its shard added into `.grad`
        (ShardStrategy.FULL_SHARD, (("", 8 * 10**6), ("div_", 8 * 10**6), ("add_", 3 * 10**6)), ()),
        # all-reduced once a step: averaged, the rank's slice added into `.grad`; after the step the stepped
        # shard is cloned for the gather and the gathered parameters copied into the full buffer
        (
            ShardStrategy.SHARD_OPTIMIZER,
            (("", 8 * 10**6),),
            (("div_", 8 * 10**6), ("add_", 3 * 10**6), ("clone", 2 * 10**6), ("copy_", 12 * 10**6)),
        ),
        (ShardStrategy.REPLICATE, (("", 8 * 10**6),), (("div_", 8 * 10**6), ("add_", 12 * 10**6))),
    ],
)
def test_each_strategy_runs_its_own_kernels_around_its_collectives(strategy, backward, step):
    found = kernels(strategy, dp=4)
    assert (found.forward, found.backward, found.step) == ((), backward, step)


def test_no_averaging_over_a_group_of_one_and_micro_batches_add_into_the_accumulator():
    found = kernels(ShardStrategy.REPLICATE, dp=1, num_micro_batches=2)
    assert found.backward == (("", 8 * 10**6), ("add_", 12 * 10**6))
    assert found.step == (("add_", 12 * 10**6),)


def test_mixed_precision_casts_the_gathered_shard_and_the_gradient_each_way():
    found = kernels(ShardStrategy.FULL_SHARD, dp=4, param_dtype="bfloat16")
    cast_shard = ("_to_copy", 10**6 + 10**6 // 2)  # a float32 shard read, a bfloat16 one written
    assert found.forward == (cast_shard,)
    assert found.backward == (
        cast_shard,
        ("", 4 * 10**6),
        ("_to_copy", 2 * 10**6 + 4 * 10**6),
        ("div_", 8 * 10**6),
        ("add_", 3 * 10**6),
    )


def test_an_offloaded_shard_casts_on_its_way_to_and_from_the_host_but_its_gradient_on_the_device():
    """The gathered shard's cast and the reduced shard's cast back ride the host copies (offload_s); the full
    gradient's cast to the reduce dtype before its reduce-scatter runs on the device all the same."""
    context = ctx(dp=4, param_dtype="bfloat16")
    found = runtime_kernels(
        UnitSizes.of((block(numel=NUMEL),), context),
        Decision(strategy=ShardStrategy.FULL_SHARD, offload=True),
        context,
    )
    assert found.forward == ()
    assert found.backward == (
        ("", 4 * 10**6),
        ("_to_copy", 2 * 10**6 + 4 * 10**6),
        ("div_", 8 * 10**6),
        ("add_", 3 * 10**6),
    )


def test_a_replicated_units_step_pays_the_averaging_at_div_s_factor():
    class SlowDivision(LinearHardware):
        op_time_factors = {"div_": 3.0}

    replicated = Decision(strategy=ShardStrategy.REPLICATE)
    plain = unit_cost((block(numel=NUMEL),), replicated, ctx(dp=2))
    slow = unit_cost((block(numel=NUMEL),), replicated, CostContext(hardware=SlowDivision(), dp=2))
    # div_ and add_ over the 4 MB gradient at 100 GB/s, 1 us each
    assert plain.runtime_step_s == pytest.approx(2e-6 + (8 + 12) * 10**6 / 1e11)
    assert slow.runtime_step_s - plain.runtime_step_s == pytest.approx(2 * 8 * 10**6 / 1e11)
    assert slow.compute_bwd_s == plain.compute_bwd_s


def test_the_once_a_step_kernels_count_in_the_optimizer_term_and_in_a_units_own_time():
    context = ctx(dp=2)
    replicated = Decision(strategy=ShardStrategy.REPLICATE)
    unit = unit_cost((block(numel=NUMEL),), replicated, context)
    step = evaluate_stage((block(numel=NUMEL),), (0,), (replicated,), context)
    assert unit.runtime_step_s > 0
    assert step.time_s["optimizer"] == pytest.approx(unit.optimizer_s + unit.runtime_step_s)
    assert own_time_s(unit, context) == pytest.approx(
        unit.compute_fwd_s + unit.bwd_window_s + unit.optimizer_s + unit.runtime_step_s
    )


def test_a_plan_another_runtime_runs_is_priced_with_that_runtimes_kernels_in_place_of_shardplans():
    def only_a_copy_a_step(sizes, decision, context):
        return RuntimeKernels(forward=(), backward=(), step=(("copy_", sizes.storage_bytes),))

    replicated = Decision(strategy=ShardStrategy.REPLICATE)
    own = unit_cost((block(numel=NUMEL),), replicated, ctx(dp=2, num_micro_batches=2))
    other = unit_cost(
        (block(numel=NUMEL),),
        replicated,
        ctx(dp=2, num_micro_batches=2, runtime=only_a_copy_a_step),
    )
    # shardplan's assembly (8 MB) and adding into the accumulator (12 MB) in each backward are gone, 1 us each
    assert own.compute_bwd_s - other.compute_bwd_s == pytest.approx(2e-6 + 20 * 10**6 / 1e11)
    assert other.runtime_step_s == pytest.approx(1e-6 + 4 * 10**6 / 1e11)
