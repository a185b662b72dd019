"""The GPU cost model against published H100 runs (benchmarks/bench_published.py) on a committed
slice of the data set: 1B and 3B playbook runs at 16 GPUs (2 nodes) and 64 GPUs (8 nodes), tp = 1,
pp <= 4. Fails when the ranking or the memory classification drops below what was recorded."""

import dataclasses
import os

import pytest

from shardplan.compile import evaluate_stages, solve
from shardplan.costmodel.cost import CostContext, StepCost, UnitSizes
from shardplan.costmodel.hardware import get_hardware, ring_factor
from shardplan.plan import (
    BF16_MIXED,
    Decision,
    Mesh,
    MixedPrecision,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardStrategy,
    Stage,
    Unit,
)

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = os.path.join(HERE, "data", "published_h100_rows.csv")
RECORDED = {  # (model, GPUs): (Kendall tau, crashed rows predicted over, rows that ran predicted within)
    ("playbook-1B", 16): (0.71, 9, 9),
    ("playbook-1B", 64): (0.48, 1, 13),
    ("playbook-3B", 16): (0.60, 10, 9),
    ("playbook-3B", 64): (0.64, 6, 8),
}
"""At commit time: tau +0.72 / +0.51 / +0.61 / +0.64, since the GEMM rates and NVLink collectives are
XLA's H100 measurements (before them +0.78 / +0.51 / +0.78 / +0.64: the 9 rows of each group at 16 GPUs
differ by 1-3% but for two broken runs at 3.2k tokens/s, and a GEMM's rate by micro-batch size reorders
pairs that close; the whole data set's groups at 16 GPUs rose, 1B +0.75 to +0.78, 3B +0.57 to +0.58);
+0.78 / +0.51 / +0.78 / +0.64 since a ring's latency per node prices the
all-gathers across nodes, pipeline sends included (before it +0.72 / +0.49 / +0.78 / +0.64; before the
cross-node link model +0.06 / -0.03 / +0.00 / -0.79; before the host's ~10 us an op, +0.78 / +0.49 /
+0.78 / +0.57: one of the 36 pairs of 1B at 16 GPUs flipped, while that whole group of the data set
rose from +0.69 to +0.75); +0.78 / +0.49 / +0.78 / +0.64 since a collective beside the compute takes a share of
its rate (collective_compute_share): of 1B's 78 pairs at 64 GPUs one flipped, a run measured at 3.3k tokens/s
(6x below its neighbours) against one at 19.3k, predicted 0.03% apart before; a little slack below each tau for
float noise, none on the counts."""


@pytest.fixture(scope="module")
def outcomes(published_bench):
    found = published_bench.predict(published_bench.read_rows(ROWS), get_hardware("h100-80g"))
    assert [o.reason for o in found if o.reason] == []  # every tp = 1 row is a plan
    return found


@pytest.fixture(scope="module")
def scores(published_bench, outcomes):
    return {
        (s.model, s.n_gpus): s
        for s in published_bench.score(outcomes, get_hardware("h100-80g").usable_memory_bytes)
    }


@pytest.mark.parametrize("group", sorted(RECORDED))
def test_ranking_and_memory_side_hold_on_the_committed_rows(scores, group):
    tau, crashed_over, ran_within = RECORDED[group]
    score = scores[group]
    assert score.tau >= tau, f"{group}: Kendall tau {score.tau:+.2f} fell below {tau:+.2f}"
    assert score.crashed_over >= crashed_over, (
        f"{group}: {score.crashed_over} crashed rows predicted over"
    )
    assert score.ran_within >= ran_within, (
        f"{group}: {score.ran_within} rows that ran predicted within"
    )
    assert score.ran_within == score.ran  # nothing that ran is predicted out of memory


def test_a_peak_at_pp_1_stays_below_what_the_rank_reserved(outcomes):
    """The playbook's memory is rank 0's max_memory_reserved: its peak allocation cannot be more. At pp = 1
    (rank 0 holds the whole model) each row is predicted below it, and ZeRO-0 within 10% of it (0.92-0.97:
    the fp32 logits beside the loss's softmax and flash attention's views of the whole qkv tensor; before
    them 0.86-0.93). ZeRO-1 reads lower (0.77-0.89): its gather after the step reserves segments of its own."""
    ratios = {
        o.row.line: (o.row.zero_stage, o.predicted.peak_bytes / 2**30 / o.row.reported_gib)
        for o in outcomes
        if o.row.ran and o.row.reported_gib and o.row.pp == 1
    }
    assert len(ratios) == 11
    assert all(ratio <= 1.0 for _, ratio in ratios.values()), ratios
    assert all(ratio >= 0.9 for zero, ratio in ratios.values() if zero == "0"), ratios


MEM_ALLOC = [  # nanotron's benchmark CSV, "Mem Alloc (GB)" in GiB: (model, dp, tp, micro-batch, accumulation, ZeRO, GiB)
    ("playbook-1B", 8, 1, 1, 32, "0", 25.07),
    ("playbook-1B", 256, 1, 1, 1, "0", 25.07),
    ("playbook-1B", 8, 1, 1, 32, "1", 14.76),
    ("playbook-1B", 256, 1, 1, 1, "1", 12.64),
    ("playbook-1B", 1, 8, 16, 16, "0", 3.39),
    ("playbook-1B", 1, 32, 128, 2, "0", 4.79),
    ("playbook-3B", 32, 1, 2, 4, "1", 34.83),
    ("playbook-3B", 16, 16, 16, 1, "1", 3.10),
    ("playbook-3B", 1, 8, 1, 256, "0", 7.63),
]
"""github.com/eyao600/Rapid-LLM, validation_scripts/huggingface_data/bench_final2_mfu2.csv: the CSV nanotron's
scripts/scaling_benchmarks.py reads (line 484 at e24d2483), whose "Mem Res (GB)" is runs.csv's reported memory
and whose "Mem Alloc (GB)" is rank 0's max_memory_allocated since the trainer's reset after the pipeline."""


@pytest.mark.parametrize(
    "model, dp, tp, micro_batch_size, grad_accum, zero_stage, measured", MEM_ALLOC
)
def test_what_nanotron_holds_after_the_pipeline_is_what_the_playbook_measured(
    published_bench, model, dp, tp, micro_batch_size, grad_accum, zero_stage, measured
):
    """ZeRO-0: bf16 parameters, their fp32 copy, accumulator and AdamW state, and DDP's bf16 buckets at dp > 1;
    ZeRO-1: the accumulator whole, the fp32 copy and AdamW 1/dp, and the gather of the stepped parameters; at
    tp > 1 two all-gather buffers of the micro-batch's whole sequence. The plan's own state read 20.0 / 11.9 /
    5.1 GiB on the first rows. Left out: ~0.1 GiB (rotary tables, the batch)."""
    row = published_bench.Row(
        model=model,
        n_gpus=dp * tp,
        dp=dp,
        tp=tp,
        pp=1,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        seq_len=4096,
        zero_stage=zero_stage,
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
    )
    (outcome,) = published_bench.predict([row], "h100-80g")
    assert 0.0 <= measured - outcome.after_pipeline_bytes / 2**30 < 0.15


MEM_ALLOC_PIPELINED = [  # as MEM_ALLOC, pp = 2 and one micro-batch: (model, dp, tp, micro-batch, ZeRO, GiB)
    ("playbook-1B", 32, 1, 8, "0", 18.82),
    ("playbook-1B", 8, 4, 32, "1", 3.82),
    ("playbook-3B", 64, 1, 4, "1", 21.16),
]
"""The same CSV's pipelined rows where the first stage holds more after the pipeline than the plan's peak stage
(the last, its loss): rank 0 writes "Mem Alloc", so the first stage's is the one to compare (the plan's peak
stage's read 11.25 / 2.65 / 16.77 GiB)."""


@pytest.mark.parametrize(
    "model, dp, tp, micro_batch_size, zero_stage, measured", MEM_ALLOC_PIPELINED
)
def test_what_rank_0_holds_after_a_pipeline_is_its_first_stages(
    published_bench, model, dp, tp, micro_batch_size, zero_stage, measured
):
    row = published_bench.Row(
        model=model,
        n_gpus=dp * tp * 2,
        dp=dp,
        tp=tp,
        pp=2,
        micro_batch_size=micro_batch_size,
        grad_accum=1,
        seq_len=4096,
        zero_stage=zero_stage,
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
    )
    (outcome,) = published_bench.predict([row], "h100-80g")
    assert 0.0 <= measured - outcome.after_pipeline_bytes / 2**30 < 0.15


def test_a_pipelined_rows_reported_memory_is_compared_with_rank_0s_stage_not_the_largest(
    published_bench,
):
    """runs.csv line 402 (1B, dp 32 pp 2, eight sequences, ZeRO-1): rank 0 reserved 44.9 GiB. What rank 0
    allocates cannot exceed it, and its stage's prediction does not (0.97 of it); the largest stage, the last
    (the loss), holds more than that (52.1 GiB) and still decides whether the row fits."""
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=64,
        dp=32,
        tp=1,
        pp=2,
        micro_batch_size=8,
        grad_accum=1,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=402,
        reported_gib=44.9,
    )
    (outcome,) = published_bench.predict([row], "h100-80g")
    (ratio,) = published_bench.memory_ratios([outcome]).values()
    assert ratio == outcome.rank0_peak_bytes / 2**30 / 44.9 and 0.95 < ratio <= 1.0
    assert outcome.predicted.peak_bytes / 2**30 > 44.9


ALL_GATHER_ON_P5 = [  # nccl-tests all_gather_perf on p5.48xlarge, nodes of 8 H100: (nodes, MiB, measured algbw GB/s)
    (2, 32, 140.06),
    (2, 2048, 350.49),
    (8, 32, 47.03),
    (8, 2048, 298.37),
    (32, 32, 12.43),
    (32, 512, 146.96),
    (32, 2048, 263.80),
]
"""github.com/crazyguitar/aws-gpu-communication-benchmark, data/nccl_all_gather.csv (the profile's source)."""


@pytest.mark.parametrize("nodes, mib, algbw", ALL_GATHER_ON_P5)
def test_an_all_gather_across_nodes_pays_a_ring_latency_for_every_node(nodes, mib, algbw):
    """A ring passes every node: 32 MiB take 0.23 ms over 2 nodes and 2.6 ms over 32 (the tree's latency
    per doubling of nodes, which all-reduce keeps, read 1.3 ms there)."""
    nbytes = mib * 2**20
    predicted = get_hardware("h100-80g").collective_time_s(
        "all_gather_into_tensor", nbytes, 8 * nodes, in_step=False
    )
    assert 0.7 < predicted / (nbytes / (algbw * 1e9)) < 1.15


NVLINK_ON_H100 = [  # XLA's sm_90 collective table, 8 ranks of one node: (kind, MiB, measured us)
    ("all_gather_into_tensor", 4, 47),
    ("all_gather_into_tensor", 16, 82),
    ("all_gather_into_tensor", 2048, 5343),
    ("reduce_scatter_tensor", 4, 17),
    ("reduce_scatter_tensor", 16, 51),
    ("reduce_scatter_tensor", 256, 714),
    ("all_reduce", 4, 69),
    ("all_reduce", 16, 145),
    ("all_reduce", 2048, 9338),
]
"""github.com/openxla/xla, xla/service/gpu/model/collective_interpolator_data.h at 63ca1b1e (the profile's source)."""


@pytest.mark.parametrize("kind, mib, measured_us", NVLINK_ON_H100)
def test_a_collective_within_a_node_takes_what_nvlink_measured(kind, mib, measured_us):
    """Tensor-parallel exchanges of 4-16 MiB took 1.5-1.9x the 15 us + 360 GB/s the profile had."""
    predicted = get_hardware("h100-80g").collective_time_s(kind, mib * 2**20, 8, in_step=False)
    assert 0.8 < predicted / (measured_us * 1e-6) < 1.2


GEMMS_ON_H100 = [  # XLA's sm_90 matmul table, bf16: (b, m, n, k, measured TFLOP/s)
    (1, 1024, 1024, 1024, 246.7),
    (1, 4096, 2048, 256, 308.9),
    (1, 2048, 2048, 1024, 492.1),
    (1, 4096, 2048, 2048, 722.6),
    (1, 4096, 4096, 4096, 786.0),
]
"""github.com/openxla/xla, xla/service/gpu/model/matmul_interpolator_data.h at b2766086 (the profile's source)."""


@pytest.mark.parametrize("b, m, n, k, measured_tflops", GEMMS_ON_H100)
def test_a_matmul_runs_at_the_rate_cublas_measured_at_its_size(b, m, n, k, measured_tflops):
    """A tensor-parallel slice's GEMM (1e9-1e10 FLOPs) runs at 25-50% of the peak, not the 45-70% the
    generic curve read; a large one at ~80%, in a burst (a step sustains matmul.sustained_share of it)."""
    hw = get_hardware("h100-80g")
    flops = 2 * b * m * n * k
    seconds = (
        hw.compute_time_s(flops, 2 * b * (m * k + k * n + m * n), "bfloat16") - hw.op_overhead_s
    )
    burst = flops / seconds / hw.matmul["bfloat16"].sustained_share
    assert 0.75 < burst / (measured_tflops * 1e12) < 1.3


@pytest.mark.parametrize(
    "model, gpus, micro_batch_size, measured",
    [
        ("playbook-1B", 128, 2, 22794.0),
        ("playbook-1B", 256, 1, 11327.0),
        ("playbook-3B", 128, 2, 10116.0),
        ("playbook-3B", 256, 1, 5518.0),
    ],
)
def test_nanotron_zero1_step_explains_data_parallelism_across_nodes(
    published_bench, model, gpus, micro_batch_size, measured
):
    """ZeRO-1 at tp = pp = 1 (runs.csv, tokens/s/GPU): the plan alone reads 1.4-1.9x the measured
    throughput at 128-256 GPUs; with nanotron's blocking fp32 all-reduce and its gather's copy per rank
    and tensor (dp x tensors kernels at the profile's fixed cost per op) it reads 0.77-0.93x. Regression pins a
    few percent below today's readings, not derived bounds."""
    row = published_bench.Row(
        model=model,
        n_gpus=gpus,
        dp=gpus,
        tp=1,
        pp=1,
        micro_batch_size=micro_batch_size,
        grad_accum=256 // gpus // micro_batch_size,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=measured,
        line=0,
    )
    (plan_only,) = published_bench.predict([row], "h100-80g")
    (nanotron,) = published_bench.predict([row], "h100-80g", nanotron_zero1=True)
    assert plan_only.tokens_per_s_per_gpu / measured > 1.4
    assert 0.75 < nanotron.tokens_per_s_per_gpu / measured < 1.15


@pytest.mark.parametrize(
    "strategy, step",
    [
        # DDP's copy of the syncing micro-batch's bf16 gradients into its buckets, the clipping's norm and scaling of
        # every fp32 gradient, the stepped fp32 parameters copied into the bf16 model (the accumulator's zero_ is the
        # optimizer term's)
        (
            ShardStrategy.REPLICATE,
            (("copy_", 6 * 10**6), ("clip_grad_norm", 12 * 10**6), ("copy_", 8 * 10**6)),
        ),
        # no DDP; every fp32 gradient clipped, the rank's stepped slice copied into the bf16 model, the accumulator
        # zeroed beyond that slice
        (
            ShardStrategy.SHARD_OPTIMIZER,
            (("clip_grad_norm", 12 * 10**6), ("copy_", 2 * 10**6), ("zero_", 6 * 10**6)),
        ),
    ],
)
def test_nanotron_rows_price_nanotrons_kernels_around_its_collectives_not_shardplans(
    published_bench, strategy, step
):
    """A unit of 10^6 parameters under nanotron over 4 ranks, one micro-batch: its bf16 gradient is added into
    the fp32 accumulator (read both, write the sum), one micro-batch too. Its all-reduce averages in NCCL and
    ZeRO-1's copies around its gather are zero1_runtime_s, so none of shardplan's runtime's kernels (the cat
    of a flat gradient, div_, add_ into `.grad`, SHARD_OPTIMIZER's clone and copy_) is priced on top."""
    context = CostContext(hardware=get_hardware("h100-80g"), dp=4, param_dtype="bfloat16")
    sizes = UnitSizes(
        numel=10**6,
        storage_bytes=4 * 10**6,
        param_bytes=2 * 10**6,
        grad_bytes=4 * 10**6,
        optimizer_bytes=8 * 10**6,
    )
    found = published_bench.nanotron_runtime_kernels(sizes, Decision(strategy=strategy), context)
    assert (found.forward, found.backward, found.step) == ((), (("add_", 10 * 10**6),), step)


def test_nanotron_stage_cut_gives_the_lm_head_the_weight_of_layers(published_bench):
    dims = published_bench.MODELS[
        "playbook-1B"
    ]  # a layer weighs 4 h^2 + 3 h i = 2^26, the head V h = 4 layers
    # a block goes to the current stage, which moves on once the running weight passes its share
    assert published_bench.nanotron_stage_starts(dims, 2) == [
        0,
        12,
    ]  # embedding + layers 0-10 | layers 11-15 + head
    assert published_bench.nanotron_stage_starts(dims, 4) == [
        0,
        7,
        12,
        17,
    ]  # the head alone: 4 of 20 layer weights
    # nanotron: [0, 4, 7, 9, 12, 14, 17] and the loss alone on stage 7; here the head (holding the
    # loss) takes stage 7 and layer 15 stage 6
    assert published_bench.nanotron_stage_starts(dims, 8) == [0, 4, 7, 9, 12, 14, 16, 17]


def test_tensor_parallel_rows_are_plans_with_sequence_parallelism(published_bench):
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=16,
        dp=2,
        tp=2,
        pp=4,
        micro_batch_size=1,
        grad_accum=128,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=2,
    )
    (sliced, whole) = published_bench.predict(
        [row, dataclasses.replace(row, n_gpus=8, tp=1)], "h100-80g"
    )
    assert sliced.reason == "" and sliced.predicted is not None
    # each tp rank holds half of every sliced parameter (all but the norms), with its gradient and state
    state = (
        sliced.predicted.memory_bytes["sharded_state"]
        / whole.predicted.memory_bytes["sharded_state"]
    )
    assert 0.5 < state < 0.501
    chain = published_bench.llama_chain(
        published_bench.MODELS["playbook-1B"], 128, 4096, pipelined=True
    )
    plan = published_bench.plan_for(row, chain, published_bench.MODELS["playbook-1B"])
    assert (
        plan.mesh.tp == 2
        and plan.tensor_parallel.sequence_parallel
        and plan.tensor_parallel.vocab_parallel
    )
    assert {m.path: m.style for m in plan.tensor_parallel.sharded}[
        "model.layers.0.self_attn.o_proj"
    ] == "rowwise"
    odd = dataclasses.replace(
        row, model="oldbench-llama-1B"
    )  # a 50257-row vocabulary, padded as nanotron does
    assert (
        published_bench.why_not_expressible(odd) == ""
        and published_bench.as_run(published_bench.MODELS[odd.model], 4).vocab == 50260
    )
    (padded,) = published_bench.predict([odd], "h100-80g")
    assert padded.predicted is not None
    assert (
        published_bench.why_not_expressible(dataclasses.replace(row, tp=64))
        == "tp=64 does not divide the heads and widths of playbook-1B"
    )


@pytest.mark.parametrize(
    "model, gpus, tensor_parallel",
    [
        ("playbook-1B", 8, False),
        ("playbook-8B", 32, False),  # published: the fastest runs use tp = 1
        ("playbook-3B", 256, True),  # published: tp 4 10.3k tokens/s/GPU against 5.5k without
        # tp 2 0.554 s against tp = 1 0.561: the runtime's kernels around its collectives run over 1/tp of the weights
        ("playbook-8B", 256, True),
        ("playbook-3B", 512, True),
        ("playbook-8B", 512, True),  # published: tp wins (256 sequences do not fill 512)
    ],
)
def test_compile_picks_tensor_parallelism_where_the_published_runs_do(
    published_bench, model, gpus, tensor_parallel
):
    """compile's plans as shardplan's runtime runs them: a column-parallel linear keeps its gathered input."""
    chain = published_bench.llama_chain(
        published_bench.MODELS[model],
        1,
        4096,
        pipelined=False,
        code=published_bench.SHARDPLAN_RUNTIME,
    )
    plan = solve(
        chain,
        gpus,
        hardware="h100-80g",
        mixed_precision=BF16_MIXED,
        global_batch_size=256,
        allow_pipeline=False,
    )
    assert (plan.mesh.tp > 1) == tensor_parallel, plan.mesh.describe()
    assert plan.tensor_parallel.sequence_parallel == tensor_parallel
    described = [r.description for r in plan.reasoning.runner_ups]
    assert any("tp=8" in d for d in described)  # the best plan of each tp degree is listed


@pytest.mark.xfail(
    strict=True,
    reason="with units nanotron cannot run (ZeRO-2/3 over all ranks) tp = 1 stays "
    "ahead by 3-5% (0.485 s against 0.508 for 3B, 0.963 against 0.990 for 8B): tp inside a node "
    "leaves each node's data-parallel traffic as it is; among nanotron's plans (ZeRO-0/1, no "
    "recomputation) both take tp > 1 (test_among_the_plans_nanotron_runs_...). torchtitan measured "
    "FSDP alone on Llama 3.1 8B at 128 H100s at 97% of 8 GPUs' tokens/s/GPU; no public FSDP run "
    "with tp > 1 at 128 GPUs was found. Step times: bench_published.py --picks",
)
@pytest.mark.parametrize("model, gpus", [("playbook-3B", 128), ("playbook-8B", 128)])
def test_compile_picks_tensor_parallelism_at_128_gpus(published_bench, model, gpus):
    chain = published_bench.llama_chain(
        published_bench.MODELS[model],
        1,
        4096,
        pipelined=False,
        code=published_bench.SHARDPLAN_RUNTIME,
    )
    plan = solve(
        chain,
        gpus,
        hardware="h100-80g",
        mixed_precision=BF16_MIXED,
        global_batch_size=256,
        allow_pipeline=False,
    )
    assert plan.mesh.tp > 1


def test_one_f_one_b_over_fewer_micro_batches_than_stages_is_a_plan_that_says_so():
    units = tuple(Unit(name=f"h.{i}", modules=(f"h.{i}",), params=(f"h.{i}.w",)) for i in range(4))
    plan = Plan(
        fingerprint="f",
        model="m",
        world_size=4,
        hardware="h100-80g",
        inputs=(),
        mesh=Mesh(dp_shard=1, pp=4),
        schedule=Schedule(num_micro_batches=2, name="1f1b"),
        mixed_precision=MixedPrecision(),
        units=units,
        stages=tuple(Stage(index=i, units=(f"h.{i}",)) for i in range(4)),
        predicted=Predicted(peak_bytes=0, step_time_s=0.0),
        reasoning=Reasoning(budget_bytes=0, binding_constraint=""),
    )
    assert plan.schedule.runs_as(4) == (
        "2 micro-batch(es), 1f1b (fewer micro-batches than the 4 stages: fill-drain on stages 0..2)"
    )
    schedule = [line for line in plan.summary().splitlines() if line.startswith("schedule: ")]
    assert len(schedule) == 1 and "fill-drain on stages 0..2" in schedule[0]
    assert Schedule(num_micro_batches=4, name="1f1b").runs_as(4) == "4 micro-batch(es), 1f1b"
    # stages 0-2 hold both micro-batches (fill-drain), the last one alternates as 1F1B does
    assert [plan.schedule.in_flight(stage, 4) for stage in range(4)] == [2, 2, 2, 1]
    assert [
        Schedule(num_micro_batches=2, name="gpipe").in_flight(stage, 4) for stage in range(4)
    ] == [2] * 4


def test_crashed_rows_within_the_device_are_told_apart_by_what_their_configuration_did(
    published_bench,
):
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=8,
        dp=8,
        tp=1,
        pp=1,
        micro_batch_size=4,
        grad_accum=8,
        seq_len=4096,
        zero_stage="1",
        status="crashed_or_oom",
        tokens_per_s_per_gpu=None,
        line=2,
    )
    within, over = (
        Predicted(peak_bytes=10, step_time_s=1.0),
        Predicted(peak_bytes=1000, step_time_s=1.0),
    )
    ran = dict(status="ok", tokens_per_s_per_gpu=1.0)
    outcomes = [
        published_bench.Outcome(
            row=row, predicted=within
        ),  # ran only at 2 sequences: likely out of memory
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=2, **ran), predicted=within
        ),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=1), predicted=within
        ),  # ran at 2
        published_bench.Outcome(
            row=dataclasses.replace(row, zero_stage="0"), predicted=within
        ),  # never ran
        published_bench.Outcome(row=dataclasses.replace(row, micro_batch_size=8), predicted=over),
    ]  # over: not counted
    assert published_bench.crashed_within(outcomes, usable_bytes=100) == {
        "playbook-1B": {
            "ran only at smaller micro-batches": 1,
            "ran at the same or a larger micro-batch": 1,
            "never ran": 1,
        }
    }


@pytest.mark.parametrize("model, measured", [("playbook-1B", 6907), ("playbook-3B", 4144)])
def test_a_step_of_small_tensor_parallel_micro_batches_is_bound_by_nanotrons_host(
    published_bench, model, measured
):
    """One node, dp 1 x tp 8, 256 micro-batches of one sequence (runs.csv): the GPU's share of a micro-batch
    is a few ms, nanotron's host dispatches 220 ATen calls and 8 Triton launches a layer (counted by running its
    code: benchmarks/count_nanotron_calls.py). Priced by the GPU alone the row reads 1.99-2.56x its measured
    throughput; with the host's floor 1.66-1.72x, pinned on both sides: the counted floor is 2.6 ms a layer where
    the rows took 3.8-4.1, a gap no call count explains (docs/benchmarks.md)."""
    row = published_bench.Row(
        model=model,
        n_gpus=8,
        dp=1,
        tp=8,
        pp=1,
        micro_batch_size=1,
        grad_accum=256,
        seq_len=4096,
        zero_stage="0",
        status="ok",
        tokens_per_s_per_gpu=measured,
        line=0,
    )
    (outcome,) = published_bench.predict([row], get_hardware("h100-80g"))
    device_only = 256 * 4096 / outcome.predicted.step_time_s / 8
    assert device_only / measured > 1.9  # a regression pin below today's 1.99
    assert 1.6 < outcome.tokens_per_s_per_gpu / measured < 1.8


def test_what_the_rows_show_pairs_zero_twins_and_times_a_layer_where_its_pipeline_runs(
    published_bench,
):
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=16,
        dp=2,
        tp=4,
        pp=2,
        micro_batch_size=1,
        grad_accum=128,
        seq_len=4096,
        zero_stage="0",
        status="ok",
        tokens_per_s_per_gpu=10000.0,
        line=2,
    )
    twin = dataclasses.replace(row, zero_stage="1", tokens_per_s_per_gpu=4000.0, line=3)
    lone = dataclasses.replace(row, grad_accum=64, dp=4, n_gpus=32, line=4)
    assert published_bench.twin_ratios([row, twin, lone]) == [2.5]
    # one sequence of 4096 tokens over 128 + 1 micro-batches; the busiest stage holds 11 layers' weight
    per_layer_ms = (
        1e3 * 128 * 4096 * 2 / 10000.0 / 16 / 129 / published_bench.busiest_stage_layers(row)
    )
    single_node = dataclasses.replace(row, n_gpus=8, dp=1)
    found = published_bench.layer_ms([row, single_node])
    assert found[("playbook-1B", "pp > 1, across nodes", 4)] == pytest.approx(per_layer_ms)
    assert set(found) == {
        ("playbook-1B", "pp > 1, across nodes", 4),
        ("playbook-1B", "pp > 1, one node", 4),
    }
    slow = dataclasses.replace(
        row, tokens_per_s_per_gpu=10.0
    )  # seconds a micro-batch: the slow mode
    assert published_bench.layer_ms([slow]) == {}


@pytest.mark.parametrize(
    "dp, tp, pp, micro_batch_size, grad_accum, allocated_mib",
    [
        (16, 1, 1, 1, 64, 15785.37),
        (16, 1, 1, 4, 16, 42900.39),  # tp 1: o_proj's input copy from 2 sequences on
        (4, 4, 1, 16, 16, 47549.27),
        (1, 2, 8, 8, 128, 45800.36),
        (1, 8, 2, 32, 32, 61477.19),  # + gathered inputs
    ],
)
def test_oldbench_peak_allocated_is_what_its_nanotron_keeps(
    published_bench, dp, tp, pp, micro_batch_size, grad_accum, allocated_mib
):
    """old_bench logged the step's peak allocated memory (runs.csv lines 14-30, oldbench-llama-1B, ZeRO-1):
    with its code's column-parallel linears keeping the all-gathered input and o_proj keeping a copy of its
    transposed input, the prediction is within 2% on each; without them it read 0.56-0.96 of it (one sequence
    a micro-batch at tp 1 was within 2% before too: no copy, no gather)."""
    row = published_bench.Row(
        model="oldbench-llama-1B",
        n_gpus=dp * tp * pp,
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=micro_batch_size,
        grad_accum=grad_accum,
        seq_len=4096,
        zero_stage="1",
        status="completed",
        tokens_per_s_per_gpu=1.0,
        line=0,
        allocated_gib=allocated_mib / 1024,
    )
    (outcome,) = published_bench.predict([row], get_hardware("h100-80g"))
    assert outcome.predicted.peak_bytes / 2**20 == pytest.approx(allocated_mib, rel=0.02)
    assert published_bench.allocated_ratios([outcome]) == {tp: [pytest.approx(1, rel=0.02)]}


def test_crashed_rows_are_split_by_what_nanotrons_own_csv_says_of_them(published_bench, tmp_path):
    nanotron_csv = tmp_path / "published_bench.csv"
    nanotron_csv.write_text(
        "hidden_size,dp,tp,pp,mbs,batch_accum,zero_stage,status\n"
        "2048,8,1,1,4,8.0,1,OOM\n2048,8,1,1,4,8.0,1,Other\n"  # two attempts, one out of memory
        "2048,8,1,1,2,16.0,1,Other\n3072,8,1,1,4,8.0,1,Success\n"
    )
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=8,
        dp=8,
        tp=1,
        pp=1,
        micro_batch_size=4,
        grad_accum=8,
        seq_len=4096,
        zero_stage="1",
        status="crashed_or_oom",
        tokens_per_s_per_gpu=None,
        line=2,
    )
    within, over = (
        Predicted(peak_bytes=10, step_time_s=1.0),
        Predicted(peak_bytes=1000, step_time_s=1.0),
    )
    outcomes = [
        published_bench.Outcome(row=row, predicted=over),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=2, grad_accum=16), predicted=within
        ),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=1, grad_accum=32), predicted=within
        ),
        published_bench.Outcome(row=dataclasses.replace(row, status="ok"), predicted=within),
    ]  # ran: not counted
    statuses = published_bench.nanotron_statuses(str(nanotron_csv))
    assert statuses[("playbook-3B", 8, 1, 1, 4, 8, "1")] == {"Success"}
    assert published_bench.crashed_by_nanotron_status(outcomes, 100, statuses) == {
        ("playbook-1B", "OOM"): (1, 1),
        ("playbook-1B", "other failure"): (0, 1),
        ("playbook-1B", "not in the CSV"): (0, 1),
    }


def test_reservation_is_split_by_how_fast_each_row_ran_against_its_group(published_bench):
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=16,
        dp=2,
        tp=8,
        pp=1,
        micro_batch_size=16,
        grad_accum=8,
        seq_len=4096,
        zero_stage="0",
        status="ok",
        tokens_per_s_per_gpu=20000.0,
        line=2,
        reported_gib=40.0,
    )
    predicted = Predicted(peak_bytes=25 * 2**30, step_time_s=1.0)
    outcomes = [
        published_bench.Outcome(row=row, predicted=predicted),  # the group's best: fast, 40 / 25
        published_bench.Outcome(
            row=dataclasses.replace(row, dp=4, tokens_per_s_per_gpu=8000.0, reported_gib=26.0),
            predicted=predicted,
        ),  # 0.4 of the best: slow
        published_bench.Outcome(
            row=dataclasses.replace(row, dp=8, tokens_per_s_per_gpu=14000.0), predicted=predicted
        ),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=8), predicted=predicted
        ),  # alone
        published_bench.Outcome(row=dataclasses.replace(row, pp=2, dp=1), predicted=predicted),
    ]  # pipelined
    assert published_bench.reservation_by_speed(outcomes) == {"fast": [1.6], "slow": [1.04]}


@pytest.mark.parametrize("fabric", ["", "playbook"])
@pytest.mark.parametrize(
    "model, gpus, tensor_parallel",
    [
        ("playbook-1B", 8, False),
        ("playbook-3B", 32, False),  # published: tp = 1 fastest
        (
            "playbook-3B",
            128,
            True,
        ),  # tp 2 0.576 s against tp = 1 0.578; on the playbook's fabric 0.645 against 0.742
        (
            "playbook-8B",
            128,
            True,
        ),  # no tp = 1 plan fits: ZeRO-1 without recomputation needs 89.9 GiB a rank
        ("playbook-3B", 256, True),
        ("playbook-8B", 256, True),  # tp 4 ahead of tp = 1: 3B 8-13%, 8B 14-43%
        ("playbook-3B", 512, True),
    ],
)
def test_among_the_plans_nanotron_runs_compile_picks_tensor_parallelism_where_its_runs_did(
    published_bench, model, gpus, tensor_parallel, fabric
):
    """On the default profile (a tuned p5 cluster's fabric) and on the fabric the runs' own cluster measured by
    node count (PLAYBOOK_FABRIC_GBPS: its all-reduce across 16 nodes at a quarter of the p5's), with the kernels
    nanotron runs. Step times: bench_published.py --picks --nanotron-space [--fabric playbook]"""
    chain = published_bench.llama_chain(published_bench.MODELS[model], 1, 4096, pipelined=False)
    cluster = get_hardware("h100-80g")
    cluster = (
        published_bench.with_fabric(
            cluster, published_bench.FABRICS[fabric], f"the {fabric} fabric"
        )
        if fabric
        else cluster
    )
    plan = solve(
        chain,
        gpus,
        hardware=cluster,
        mixed_precision=BF16_MIXED,
        global_batch_size=256,
        allow_pipeline=False,
        **published_bench.nanotron_options(chain),
    )
    assert (plan.mesh.tp > 1) == tensor_parallel, plan.mesh.describe()
    assert {u.strategy for u in plan.units} <= set(
        published_bench.ZERO_STAGES.values()
    ) and plan.mesh.dp_replicate == 1
    assert {u.checkpoint.value for u in plan.units} == {"none"}


@pytest.mark.parametrize(
    "kind, nodes, published",
    [
        ("all_reduce", 64, 32.9),
        ("all_reduce", 4, 160.1),
        ("all_gather_into_tensor", 64, 11.0),
        ("reduce_scatter_tensor", 32, 27.9),
    ],
)
def test_the_playbook_fabric_reproduces_the_bandwidth_its_cluster_measured_by_nodes(
    published_bench, kind, nodes, published
):
    """bench_published --fabric playbook: a 1 GiB world collective over nodes of 8 H100 reaches the busbw the
    playbook's figure gives its cluster (h100-80g alone reads 288 GB/s for the 64-node all-reduce); within one node,
    and on h100-80g without the flag, nothing changes."""
    plain = get_hardware("h100-80g")
    fabric = published_bench.with_fabric(
        plain, published_bench.PLAYBOOK_FABRIC_GBPS, "the playbook fabric"
    )
    seconds = fabric.collective_time_s(kind, 2**30, 8 * nodes, in_step=False)
    assert 2**30 * ring_factor(kind, 8 * nodes) / seconds / 1e9 == pytest.approx(
        published, rel=0.02
    )
    assert fabric.collective_time_s(kind, 2**30, 8) == plain.collective_time_s(kind, 2**30, 8)


def test_a_row_on_its_jobs_fabric_is_priced_at_the_bandwidth_that_job_measured(
    published_bench, tmp_path
):
    """bench_published --fabric job: nanotron's CSV logs each job's start-up busbw over its world; the row takes the
    successful job of its configuration whose throughput is its own (two attempts here, one at 20 GB/s), and its
    1 GiB world all-reduce then reaches that job's 150 GB/s. A row on one node, or with no job of its throughput,
    keeps the profile."""
    nanotron_csv = tmp_path / "published_bench.csv"
    columns = (
        "job_id,hidden_size,dp,tp,pp,mbs,batch_accum,zero_stage,status,tok/s/gpu,AllReduce (GB/s),"
        "AllGather (GB/s),ReduceScatter (GB/s)\n"
    )
    nanotron_csv.write_text(
        columns + "1,2048,32,1,1,1,8.0,1,Success,5000.0,20.0,10.0,10.0\n"
        "2,2048,32,1,1,1,8.0,1,Success,9000.0,150.0,80.0,75.0\n"
        "3,2048,8,1,1,1,32.0,1,Success,9000.0,400.0,240.0,240.0\n"
    )
    jobs = published_bench.nanotron_jobs(str(nanotron_csv))
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=32,
        dp=32,
        tp=1,
        pp=1,
        micro_batch_size=1,
        grad_accum=8,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=9000.0,
        line=2,
    )
    plain = get_hardware("h100-80g")
    fabric = published_bench.job_fabric(plain, row, jobs)
    seconds = fabric.collective_time_s("all_reduce", 2**30, 32, in_step=False)
    assert 2**30 * ring_factor("all_reduce", 32) / seconds / 1e9 == pytest.approx(150.0, rel=0.01)
    assert fabric.name == "h100-80g with job 2's fabric"
    one_node = dataclasses.replace(row, n_gpus=8, dp=8, grad_accum=32)
    assert published_bench.job_fabric(plain, one_node, jobs) is plain
    assert (
        published_bench.job_fabric(
            plain, dataclasses.replace(row, tokens_per_s_per_gpu=7000.0), jobs
        )
        is plain
    )


@pytest.mark.parametrize(
    "flags", [["--fabric", "job", "--breakdown"], ["--job-pp-code", "--picks"]]
)
def test_the_options_pricing_each_rows_job_refuse_the_modes_that_price_no_row(tmp_path, flags):
    """--picks and --breakdown read no row's job: given with --fabric job or --job-pp-code they say so, in one line,
    rather than print what the flag would not have changed."""
    import subprocess
    import sys

    (tmp_path / "published_bench.csv").write_text(
        "job_id,hidden_size,dp,tp,pp,mbs,batch_accum,zero_stage,status\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(HERE, "..", "benchmarks", "bench_published.py"),
            *flags,
            "--nanotron-csv",
            str(tmp_path / "published_bench.csv"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (
        done.returncode == 2 and "not with --picks or --breakdown" in done.stderr.splitlines()[-1]
    ), done.stderr


def test_nanotrons_pre_fix_pipeline_polls_twice_a_tensor_each_way_on_each_side_of_a_boundary(
    published_bench,
):
    """NanotronCode.polls_p2p (nanotron 67c5ebb6, p2p.py): every metadata message is polled with a 0.1 s sleep, two
    a tensor, on the sender and on the receiver. Between decoder layers the hidden states and the mask cross
    forward and the hidden states' gradient back: 6 waits each side, 12 on a stage between two such boundaries;
    into the final norm (or the head, the cast, the loss) one tensor and its gradient: 4."""
    one_b = published_bench.MODELS["playbook-1B"]
    assert published_bench.polled_waits(one_b, 2) == [6, 6]
    assert published_bench.polled_waits(one_b, 4) == [
        6,
        12,
        10,
        4,
    ]  # layers 0-5 | 6-10 | 11-15 | norm, head, cast, loss
    assert published_bench.polled_waits(one_b, 8) == [
        6,
        12,
        12,
        12,
        12,
        10,
        8,
        4,
    ]  # the head's stage sends the logits on
    small = published_bench.LlamaDims(
        layers=4, hidden=64, heads=4, kv_heads=4, intermediate=256, vocab=16, tied=True
    )
    assert published_bench.polled_waits(small, 3) == [6, 12, 6]  # layers 0-1 | 2 | 3 and the head
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=32,
        dp=8,
        tp=1,
        pp=4,
        micro_batch_size=1,
        grad_accum=8,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=2,
    )
    assert published_bench.p2p_polling_s(row, one_b) == pytest.approx((8 + 4 - 1) * 12 * 0.1)


def test_a_pipelined_row_whose_job_ran_the_pre_fix_pp_code_pays_its_polling(
    published_bench, tmp_path
):
    """bench_published --job-pp-code: the row's own job (the successful one of its configuration at its throughput)
    says after_pp_fix False, so its step pays the busiest stage's 12 polled waits a micro-batch at 0.1 s over
    (8 + 4 - 1) micro-batches; the row whose job ran after the fix, a row no job measured, a pp = 1 row and a
    prediction without the CSV pay nothing."""
    nanotron_csv = tmp_path / "published_bench.csv"
    nanotron_csv.write_text(
        "job_id,hidden_size,dp,tp,pp,mbs,batch_accum,zero_stage,status,tok/s/gpu,after_pp_fix\n"
        "13849000,2048,8,1,4,1,8.0,1,Success,5000.0,False\n"
        "14099000,2048,8,1,4,1,8.0,1,Success,9000.0,True\n"
        "13849001,2048,32,1,1,1,8.0,1,Success,9000.0,False\n"
    )
    jobs = published_bench.nanotron_jobs(str(nanotron_csv))
    pre_fix = published_bench.Row(
        model="playbook-1B",
        n_gpus=32,
        dp=8,
        tp=1,
        pp=4,
        micro_batch_size=1,
        grad_accum=8,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=5000.0,
        line=2,
    )
    rows = [
        pre_fix,
        dataclasses.replace(pre_fix, tokens_per_s_per_gpu=9000.0),  # after the fix
        dataclasses.replace(pre_fix, tokens_per_s_per_gpu=7000.0),  # no job of this throughput
        dataclasses.replace(pre_fix, dp=32, pp=1, tokens_per_s_per_gpu=9000.0),
    ]  # not pipelined

    def steps(**jobs_for) -> list[float]:
        return [
            published_bench.step_s(
                dataclasses.replace(o.row, tokens_per_s_per_gpu=o.tokens_per_s_per_gpu)
            )
            for o in published_bench.predict(rows, "h100-80g", **jobs_for)
        ]

    plain, polled = steps(), steps(pp_code_jobs=jobs)
    assert polled[0] - plain[0] == pytest.approx((8 + 4 - 1) * 12 * 0.1)
    assert polled[1:] == plain[1:]
    assert published_bench.nanotron_code(pre_fix, published_bench.row_job(pre_fix, jobs)).polls_p2p
    assert not published_bench.nanotron_code(pre_fix).polls_p2p


@pytest.mark.parametrize(
    "n_gpus, dp, tp, pp, communicators",
    [
        (8, 8, 1, 1, 3),  # the default group, world_pg, and the node's 8 ranks, which are dp_pg too
        (16, 2, 8, 1, 4),  # + dp_pg (ranks 0, 8); tp_pg and mp_pg are the node's ranks
        (
            8,
            4,
            1,
            2,
            6,
        ),  # + dp_pg 0-3, mp_pg (0, 4), the tied embedding's pair (the same ranks), the send's pair
        (16, 4, 1, 4, 7),  # mp_pg 0, 4, 8, 12 and the tied pair (0, 12) apart
        (
            64,
            2,
            4,
            8,
            8,
        ),  # tp_pg 0-3, dp_pg (0, 4), mp_pg of 32 ranks, the tied pair (0, 56), the send's pair
    ],
)
def test_a_rank_holds_a_communicator_for_each_distinct_group_nanotron_runs_a_collective_on(
    published_bench, n_gpus, dp, tp, pp, communicators
):
    row = published_bench.Row(
        model="playbook-3B",
        n_gpus=n_gpus,
        dp=dp,
        tp=tp,
        pp=pp,
        micro_batch_size=1,
        grad_accum=1,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
    )
    assert published_bench.nanotron_communicators(row) == communicators


def test_rows_that_ran_bound_what_the_communicators_hold_and_crashed_rows_within_say_how_far_below(
    published_bench,
):
    row = published_bench.Row(
        model="playbook-3B",
        n_gpus=16,
        dp=4,
        tp=1,
        pp=4,
        micro_batch_size=4,
        grad_accum=16,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
        reported_gib=76.9,
    )
    predicted = Predicted(peak_bytes=74 * 2**30, step_time_s=1.0)
    crashed = dict(status="crashed_or_oom", tokens_per_s_per_gpu=None, reported_gib=None)
    outcomes = [
        published_bench.Outcome(row=row, predicted=predicted),
        published_bench.Outcome(
            row=dataclasses.replace(row, reported_gib=70.0), predicted=predicted
        ),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=8, **crashed),
            predicted=Predicted(peak_bytes=68 * 2**30, step_time_s=1.0),
        ),
        published_bench.Outcome(
            row=dataclasses.replace(row, micro_batch_size=16, **crashed),
            predicted=Predicted(peak_bytes=90 * 2**30, step_time_s=1.0),
        ),  # over: not counted
        published_bench.Outcome(
            row=dataclasses.replace(row, pp=1, dp=16, reported_gib=60.0), predicted=predicted
        ),
    ]
    assert published_bench.communicator_bound(outcomes, usable_bytes=74 * 2**30) == {
        4: published_bench.CommunicatorBound(
            ran=1, most_reserved_bytes=60 * 2**30, short_bytes=()
        ),  # node 0-7, dp 0-15
        7: published_bench.CommunicatorBound(
            ran=2, most_reserved_bytes=round(76.9 * 2**30), short_bytes=(6 * 2**30,)
        ),
    }
    statuses = {
        published_bench.configuration_key(dataclasses.replace(row, micro_batch_size=8)): {"Other"}
    }
    assert (
        published_bench.communicator_bound(outcomes, 74 * 2**30, statuses)[7].short_bytes == ()
    )  # not out of memory


def test_what_nanotron_holds_is_checked_on_every_stage_not_only_the_plans_peak(published_bench):
    """ZeRO-0 at dp 2 and one micro-batch: the plan holds 16 bytes a parameter, nanotron 20. The plan's peak is
    the stage of more activations (56 GiB against 54), nanotron's the stage of more parameters (62.5 against 60)."""
    row = published_bench.Row(
        model="playbook-3B",
        n_gpus=4,
        dp=2,
        tp=1,
        pp=2,
        micro_batch_size=1,
        grad_accum=1,
        seq_len=4096,
        zero_stage="0",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
    )
    gib = 2**30
    stages = (
        StepCost(
            peak_bytes=56 * gib,
            step_time_s=1.0,
            memory_bytes={"sharded_state": 16 * gib, "activations": 40 * gib},
        ),
        StepCost(
            peak_bytes=54 * gib,
            step_time_s=1.0,
            memory_bytes={"sharded_state": 34 * gib, "activations": 20 * gib},
        ),
    )
    plan = Predicted(
        peak_bytes=56 * gib, step_time_s=1.0, memory_bytes=dict(stages[0].memory_bytes)
    )
    held = published_bench.as_nanotron_holds(plan, stages, row, published_bench.MODELS[row.model])
    assert held.peak_bytes == 62.5 * gib
    assert held.memory_bytes["sharded_state"] == 42.5 * gib


def test_evaluate_stages_gives_every_stages_own_cost(published_bench):
    row = published_bench.Row(
        model="playbook-3B",
        n_gpus=16,
        dp=4,
        tp=1,
        pp=4,
        micro_batch_size=4,
        grad_accum=16,
        seq_len=4096,
        zero_stage="1",
        status="ok",
        tokens_per_s_per_gpu=1.0,
        line=0,
    )
    dims = published_bench.MODELS[row.model]
    chain = published_bench.llama_chain(dims, 64, 4096, pipelined=True, sequence_sharded_norm=True)
    plan = published_bench.plan_for(row, chain, dims)
    predicted, stages = evaluate_stages(chain, plan, "h100-80g")
    assert len(stages) == 4 and predicted.peak_bytes == max(stage.peak_bytes for stage in stages)
    # 1F1B: stage s holds pp - s micro-batches of its layers (8 on the first three stages, 4 and the head on the
    # last; a layer 1.94 GiB a micro-batch), as nanotron's engine does (pp - rank - 1 warm-up forwards, then one
    # forward and one backward)
    assert [round(stage.memory_bytes["activations"] / 2**30, 2) for stage in stages] == [
        62.0,
        46.5,
        31.0,
        7.75,
    ]
