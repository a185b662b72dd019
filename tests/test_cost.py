"""The cost model's formulas on hand-made numbers: every expected value is computed here, apart."""

import dataclasses
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan.costmodel.cost import (
    OPTIMIZER_STATE_BYTES_PER_PARAM,
    OPTIMIZER_STEPS,
    SELECTIVE_KEEP_FRACTION,
    CostContext,
    Decision,
    evaluate_stage,
    on_rank,
    pair_exposed_s,
    unit_cost,
    working_bytes,
)
from shardplan.costmodel.hardware import BUILTIN, SizeCurve
from shardplan.errors import ShardplanError
from shardplan.frontend.chain import Block, OpKind, TensorParallelFacts
from shardplan.plan import Checkpoint, ShardStrategy

MiB = 2**20


class LinearHardware:
    """1 TFLOP/s, 100 GB/s memory, 1 us per op, GELU at a third of the roofline, collectives at 1 GB/s
    bus bandwidth with the ring factor, no latency, running beside compute."""

    overlaps_communication = True

    op_time_factors = {"gelu": 3.0}

    selective_op_overhead_s = 0.0

    view_overhead_s = 0.0

    collective_compute_share = 0.0

    def compute_time_s(
        self, flops, bytes_moved, dtype="float32", *, calls=1, op="", masked_flops=0.0, head_dim=0.0
    ):
        return calls * 1e-6 + self.op_time_factors.get(op, 1.0) * max(
            flops / 1e12, bytes_moved / 1e11
        )

    def collective_time_s(self, kind, nbytes, group_size, *, ranks_per_node=0):
        factor = (group_size - 1) / group_size * (2 if kind == "all_reduce" else 1)
        return nbytes * factor / 1e9 if group_size > 1 else 0.0


def block(
    index=0,
    numel=1_000_000,
    fwd=10**12,
    saved=64 * MiB,
    inp=8 * MiB,
    fwd_transient=16 * MiB,
    bwd_transient=32 * MiB,
    **measured,
) -> Block:
    return Block(
        index=index,
        name=f"b{index}",
        modules=(f"b{index}",),
        param_names=(f"b{index}.w",),
        param_numel=numel,
        param_bytes=4 * numel,
        buffer_bytes=0,
        fwd_flops=fwd,
        bwd_flops=2 * fwd,
        saved_bytes=saved,
        input_bytes=inp,
        output_bytes=measured.pop("output_bytes", inp),
        fwd_transient_bytes=fwd_transient,
        bwd_transient_bytes=bwd_transient,
        first_node="a",
        last_node="b",
        **measured,
    )


def ctx(**changes) -> CostContext:
    return CostContext(hardware=LinearHardware(), dp=changes.pop("dp", 4), **changes)


@pytest.mark.parametrize(
    "strategy, expected",
    [
        (ShardStrategy.FULL_SHARD, (4 + 4 + 8) * 10**6 // 4),
        (ShardStrategy.SHARD_GRAD_OP, (4 + 4 + 8) * 10**6 // 4),
        (
            ShardStrategy.SHARD_OPTIMIZER,
            4 * 10**6 + (4 + 8) * 10**6 // 4,
        ),  # full params; grad and state sliced
        (ShardStrategy.REPLICATE, (4 + 4 + 8) * 10**6),
    ],
)
def test_sharded_state_by_strategy(strategy, expected):
    assert OPTIMIZER_STATE_BYTES_PER_PARAM["adamw"] == 8
    assert unit_cost((block(),), Decision(strategy=strategy), ctx()).state_bytes == expected


def test_offload_moves_the_state_off_the_device_and_costs_copies():
    unit = unit_cost((block(),), Decision(offload=True), ctx())
    assert unit.state_bytes == 0
    shard_bytes = 4 * 10**6 // 4
    assert unit.offload_s == pytest.approx(3 * shard_bytes / 25e9)  # 2 gathers + 1 gradient copy
    with pytest.raises(ShardplanError, match="sharded strategy"):
        unit_cost((block(),), Decision(strategy=ShardStrategy.REPLICATE, offload=True), ctx())


@pytest.mark.parametrize(
    "checkpoint, kept",
    [
        (Checkpoint.NONE, 64 * MiB),
        (Checkpoint.FULL, 8 * MiB),
        (Checkpoint.SELECTIVE, math.ceil(64 * MiB * SELECTIVE_KEEP_FRACTION)),
    ],
)
def test_kept_activations_by_checkpoint_and_micro_batches(checkpoint, kept):
    assert (
        unit_cost((block(), block(1)), Decision(checkpoint=checkpoint), ctx()).activation_bytes
        == 2 * kept
    )
    halved = unit_cost((block(),), Decision(checkpoint=checkpoint), ctx(num_micro_batches=2))
    assert halved.activation_bytes == kept // 2


def test_compute_recompute_and_collectives_of_a_unit():
    unit = unit_cost((block(),), Decision(checkpoint=Checkpoint.FULL), ctx(dp=4))
    assert unit.compute_fwd_s == pytest.approx(1.0)  # 1e12 FLOPs at 1 TFLOP/s
    # + the runtime's kernels: the flat gradient's assembly, its averaging, its reduced shard added into `.grad`
    assert unit.compute_bwd_s == pytest.approx(2.0 + 3e-6 + (2 * 4e6 + 2 * 4e6 + 3 * 1e6) / 1e11)
    assert unit.recompute_s == pytest.approx(1.0)
    assert unit.gather_fwd_s == pytest.approx(4e6 * 0.75 / 1e9)
    assert unit.gather_bwd_s == unit.gather_fwd_s  # FULL_SHARD gathers again for backward
    assert unit.reduce_s == pytest.approx(4e6 * 0.75 / 1e9)
    grad_op = unit_cost((block(),), Decision(strategy=ShardStrategy.SHARD_GRAD_OP), ctx(dp=4))
    assert grad_op.gather_bwd_s == 0.0 and grad_op.kept_gathered_bytes == 4 * 10**6
    ddp = unit_cost((block(),), Decision(strategy=ShardStrategy.REPLICATE), ctx(dp=4))
    assert ddp.reduce_per_step and ddp.reduce_s == pytest.approx(4e6 * 1.5 / 1e9)
    bf16 = unit_cost((block(),), Decision(), ctx(dp=4, param_dtype="bfloat16"))
    assert bf16.gathered_bytes == 2 * 10**6


def test_replicated_units_pay_for_accumulating_gradients_over_micro_batches():
    flat = dict(
        fwd=0, fwd_ops=1, bwd_ops=1, saved=0, inp=0, fwd_transient=0, bwd_transient=0
    )  # gradient alone
    sharded, replicated = (
        unit_cost((block(**flat),), Decision(strategy=strategy), ctx(num_micro_batches=2))
        for strategy in (ShardStrategy.FULL_SHARD, ShardStrategy.REPLICATE)
    )
    block_op_s = 1e-6  # the block's one backward op, moving nothing
    assembly_s = 1e-6 + 2 * 4e6 / 1e11  # cat of 4 MB: read, write
    # each micro-batch's gradient averaged and reduce-scattered, its 1 MB shard added into `.grad`
    assert sharded.compute_bwd_s == pytest.approx(
        block_op_s + assembly_s + 2e-6 + (2 * 4e6 + 3 * 1e6) / 1e11
    )
    assert replicated.compute_bwd_s == pytest.approx(
        block_op_s + assembly_s + 1e-6 + 3 * 4e6 / 1e11
    )  # accumulator add
    once = unit_cost((block(**flat),), Decision(strategy=ShardStrategy.REPLICATE), ctx())
    assert once.compute_bwd_s == pytest.approx(
        block_op_s + assembly_s
    )  # one micro-batch accumulates nothing


def test_a_single_rank_gathers_nothing_unless_it_casts():
    # dp = 1 (a pipeline stage without data parallelism): the gather returns the shard itself
    assert unit_cost((block(),), Decision(), ctx(dp=1)).gathered_bytes == 0
    assert unit_cost((block(),), Decision(), ctx(dp=2)).gathered_bytes == 4 * 10**6
    # bfloat16 compute over float32 storage: the cast allocates the unit's parameters in bfloat16
    assert (
        unit_cost((block(),), Decision(), ctx(dp=1, param_dtype="bfloat16")).gathered_bytes
        == 2 * 10**6
    )
    # an offloaded shard is copied in from the host
    assert unit_cost((block(),), Decision(offload=True), ctx(dp=1)).gathered_bytes == 4 * 10**6


def test_an_op_factor_is_read_at_one_calls_roofline_time_of_a_micro_batch():
    curve = SizeCurve(points=((1e-4, 4.0), (1e-2, 2.0)))
    hardware = dataclasses.replace(BUILTIN["cpu-gloo"], op_time_factors={"gelu": curve})
    gelu = OpKind(name="gelu", calls=3, flops=0, bytes=60 * MiB, weight_bytes=6 * MiB)
    unit = unit_cost(
        (block(fwd_kinds=(gelu,), bwd_kinds=()),),
        Decision(strategy=ShardStrategy.REPLICATE),
        CostContext(hardware=hardware, dp=1, num_micro_batches=2),
    )
    # a micro-batch moves the weights whole and half the rest: 6 + 27 MiB, over 3 calls
    roofline_s = (6 + 27) * MiB / hardware.memory_bandwidth_bytes_per_s
    factor = 4.0 + (2.0 - 4.0) * math.log((roofline_s / 3) / 1e-4) / math.log(1e-2 / 1e-4)
    assert unit.compute_fwd_s == pytest.approx(3 * hardware.op_overhead_s + factor * roofline_s)


def test_overlap_hides_the_next_gather_under_compute_and_exposes_the_rest():
    small = unit_cost((block(fwd=10**9),), Decision(), ctx(dp=4))  # 1 ms forward, 3 ms gather
    large = unit_cost((block(numel=4_000_000),), Decision(), ctx(dp=4))
    exposed = pair_exposed_s(small, large)
    gather = 16e6 * 0.75 / 1e9
    backward_gather_of_small = max(0.0, small.gather_bwd_s - large.bwd_window_s)
    reduce_of_large = max(0.0, large.reduce_s - small.bwd_window_s)
    assert exposed.per_micro_batch_s == pytest.approx(
        (gather - small.compute_fwd_s) + backward_gather_of_small + reduce_of_large
    )
    no_prefetch = unit_cost((block(fwd=10**9),), Decision(prefetch=False), ctx(dp=4))
    assert pair_exposed_s(no_prefetch, large).per_micro_batch_s == pytest.approx(
        gather + reduce_of_large
    )
    first = pair_exposed_s(None, large)
    assert first.per_micro_batch_s == pytest.approx(large.gather_fwd_s + large.reduce_s)


class CoresSharedHardware(LinearHardware):
    """As LinearHardware, but collectives take the cores the compute needs (CPU ranks on gloo)."""

    overlaps_communication = False


def test_nothing_hides_under_compute_when_collectives_share_the_cores():
    context = CostContext(hardware=CoresSharedHardware(), dp=4)
    small = unit_cost((block(fwd=10**9),), Decision(), context)
    large = unit_cost((block(numel=4_000_000),), Decision(), context)
    assert small.compute_fwd_s > 0 and small.hide_fwd_s == small.hide_bwd_s == 0.0
    every_collective = large.gather_fwd_s + small.gather_bwd_s + large.reduce_s
    assert pair_exposed_s(small, large).per_micro_batch_s == pytest.approx(every_collective)


def test_peak_of_a_two_unit_stage_is_the_backward_of_the_last_unit():
    blocks = (block(0), block(1))
    step = evaluate_stage(blocks, (0, 1), (Decision(), Decision()), ctx(dp=4))
    state = 2 * (16 * 10**6 // 4)
    params = 4 * 10**6
    # backward of unit 1: unit 0's activations + unit 1's params, activations, its outputs' gradient
    # (8 MiB, from the next stage) and backward transient (its gradient is assembled after them, in
    # less) + unit 0's params prefetched for its backward.
    expected = state + 64 * MiB + params + 64 * MiB + 8 * MiB + 32 * MiB + params
    assert step.peak_bytes == expected
    assert step.peak_event == "backward of unit 1"
    assert step.memory_bytes == {
        "sharded_state": state,
        "gathered_params": 2 * params,
        "activations": 128 * MiB,
        "transient": 40 * MiB,
    }


@pytest.mark.parametrize(
    "strategy, dp, micro_batches, hardware, in_flight",
    [
        (
            ShardStrategy.FULL_SHARD,
            4,
            1,
            LinearHardware,
            4 * 10**6 + 10**6,
        ),  # the flat gradient and its shard
        (
            ShardStrategy.FULL_SHARD,
            4,
            2,
            LinearHardware,
            4 * 10**6 + 10**6,
        ),  # reduce-scattered every micro-batch
        (ShardStrategy.REPLICATE, 4, 1, LinearHardware, 4 * 10**6),  # all-reduced in place
        (
            ShardStrategy.REPLICATE,
            4,
            2,
            LinearHardware,
            0,
        ),  # the step's accumulator is all-reduced: sharded_state
        (ShardStrategy.SHARD_OPTIMIZER, 4, 1, LinearHardware, 4 * 10**6),
        (ShardStrategy.REPLICATE, 1, 1, LinearHardware, 0),  # a group of one: finished when issued
        # collectives that take the compute's cores have run before it goes on: the scattered gradient is
        # freed, the shard it wrote waits to be added into `.grad`; an all-reduce writes in place
        (ShardStrategy.FULL_SHARD, 4, 1, CoresSharedHardware, 10**6),
        (ShardStrategy.SHARD_GRAD_OP, 4, 1, CoresSharedHardware, 10**6),
        (ShardStrategy.REPLICATE, 4, 1, CoresSharedHardware, 4 * 10**6),
    ],
)
def test_the_backward_of_a_unit_holds_the_next_units_reduction_in_flight(
    strategy, dp, micro_batches, hardware, in_flight
):
    """The runtime finishes unit k+1's reduction when unit k's backward ends (runtime/scheduler.py):
    unit 0's backward, the peak here (its transient dwarfs the rest), holds unit 1's gradient."""
    blocks = (block(0, saved=0, bwd_transient=256 * MiB), block(1, saved=0))
    decisions = (Decision(strategy=strategy, prefetch=False),) * 2
    context = CostContext(hardware=hardware(), dp=dp, num_micro_batches=micro_batches)
    step = evaluate_stage(blocks, (0, 1), decisions, context)
    alone = evaluate_stage(blocks[:1], (0,), decisions[:1], context)
    unit = unit_cost(blocks[1:], decisions[1], context)
    assert step.peak_event == "backward of unit 0"
    assert step.peak_bytes - alone.peak_bytes == unit.state_bytes + in_flight


def test_a_units_backward_peaks_where_its_gradient_is_assembled_when_that_is_larger():
    """Beside few activations, the parameters' gradients and the flat gradient concatenated from
    them (both at once, at the end of the backward) are the unit's peak."""
    numel = 64 * MiB // 4
    step = evaluate_stage(
        (block(0, numel=numel, saved=MiB, inp=MiB, fwd_transient=MiB, bwd_transient=MiB),),
        (0,),
        (Decision(strategy=ShardStrategy.REPLICATE),),
        ctx(dp=2),
    )
    state = (4 + 4 + 8) * numel
    assert step.peak_event == "backward of unit 0"
    assert step.peak_bytes == state + 2 * 4 * numel


def test_step_time_is_the_sum_of_its_components_and_the_bubble_follows_the_schedule():
    blocks = (block(0), block(1))
    decisions = (Decision(), Decision(checkpoint=Checkpoint.FULL))
    flat = evaluate_stage(blocks, (0, 1), decisions, ctx(dp=4, num_micro_batches=4))
    piped = evaluate_stage(
        blocks, (0, 1), decisions, ctx(dp=4, num_micro_batches=4, pipeline_degree=3)
    )
    assert flat.step_time_s == pytest.approx(sum(flat.time_s.values()))
    assert flat.time_s["recompute"] == pytest.approx(
        4 * (0.25 + 1e-6)
    )  # the forward again: its FLOPs and one op
    per_micro_batch = (flat.time_s["compute"] + flat.time_s["recompute"]) / 4 + (
        flat.time_s["exposed_comm"] - 0.0
    ) / 4
    assert piped.time_s["bubble"] == pytest.approx(2 * per_micro_batch)
    assert piped.step_time_s == pytest.approx(flat.step_time_s + 2 * per_micro_batch)


def test_micro_batches_in_flight_multiply_the_held_activations():
    blocks = (block(0), block(1))
    one = evaluate_stage(blocks, (0, 1), (Decision(), Decision()), ctx(num_micro_batches=2))
    three = evaluate_stage(
        blocks, (0, 1), (Decision(), Decision()), ctx(num_micro_batches=2, in_flight=3)
    )
    assert three.peak_bytes - one.peak_bytes == 2 * (2 * 32 * MiB)


def test_unknown_optimizer_and_dtype_are_refused():
    with pytest.raises(ShardplanError, match="optimizer"):
        ctx(optimizer="lion")
    with pytest.raises(ShardplanError, match="dtype"):
        ctx(param_dtype="int4")


@pytest.mark.parametrize(
    "name, make",
    [
        ("adamw", lambda params: torch.optim.AdamW(params, lr=1e-3)),
        ("adam", lambda params: torch.optim.Adam(params, lr=1e-3)),
        ("sgd", lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)),
    ],
)
def test_optimizer_step_traffic_is_what_torch_optim_runs(name, make):
    """Each kernel of a real step and zero_grad, its tensors' bytes summed by hand (not by the analysis)."""
    numel = 1000
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.ones(numel)
    optimizer = make([param])
    optimizer.step()  # the first step makes the state
    counter = _KernelBytes()
    with counter:
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    assert (counter.bytes // numel, counter.kernels) == (
        OPTIMIZER_STEPS[name].bytes_per_param,
        OPTIMIZER_STEPS[name].kernels,
    )


class _KernelBytes(TorchDispatchMode):
    """Elementwise kernels over whole tensors (scalar bookkeeping such as the step count left out)."""

    def __init__(self):
        super().__init__()
        self.bytes = self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(kwargs or {}).values(), out) if isinstance(t, torch.Tensor)]
        if not func.is_view and any(t.numel() > 1 for t in tensors):
            self.kernels += 1
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


@pytest.mark.parametrize(
    "strategy, stepped_numel",
    [
        (ShardStrategy.FULL_SHARD, 10**6 // 4),
        (ShardStrategy.SHARD_OPTIMIZER, 10**6 // 4),
        (ShardStrategy.REPLICATE, 10**6),
    ],
)
def test_the_optimizer_streams_this_ranks_shard(strategy, stepped_numel):
    unit = unit_cost((block(),), Decision(strategy=strategy), ctx(dp=4))
    # the runtime's gradient check (4 bytes), AdamW + zero_grad (92) per stepped parameter at 100 GB/s, 10 kernels at 1 us
    assert unit.optimizer_s == pytest.approx(10e-6 + stepped_numel * 96 / 1e11)
    offloaded = unit_cost((block(),), Decision(offload=True), ctx(dp=4))
    assert offloaded.optimizer_s == pytest.approx(
        10**6 // 4 * 92 / 50e9
    )  # host memory, no kernel costs


def test_selective_recompute_reruns_the_memory_bound_forward_ops():
    measured = block(fwd_memory_bytes=300 * MiB, fwd_ops=40, selective_bytes=8 * MiB)
    unit = unit_cost(
        (measured,), Decision(checkpoint=Checkpoint.SELECTIVE), ctx(num_micro_batches=2)
    )
    # per micro-batch: 40 ops at 1 us, half of 300 MiB at 100 GB/s; matmuls kept, not re-run
    assert unit.recompute_s == pytest.approx(40e-6 + 150 * MiB / 1e11)


def analyzed_layer() -> Block:
    """A block as the analysis writes it: its ops by name, adding up to its totals."""
    fwd = (
        OpKind(name="addmm", calls=2, flops=4 * 10**9, bytes=40 * MiB),
        OpKind(name="gelu", calls=1, flops=0, bytes=16 * MiB),
        OpKind(name="native_layer_norm", calls=1, flops=0, bytes=4 * MiB, weight_bytes=2 * MiB),
    )
    bwd = (
        OpKind(name="mm", calls=4, flops=8 * 10**9, bytes=80 * MiB),
        OpKind(name="gelu_backward", calls=1, flops=0, bytes=24 * MiB),
    )
    return block(
        fwd=4 * 10**9,
        fwd_kinds=fwd,
        bwd_kinds=bwd,
        fwd_ops=4,
        bwd_ops=5,
        fwd_memory_bytes=20 * MiB,
        bwd_memory_bytes=24 * MiB,
        selective_bytes=8 * MiB,
    )


def test_an_analyzed_block_is_priced_op_kind_by_op_kind():
    unit = unit_cost(
        (analyzed_layer(),),
        Decision(strategy=ShardStrategy.REPLICATE, checkpoint=Checkpoint.SELECTIVE),
        ctx(num_micro_batches=2),
    )
    # per micro-batch, half of every kind's FLOPs and activation bytes, all its weight bytes; GELU at 3x
    addmm_s = 2e-6 + max(2e9 / 1e12, 20 * MiB / 1e11)
    gelu_s = 1e-6 + 3.0 * 8 * MiB / 1e11
    norm_s = 1e-6 + (2 * MiB + 1 * MiB) / 1e11
    assert unit.compute_fwd_s == pytest.approx(addmm_s + gelu_s + norm_s)
    mm_s = 4e-6 + max(4e9 / 1e12, 40 * MiB / 1e11)
    gradient_s = (
        2e-6 + (2 * 4e6 + 3 * 4e6) / 1e11
    )  # flat gradient's cat and accumulation (m > 1, replicated)
    assert unit.compute_bwd_s == pytest.approx(mm_s + (1e-6 + 12 * MiB / 1e11) + gradient_s)
    # selective checkpointing keeps addmm's output and runs the GELU and the norm again
    assert unit.recompute_s == pytest.approx(gelu_s + norm_s)


def test_a_block_without_flops_pays_only_its_memory_bound_ops():
    lookup = block(fwd=0, fwd_memory_bytes=2 * MiB, fwd_ops=1, bwd_memory_bytes=3 * MiB, bwd_ops=1)
    unit = unit_cost((lookup,), Decision(strategy=ShardStrategy.REPLICATE), ctx())
    # no roofline over its parameters and activations on top: 1 op at 1 us and its bytes at 100 GB/s
    assert unit.compute_fwd_s == pytest.approx(1e-6 + 2 * MiB / 1e11)
    assert unit.compute_bwd_s == pytest.approx(
        1e-6 + 3 * MiB / 1e11 + 1e-6 + 2 * 4e6 / 1e11
    )  # + gradient cat


def test_pipeline_sends_cross_nodes_once_the_world_spans_them():
    """Neighbouring stages sit dp ranks apart: within one 8-GPU node a send rides NVLink, across
    nodes one GPU's NICs (44.8 GB/s) plus one hop of a ring across nodes."""
    from shardplan.plan import Mesh, Schedule
    from shardplan.solver.search import Configuration, Setting, boundary_times_s

    h100 = BUILTIN["h100-80g"]
    blocks = (block(0, inp=64 * MiB), block(1, inp=64 * MiB))
    sent = 2 * 64 * MiB  # a send of x bytes is priced as an all-gather of 2x over 2 ranks
    for world, link in ((8, h100.intra_node), (16, h100.inter_node)):
        configuration = Configuration(
            mesh=Mesh(dp_shard=world // 2, pp=2), schedule=Schedule(name="1f1b")
        )
        cost = link.collectives["all_gather_into_tensor"]
        latency_s = cost.latency_s + link.ring_latency_per_node_s * (world > 8)  # one hop of a ring
        expected = latency_s + sent / 2 / cost.bus_bandwidth_bytes_per_s + link.in_step_wait_s
        assert boundary_times_s(
            blocks, Setting(world_size=world, batch_size=1), configuration, h100
        )[1] == (pytest.approx(expected))


@pytest.mark.parametrize("strategy", list(ShardStrategy))
def test_the_runtime_keeps_and_gathers_what_the_cost_model_counts(strategy):
    """Both read the strategy's traits: what a rank keeps between steps (its parameters and the gradient
    of the part it steps) and whether the unit is gathered before use."""
    from shardplan.plan import Unit
    from shardplan.runtime.flat_param import FlatLayout
    from shardplan.runtime.sharded import _keep_slice
    from shardplan.runtime.unit import FlatUnit, UnitPlace

    numel, dp = 1_000_000, 4
    layout = FlatLayout.of("b0", [("b0.w", torch.zeros(numel))], dp)
    shard, full = _keep_slice(strategy.traits, torch.zeros(numel), layout, 0, offload=False)
    unit = FlatUnit(
        spec=Unit(name="b0", modules=("b0",), params=("b0.w",), strategy=strategy),
        layout=layout,
        shard=shard,
        full=full,
        slots=[],
        place=UnitPlace.alone(),
        compute_dtype=torch.float32,
        reduce_dtype=torch.float32,
        device=torch.device("cpu"),
    )
    kept_bytes = 4 * ((full if full is not None else shard).numel() + shard.numel())
    predicted = unit_cost(
        (block(numel=numel),), Decision(strategy=strategy), ctx(dp=dp, optimizer="none")
    )
    assert predicted.state_bytes == kept_bytes
    assert unit.sharded == (predicted.gathered_bytes > 0)


@pytest.mark.parametrize("strategy", list(ShardStrategy))
def test_offload_is_one_rule_for_plans_the_cost_model_and_the_search(strategy):
    from shardplan.solver.space import BlockRule, SearchSpace

    if strategy.traits.may_offload:
        assert (
            unit_cost((block(),), Decision(strategy=strategy, offload=True), ctx()).state_bytes == 0
        )
    else:
        with pytest.raises(ShardplanError, match="offload needs a sharded strategy"):
            Decision(strategy=strategy, offload=True)
    searched = {
        d.strategy for d in SearchSpace(allow_offload=True).decisions((BlockRule(),)) if d.offload
    }
    # the search leaves out offloading units kept gathered from forward to backward (space.py)
    assert (strategy in searched) == (
        strategy.traits.may_offload and strategy.traits.reshard_after_forward
    )


def tensor_parallel_block(**changes) -> Block:
    """A layer of 1M parameters, 1000 of them whole (norms), 60% of its FLOPs and half its saved bytes in
    the sliced linears and attention; two pairs exchanging 8 MiB a replica batch."""
    facts = TensorParallelFacts(
        divides=8,
        sliced_numel=999_000,
        sliced_fwd_flops=6 * 10**11,
        sliced_bwd_flops=12 * 10**11,
        sliced_saved_bytes=32 * MiB,
        sequence_layer=True,
        all_reduces=4,
        exchange_bytes=8 * MiB,
    )
    return block(tensor_parallel=dataclasses.replace(facts, **changes))


def test_a_block_on_a_tp_rank_divides_what_its_facts_slice():
    whole = tensor_parallel_block()
    assert on_rank(whole, ctx()) is whole  # tp = 1: the block as captured
    rank = on_rank(whole, ctx(tp=4))
    assert rank.param_numel == 1000 + 999_000 // 4
    assert rank.fwd_flops == 4 * 10**11 + 6 * 10**11 // 4
    assert rank.saved_bytes == 32 * MiB + 32 * MiB // 4  # the norms' activations stay whole
    assert rank.input_bytes == whole.input_bytes
    sequence = on_rank(
        whole, ctx(tp=4, sequence_parallel=True)
    )  # Korthikanti et al.: everything divides
    assert (sequence.saved_bytes, sequence.input_bytes, sequence.fwd_flops) == (
        16 * MiB,
        2 * MiB,
        10**12 // 4,
    )
    assert sequence.param_numel == rank.param_numel
    assert on_rank(whole, ctx(tp=3)) is whole  # 3 does not divide its heads: it stays whole
    half_batch = on_rank(whole, ctx(batch_scale=0.5))
    assert (half_batch.saved_bytes, half_batch.fwd_flops, half_batch.param_numel) == (
        32 * MiB,
        5 * 10**11,
        10**6,
    )


def test_under_sequence_parallelism_the_exchanged_hidden_states_stay_whole_in_a_blocks_transients():
    """Measured on the runtime (benchmarks/probe_rank_peak.py): at the
    peak of a layer's backward a tp rank holds its row-parallel linear's output gradient all-gathered whole
    beside the 1/tp input gradient, so of a transient one tensor of the hidden states does not divide."""
    whole = tensor_parallel_block()  # its pairs exchange 8 MiB of hidden states
    sequence = on_rank(whole, ctx(tp=4, sequence_parallel=True))
    assert sequence.saved_bytes == 16 * MiB  # the rest scales as the saved bytes do: 1/4
    assert (sequence.fwd_transient_bytes, sequence.bwd_transient_bytes) == (
        8 * MiB + 8 * MiB // 4,
        8 * MiB + 24 * MiB // 4,
    )
    half_batch = on_rank(whole, ctx(tp=4, sequence_parallel=True, batch_scale=0.5))
    assert half_batch.bwd_transient_bytes == 4 * MiB + 24 * MiB // 8
    plain = on_rank(
        whole, ctx(tp=4)
    )  # without sequence parallelism the saved ratio holds it already
    assert plain.bwd_transient_bytes == 20 * MiB  # 32 MiB at the saved ratio, 40 of 64 MiB


def test_without_sequence_parallelism_what_the_sliced_ops_backward_makes_at_its_peak_divides_by_tp():
    """Measured on the runtime (benchmarks/probe_rank_peak.py):
    at the peak of a GPT layer's backward a tp rank holds its MLP's row-parallel linear's input gradient and
    its weight's gradient, both 1/tp, which the saved ratio (keeping the norms' whole share) priced higher."""
    whole = tensor_parallel_block(
        sliced_bwd_transient_bytes=24 * MiB
    )  # of its 32 MiB backward transient
    plain = on_rank(whole, ctx(tp=4))
    assert (
        plain.bwd_transient_bytes == 24 * MiB // 4 + 5 * MiB
    )  # the other 8 MiB at the saved ratio, 40 of 64
    assert plain.fwd_transient_bytes == 10 * MiB  # the forward's at the saved ratio, as before
    half_batch = on_rank(whole, ctx(tp=4, batch_scale=0.5))  # saved 16 + 4 of 64 MiB
    assert half_batch.bwd_transient_bytes == 24 * MiB // 8 + 8 * MiB * 20 // 64
    sequence = on_rank(
        whole, ctx(tp=4, sequence_parallel=True)
    )  # the whole-width tensor, the rest at 1/4
    assert sequence.bwd_transient_bytes == 8 * MiB + 24 * MiB // 4


def test_under_sequence_parallelism_a_row_parallel_peak_holds_its_gathered_output_gradient_beside_the_sliced_part():
    """Measured on the runtime (benchmarks/probe_rank_peak.py): a GPT layer's
    backward (hidden 512, 4 x 512 tokens) peaks in its MLP's row-parallel linear, whose input and weight
    gradients (16 + 4 MiB at tp 1) are 1/tp, beside its output gradient all-gathered whole (4 MiB), which at
    tp 1 was live before the op: 4 + 10 MiB on a rank of tp 2, where the saved ratio priced 4 + 16 x 0.5625."""
    layer = block(
        saved=64 * MiB,
        inp=4 * MiB,
        bwd_transient=20 * MiB,
        output_bytes=4 * MiB,
        tensor_parallel=TensorParallelFacts(
            divides=8,
            sliced_numel=999_000,
            sliced_saved_bytes=32 * MiB,
            sequence_layer=True,
            all_reduces=4,
            exchange_bytes=4 * MiB,
            sliced_bwd_transient_bytes=20 * MiB,
            gathered_bwd_peak_bytes=4 * MiB,
        ),
    )
    assert on_rank(layer, ctx(tp=2, sequence_parallel=True)).bwd_transient_bytes == 14 * MiB
    assert (
        on_rank(layer, ctx(tp=2)).bwd_transient_bytes == 10 * MiB
    )  # no gather without sequence parallelism
    other_peak = dataclasses.replace(
        layer, tensor_parallel=dataclasses.replace(layer.tensor_parallel, gathered_bwd_peak_bytes=0)
    )
    # where another op peaks, the whole-width tensor is one of its own allocations: kept whole within them
    assert (
        on_rank(other_peak, ctx(tp=2, sequence_parallel=True)).bwd_transient_bytes
        == 4 * MiB + 16 * MiB // 2
    )


@pytest.mark.parametrize("strategy", list(ShardStrategy))
@pytest.mark.parametrize("checkpoint", list(Checkpoint))
def test_a_blocks_backward_peak_holds_the_parameter_gradients_made_before_it(strategy, checkpoint):
    """Measured on the runtime (benchmarks/probe_rank_peak.py): a GPT-2
    layer's backward peaks in its GELU's backward, after its output projection's, whose gradients (262,400
    parameters, 1 MiB) the runtime holds until the unit's last gradient is made, as it holds those of the
    unit's blocks whose backward ran before; the kept `.grad` of the state term is another tensor."""
    layer = block(0, numel=789_760, bwd_transient=4 * MiB, output_bytes=0)
    with_grads = dataclasses.replace(layer, bwd_peak_grad_numel=262_400)
    decision = Decision(strategy=strategy, checkpoint=checkpoint)
    plain, held = (unit_cost((b,), decision, ctx(dp=2)) for b in (layer, with_grads))
    assert (
        sum(held.bwd_working) - sum(plain.bwd_working) == 262_400 * 4
    )  # 1 MiB and 1 KiB of float32
    assert held.state_bytes == plain.state_bytes
    compute = ctx(
        dp=2, param_dtype="bfloat16", num_micro_batches=2
    )  # in the compute dtype, each micro-batch whole
    assert (
        sum(unit_cost((with_grads,), decision, compute).bwd_working)
        - sum(unit_cost((layer,), decision, compute).bwd_working)
    ) == 262_400 * 2
    # a block after it in the unit, whose backward runs first
    head = block(1, numel=1000, saved=0, inp=0, fwd_transient=0, bwd_transient=0, output_bytes=0)
    alone, in_unit = (
        unit_cost((layer,), decision, ctx(dp=2)),
        unit_cost((layer, head), decision, ctx(dp=2)),
    )
    assert in_unit.bwd_working[1] == alone.bwd_working[1] + 1000 * 4


def test_tp_exchanges_are_exposed_all_reduces_or_gathers_and_scatters_per_micro_batch():
    b, group = tensor_parallel_block(), 4
    ring = (group - 1) / group
    plain = unit_cost((b,), Decision(), ctx(tp=group, num_micro_batches=2))
    assert plain.tensor_parallel_s == pytest.approx(4 * (4 * MiB) * 2 * ring / 1e9)
    sequence = unit_cost(
        (b,), Decision(), ctx(tp=group, num_micro_batches=2, sequence_parallel=True)
    )
    assert sequence.tensor_parallel_s == pytest.approx(
        4 * 2 * (4 * MiB) * ring / 1e9
    )  # gather + scatter
    alone = ctx(
        dp=1, tp=group, num_micro_batches=2
    )  # no data-parallel traffic: the exchanges are all
    step = evaluate_stage((b,), (0,), (Decision(),), alone)
    assert step.time_s["exposed_comm"] == pytest.approx(
        2 * unit_cost((b,), Decision(), alone).tensor_parallel_s
    )


def test_hsdp_reduce_scatters_over_the_shard_group_then_all_reduces_the_shard_across_replicas():
    b = block()
    grad = 4 * 10**6
    unit = unit_cost((b,), Decision(), ctx(dp=4, dp_replicate=2))
    assert unit.reduce_s == pytest.approx(grad * 3 / 4 / 1e9 + (grad // 4) * 2 * 1 / 2 / 1e9)
    assert unit.state_bytes == (4 + 4 + 8) * 10**6 // 4  # memory shards over dp_shard only
    assert unit.gather_fwd_s == pytest.approx(grad * 3 / 4 / 1e9)
    replicated = unit_cost(
        (b,), Decision(strategy=ShardStrategy.REPLICATE), ctx(dp=4, dp_replicate=2)
    )
    assert replicated.reduce_s == pytest.approx(grad * 2 * 7 / 8 / 1e9)  # one all-reduce over all 8


def test_data_parallel_groups_stride_by_tp_across_nodes():
    h100 = BUILTIN["h100-80g"]
    spread = unit_cost((block(),), Decision(), CostContext(hardware=h100, dp=16, tp=4))
    packed = unit_cost((block(),), Decision(), CostContext(hardware=h100, dp=16))
    # 16 ranks strided by 4: 2 a node over 8 nodes (rails: 2 links each) against 8 a node over 2 nodes
    assert spread.gather_fwd_s == h100.collective_time_s(
        "all_gather_into_tensor", 4 * 10**6, 16, ranks_per_node=2
    )
    assert packed.gather_fwd_s == h100.collective_time_s("all_gather_into_tensor", 4 * 10**6, 16)
    assert spread.gather_fwd_s > packed.gather_fwd_s


def test_selective_recomputes_the_saved_bytes_it_did_not_keep():
    # a head: it keeps its input (saved by its matmul) and its logits, which autograd does not save (the
    # loss's log-softmax saves its own output): its backward holds the logits besides every saved byte
    head = block(
        saved=5 * MiB,
        inp=1 * MiB,
        fwd_transient=0,
        bwd_transient=8 * MiB,
        selective_bytes=4 * MiB,
        selective_saved_bytes=1 * MiB,
        output_bytes=0,
    )
    kept, _, backward = working_bytes((head,), Checkpoint.SELECTIVE, ctx())
    assert kept == 5 * MiB
    assert backward == (
        5 * MiB,
        4 * MiB + 8 * MiB,
    )  # the log-softmax's 4 MiB recomputed (or never dropped)


def test_a_selective_blocks_backward_holds_its_output_gradient_less_what_its_recompute_drops():
    """Measured on the runtime (benchmarks/probe_rank_peak.py): a Llama layer's
    recompute takes its query, key and output projections out of the checkpoint's cache to re-run their
    readers and drops them (autograd saves none), while the gradient of the layer's output, made by the
    layer after it, is live through its backward as under every checkpointing."""
    layer = block(
        saved=9 * MiB,
        inp=1 * MiB,
        fwd_transient=0,
        bwd_transient=2 * MiB,
        output_bytes=1 * MiB,
        selective_bytes=5 * MiB,
        selective_saved_bytes=3 * MiB,
        selective_dropped_bytes=2 * MiB,
    )
    kept, _, backward = working_bytes((layer,), Checkpoint.SELECTIVE, ctx())
    assert kept == 6 * MiB  # its input and its matmul outputs
    # its output gradient, the saved bytes it did not keep, less the kept ones its recompute drops, its transient
    assert backward == (6 * MiB, 1 * MiB + (9 - 3) * MiB - 2 * MiB + 2 * MiB)


def test_a_measured_block_without_matmuls_keeps_its_input_under_selective():
    """An embedding or a norm the analysis measured keeps what checkpointing its modules keeps (a dropout's
    input after an embedding: benchmarks/probe_rank_peak.py), not a share of
    its saved bytes, which only a block built by hand (no dispatch count) is priced at."""
    norm = block(
        saved=4 * MiB,
        inp=1 * MiB,
        fwd_transient=0,
        bwd_transient=1 * MiB,
        output_bytes=0,
        selective_saved_bytes=1 * MiB,
        fwd_dispatches=6,
    )
    kept, _, backward = working_bytes((norm,), Checkpoint.SELECTIVE, ctx())
    assert (kept, backward) == (1 * MiB, (1 * MiB, (4 - 1) * MiB + 1 * MiB))
    by_hand = dataclasses.replace(norm, fwd_dispatches=0, selective_saved_bytes=0)
    kept, _, backward = working_bytes((by_hand,), Checkpoint.SELECTIVE, ctx())
    assert kept == math.ceil(4 * MiB * SELECTIVE_KEEP_FRACTION) == 2 * MiB
    assert backward == (2 * MiB, 2 * MiB + 1 * MiB)


@pytest.mark.parametrize(
    "checkpoint, transient",
    [
        (Checkpoint.NONE, 32 * MiB),
        (
            Checkpoint.FULL,
            64 * MiB - 8 * MiB + 32 * MiB,
        ),  # the recompute saves the kept input again: held already
    ],
)
def test_a_blocks_backward_holds_the_gradient_of_its_outputs(checkpoint, transient):
    """Measured on the runtime (benchmarks/probe_rank_peak.py): a plain dp 2 plan of a
    wide GPT peaks in a layer's backward one hidden-state tensor above the working set the analysis
    measured, which starts where the gradient of the layer's output, made by the layer after it, is
    live already: it stays live through the layer's recompute and backward. The loss's block receives none."""
    layer = block(0, output_bytes=8 * MiB)
    assert working_bytes((layer,), checkpoint, ctx())[2][1] == 8 * MiB + transient
    per_micro_batch = working_bytes((layer,), checkpoint, ctx(num_micro_batches=2))[2][1]
    assert per_micro_batch == (8 * MiB + transient) // 2
    head = block(1, output_bytes=0)
    assert working_bytes((head,), checkpoint, ctx())[2][1] == transient
    sequence = on_rank(tensor_parallel_block(), ctx(tp=4, sequence_parallel=True))
    _, _, (_, on_a_rank) = working_bytes((sequence,), checkpoint, ctx(tp=4, sequence_parallel=True))
    assert sequence.output_bytes == tensor_parallel_block().output_bytes // 4  # the sequence's 1/tp
    recomputed = sequence.saved_bytes - sequence.input_bytes if checkpoint is Checkpoint.FULL else 0
    assert on_a_rank == sequence.output_bytes + recomputed + sequence.bwd_transient_bytes


def test_the_bytes_that_do_not_grow_with_the_batch_are_priced_once():
    """A GPT analysed at one sequence and priced at 8 (a larger replica batch, or 8 micro-batches of an
    analysis at 8) holds what the analysis at 8 holds in each block's backward: weight gradients and the
    embedding's whole-table gradient once, the activations 8 times (a head whose loss backward peaks
    above its weight gradient's at 8 sequences included). Not the learned positions: the gradient of their
    output summed over the batch, (1, S, d), is an activation's gradient that does not grow, priced as one
    that does."""
    from shardplan.costmodel.cost import bwd_transient_bytes, on_rank
    from shardplan.frontend.passes import analyze
    from shardplan.models import zoo

    config = zoo.GPTConfig(vocab_size=1024, seq_len=128, n_layer=2, n_head=8, d_model=256)
    chains = {
        batch: analyze(*(lambda e: (e.model, e.args, e.kwargs))(zoo.gpt(config, batch=batch)))
        for batch in (1, 8)
    }
    larger, split = ctx(dp=1, batch_scale=8.0), ctx(dp=1, num_micro_batches=8)
    for one, eight in zip(chains[1].blocks, chains[8].blocks):
        if one.name == "wpe":
            continue
        expected = bwd_transient_bytes(eight, ctx(dp=1))
        assert bwd_transient_bytes(on_rank(one, larger), larger) == pytest.approx(
            expected, rel=0.02, abs=2**16
        )
        assert bwd_transient_bytes(eight, split) == pytest.approx(
            bwd_transient_bytes(one, ctx(dp=1)), rel=0.02, abs=2**16
        )
    embedding = chains[1].blocks[0]
    assert embedding.bwd_peaks == (
        (1024 * 256 * 4, 0),
    )  # the table's gradient, in fp32, and nothing else
