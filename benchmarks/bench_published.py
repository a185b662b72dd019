"""The GPU cost model against published H100 training runs (nanotron, Ultra-Scale Playbook).

    .venv/bin/python benchmarks/bench_published.py                   # ../shared/data/published-h100/runs.csv
    .venv/bin/python benchmarks/bench_published.py --data runs.csv --hardware h100-80g
    .venv/bin/python benchmarks/bench_published.py --nanotron-zero1   # + nanotron's own ZeRO-1 step
    .venv/bin/python benchmarks/bench_published.py --fabric playbook  # + the playbook cluster's fabric by nodes
    .venv/bin/python benchmarks/bench_published.py --fabric job --nanotron-csv bench_final2_mfu2.csv  # each job's own
    .venv/bin/python benchmarks/bench_published.py --job-pp-code --nanotron-csv bench_final2_mfu2.csv  # + its PP code
    .venv/bin/python benchmarks/bench_published.py --picks            # what compile picks on the published shapes
    .venv/bin/python benchmarks/bench_published.py --picks --nanotron-space  # and among the plans nanotron runs
    .venv/bin/python benchmarks/bench_published.py --breakdown        # a layer's op kinds as priced, one node's rows
    .venv/bin/python benchmarks/bench_published.py --captured-attention  # a captured layer's attention, and built
    .venv/bin/python benchmarks/bench_published.py --nanotron-csv bench_final2_mfu2.csv  # crashes by its status

Every row of the data set becomes a shardplan plan as nanotron ran it: one unit per block
(the embedding, each decoder layer, the final norm with the LM head and the loss), ZeRO-0 as
REPLICATE and ZeRO-1 as SHARD_OPTIMIZER, 1F1B over the gradient-accumulation micro-batches,
parameters in bf16 and gradients reduced in fp32, no recomputation, stages cut as nanotron cuts
them, and tp > 1 as nanotron's TP in REDUCE_SCATTER mode (sequence parallel, vocab-parallel embedding
and head: llama_chain's TensorParallelFacts). `compile.evaluate_stages` predicts each plan's step time, with
nanotron's kernels around its collectives in place of shardplan's runtime's (nanotron_runtime_kernels), and
peak memory of each stage on the profile; the step is then bounded below by what nanotron's host dispatches
(nanotron_host_s) and the memory swapped for what nanotron holds on every stage (as_nanotron_holds; what the older code
of old_bench keeps beyond it: NanotronCode; with --job-pp-code a pipelined row whose job ran nanotron's pre-fix PP
code also pays its polling, NanotronCode.polls_p2p). Printed per model and GPU count: Kendall tau of predicted
against measured tokens/s/GPU over the rows that ran, predicted / measured throughput (median, p10, p90),
and the memory classification (the share of crashed rows predicted over the device's usable memory, the
share of rows that ran predicted within it, both on the largest stage); then the memory against what the rows
measured (the playbook's: rank 0's, on the first stage), the NCCL communicators a rank holds against what the
rows that ran left of the device (communicator_bound) and the rows that cannot be expressed, each with its
reason.

The LLaMA chains are built by hand from the model dimensions (model_configs.md of the data set):
no torch, no capture, so the whole data set is evaluated in seconds.
"""

import argparse
import csv
import dataclasses
import functools
import math
import os
import statistics
from collections import defaultdict
from typing import Any

import numpy as np
from scipy.stats import kendalltau

from shardplan.compile import evaluate_stages, solve
from shardplan.costmodel.cost import (
    OPTIMIZER_STATE_BYTES_PER_PARAM,
    CostContext,
    RuntimeKernels,
    StepCost,
    UnitSizes,
    kind_time_s,
    on_rank,
    unpriced_dispatches,
)
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.frontend.chain import Block, BlockChain, InputSpec, OpKind, TensorParallelFacts
from shardplan.plan import (
    BF16_MIXED,
    Checkpoint,
    Decision,
    Mesh,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardStrategy,
    Stage,
    Unit,
)
from shardplan.solver.assemble import tensor_parallel_section
from shardplan.solver.search import Configuration
from shardplan.solver.space import default_space

DEFAULT_DATA = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "shared",
    "data",
    "published-h100",
    "runs.csv",
)
"""`<repo>/../shared/data/published-h100/runs.csv`: the shared data set beside the checkout."""
ZERO_STAGES = {"0": ShardStrategy.REPLICATE, "1": ShardStrategy.SHARD_OPTIMIZER}
"""nanotron shards at most the optimizer state (ZeRO-1): its parameters stay whole on every rank."""
RAN = ("ok", "completed", "completed_but_only_1_iteration_logged")
CRASHED = ("crashed_or_oom", "oom", "oom (inferred")
"""Statuses that count as a crash (status prefixes); timeouts and other failures are neither."""
BF16_BYTES, FP32_BYTES = 2, 4


PLAYBOOK_FABRIC_GBPS = {
    "all_reduce": {2: 361.7, 4: 160.1, 8: 99.6, 16: 84.7, 32: 64.9, 64: 32.9},
    "all_gather_into_tensor": {2: 184.6, 4: 119.0, 8: 69.0, 16: 55.0, 32: 28.0, 64: 11.0},
    "reduce_scatter_tensor": {2: 181.6, 4: 115.8, 8: 68.6, 16: 54.5, 32: 27.9, 64: 11.1},
}
"""Bus bandwidth (GB/s) of a world collective by nodes of 8 H100 on the cluster that ran the playbook's rows: the
medians of the Ultra-Scale Playbook's figure "Communication Bandwidth by Number of Nodes" (its Space,
assets/data/benchmarks/pp_comm_bandwidth.html; 436.0 / 249.9 / 249.7 within one node). nanotron's benchmark
trainer (branch nouamane/bench2, trainer.py `measure_bandwidth`) measured them at each job's start: over the world
group, 5 warm-ups then 10 calls of 1 GiB (torch.ones(256 Mi) in fp32; the title's "256MB" counts elements) between
barriers, busbw = bytes x 2 (n - 1) / n (all-reduce) or (n - 1) / n over the time; all-gather and reduce-scatter
through torch's list APIs (dist.all_gather, dist.reduce_scatter), which copy the buffer once beside the collective
(1 GiB copied in one kernel a rank of the group, ~0.7 ms and a launch each: 13% of the 2-node all-gather's
time, 5% at 8 nodes, ~3% at 64). The spread is wide (at 64 nodes the all-reduce's 5th-95th percentile is
12.5-177 GB/s). The model's all-gather and reduce-scatter are priced
with the list APIs' figures: nanotron's ZeRO-1 gathers its parameters with the list API, its tensor parallelism
over nodes (tp 16, 32) uses the tensor ones, and one kind cannot tell them apart; the copy is the difference."""
P5_FABRIC_GBPS = {
    "all_reduce": {2: 435.14, 4: 280.30, 8: 274.47, 16: 269.23, 32: 220.08},
    "all_gather_into_tensor": {2: 322.00, 4: 288.53, 8: 224.47, 16: 261.88, 32: 222.40},
    "reduce_scatter_tensor": {2: 322.00, 4: 288.53, 8: 224.47, 16: 261.88, 32: 222.40},
}
"""Bus bandwidth (GB/s) of 1 GiB world collectives by nodes of 8 H100 on a tuned AWS p5 cluster (p5.48xlarge,
SageMaker HyperPod, nccl-tests with NCCL_TUNER_PLUGIN=ofi): github.com/crazyguitar/aws-gpu-communication-benchmark
at fd167f9, data/nccl_all_reduce.csv and data/nccl_all_gather.csv, out-of-place busbw at 1024 MB. No
reduce-scatter was measured: it takes all-gather's (both only rings in NCCL, the same bus bytes). The same source
as h100-80g's inter-node bandwidth, which it does not carry (docs/benchmarks.md: it lowers tau a little)."""
FABRICS = {"playbook": PLAYBOOK_FABRIC_GBPS, "p5": P5_FABRIC_GBPS}
GPUS_PER_NODE = 8


def with_fabric(
    hw: HardwareProfile, measured_gbps: dict[str, dict[int, float]], name: str
) -> HardwareProfile:
    """`hw` with its inter-node links' bandwidth by nodes derived from a fabric's measured busbw in GB/s, by kind
    and node count: 1 GiB world collectives over nodes of 8 GPUs, as measure_bandwidth took them
    (PLAYBOOK_FABRIC_GBPS; LinkProfile.with_fabric)."""
    measured = {
        kind: {nodes: gbps * 1e9 for nodes, gbps in by_nodes.items()}
        for kind, by_nodes in measured_gbps.items()
    }
    return dataclasses.replace(
        hw,
        name=f"{hw.name} with {name}",
        inter_node=hw.inter_node.with_fabric(measured, nbytes=2**30, ranks_per_node=GPUS_PER_NODE),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LlamaDims:
    """A LLaMA-style decoder as nanotron builds it (model_configs.md of the data set)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    """The LM head reads the embedding's weight (tie_word_embeddings)."""


MODELS = {
    "playbook-1B": LlamaDims(
        layers=16, hidden=2048, heads=32, kv_heads=32, intermediate=8192, vocab=131072, tied=True
    ),
    "playbook-3B": LlamaDims(
        layers=28, hidden=3072, heads=32, kv_heads=32, intermediate=8192, vocab=131072, tied=True
    ),
    "playbook-8B": LlamaDims(
        layers=32, hidden=4096, heads=32, kv_heads=32, intermediate=14336, vocab=131072, tied=False
    ),
    "playbook-80B": LlamaDims(
        layers=80, hidden=8192, heads=64, kv_heads=64, intermediate=28672, vocab=131072, tied=False
    ),
    "oldbench-llama-1B": LlamaDims(
        layers=24, hidden=2048, heads=32, kv_heads=32, intermediate=4096, vocab=50257, tied=True
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NanotronCode:
    """What the nanotron a row ran does beyond the plan: what it keeps for backward beyond llama_chain's
    activations, and how its pipeline waits for a message. The playbook (December 2024,
    tp_linear_async_communication on, tp_recompute_allgather true) keeps neither; oldbench (nanotron main of
    early July 2024, f1adf520, async communication off: model_configs.md) keeps both. Only a pipelined playbook
    job that nanotron's CSV marks as run before its PP fix polls (nanotron_code)."""

    saves_gathered_input: bool = False
    """In REDUCE_SCATTER mode without async communication a column-parallel linear all-gathers its
    sequence-sharded input with `differentiable_all_gather` and calls F.linear on the result, which autograd
    saves: the whole T x h input of qkv_proj, gate_up_proj and the LM head on every tp rank
    (tensor_parallel/functional.py `column_linear`, lines 352-359 at f1adf520). Recomputing the gather in
    backward (tp_recompute_allgather) came on 2024-07-17 (1e02a9ce)."""
    o_proj_input_copy: bool = False
    """o_proj's input is the attention output viewed [seq, batch, heads x d] by a transpose (models/llama.py,
    CausalSelfAttention.forward), which is not contiguous once a micro-batch holds more than one sequence.
    F.linear without bias runs at::matmul, which folds a 3-D input into 2-D with reshape, a copy here, and
    the mm it records saves that copy for the weight's gradient: a second copy of the attention output
    beside the one flash attention saves. The non-async row_linear calls F.linear under autograd
    (functional.py lines 463-483 at f1adf520); the async one (the playbook's) calls it inside its own
    autograd.Function, which saves the view."""
    polls_p2p: bool = False
    """Each tensor a stage sends or receives goes with two metadata messages, each posted with isend or irecv and
    then waited for on the host by `while not work.is_completed(): ... time.sleep(0.1)` (nanotron's branch
    nouamane/bench2 at 67c5ebb6, "pp", 2024-12-27: pipeline_parallel/p2p.py, `_send_meta` lines 286-301 and
    322-337, `_recv_meta` lines 359-376 and 400-414; the only commit of any branch that changes p2p.py since
    April 2024). A NCCL work is completed once its kernel has run (ProcessGroupNCCL's isCompleted queries the
    work's end event), which a message posted to a peer microseconds earlier has not: each wait sleeps at least
    once, while the GPU waits for the host (the metadata goes in through a copy from pageable host memory,
    which synchronizes the stream, and comes out through .tolist()). P2P_POLL_SLEEP_S a polled wait, polled_waits
    a stage's."""


SHARDPLAN_RUNTIME = NanotronCode(saves_gathered_input=True)
"""What shardplan's runtime does under sequence parallelism: a column-parallel linear keeps its gathered input for
backward (chain.TensorParallelFacts) rather than gathering it again. The chain compile's own plans run on
(print_tensor_parallel_picks); nanotron's plans keep only the shard."""


def nanotron_code(row: "Row", job: dict[str, str] | None = None) -> NanotronCode:
    """The code of `row`'s campaign; with `job` (row_job), the pipeline code that job ran: nanotron's CSV says
    after_pp_fix False for every job id below 14097150, the threshold below which its benchmark script re-runs a
    pp > 1 configuration (scripts/scaling_benchmarks.py lines 512-519 at e24d2483). That those jobs ran
    67c5ebb6's p2p is inferred, not logged: it is the one PP code of the campaign's branch before the fix."""
    if row.model.startswith("oldbench-"):
        return NanotronCode(saves_gathered_input=True, o_proj_input_copy=row.micro_batch_size > 1)
    return NanotronCode(
        polls_p2p=row.pp > 1 and job is not None and job.get("after_pp_fix") == "False"
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One configuration of the data set, as far as the cost model reads it."""

    model: str
    n_gpus: int
    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    grad_accum: int
    seq_len: int
    zero_stage: str
    status: str
    tokens_per_s_per_gpu: float | None
    line: int
    """Line in the CSV file (the header is line 1)."""
    reported_gib: float | None = None
    """The playbook's memory of the row: rank 0's torch.cuda.max_memory_reserved() in GiB (the "Mem Res"
    column of nanotron's benchmark CSV, helpers.py lines 610 and 674 at e24d2483), which holds what the
    caching allocator reserved, used or not."""
    allocated_gib: float | None = None
    """old_bench's memory of the row: the step's peak allocated memory of the one rank its log parser read
    (runs.csv peak_allocated_MiB, in GiB; model_configs.md: a lower bound on the busiest rank's)."""

    @property
    def ran(self) -> bool:
        return self.status in RAN

    @property
    def crashed(self) -> bool:
        return self.status.startswith(CRASHED)

    def describe(self) -> str:
        return (
            f"{self.model} n={self.n_gpus} dp={self.dp} tp={self.tp} pp={self.pp} mbs={self.micro_batch_size} "
            f"ga={self.grad_accum} zero={self.zero_stage} ({self.status.split(' ')[0]}, line {self.line})"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    row: Row
    predicted: Predicted | None = None
    tokens_per_s_per_gpu: float = 0.0
    rank0_peak_bytes: int = 0
    """Rank 0's peak as nanotron holds it: the first stage's (as_nanotron_holds over it alone), what the
    playbook's reported memory measures. `predicted` holds the largest stage's, which decides whether the row
    fits the device."""
    after_pipeline_bytes: int = 0
    """What rank 0 (the first stage) holds after the pipeline (after_pipeline): the playbook's "Mem Alloc"."""
    reason: str = ""
    """Why the row cannot be expressed as a plan ("" when it can)."""


def read_rows(path: str) -> list[Row]:
    with open(path, newline="") as handle:
        return [
            Row(
                model=r["model"],
                n_gpus=int(r["n_gpus"]),
                dp=int(r["dp"]),
                tp=int(r["tp"]),
                pp=int(r["pp"]),
                micro_batch_size=int(r["mbz"]),
                grad_accum=int(r["grad_accum"]),
                seq_len=int(r["seq_len"]),
                zero_stage=r["zero_stage"],
                status=r["status"],
                tokens_per_s_per_gpu=float(r["tokens_per_sec_per_gpu"])
                if r["tokens_per_sec_per_gpu"]
                else None,
                line=line,
                reported_gib=float(r["reported_gpu_mem_GB"])
                if r.get("reported_gpu_mem_GB")
                else None,
                allocated_gib=float(r["peak_allocated_MiB"]) / 1024
                if r.get("peak_allocated_MiB")
                else None,
            )
            for line, r in enumerate(csv.DictReader(handle), start=2)
        ]


ATTENTION = "_scaled_dot_product_flash_attention"
"""The prefix of every flash attention op's name: the GPU's, CPU's (_for_cpu) and their backward."""


def _matmul(tokens: int, fan_in: int, fan_out: int, calls: int = 1) -> OpKind:
    """`calls` bf16 matmuls of (tokens x fan_in) by (fan_in x fan_out) over the replica batch."""
    weights = calls * fan_in * fan_out * BF16_BYTES
    return OpKind(
        name="mm",
        calls=calls,
        flops=2 * calls * tokens * fan_in * fan_out,
        bytes=weights + calls * tokens * (fan_in + fan_out) * BF16_BYTES,
        weight_bytes=weights,
    )


def _backward(products: tuple[OpKind, ...]) -> tuple[OpKind, ...]:
    """A matmul's backward computes two products (input and weight gradient) of its forward's size and
    moves about twice its bytes; flash attention's backward runs 5 of the forward's 2 products (Dao
    2023, FlashAttention-2, sec. 3.1), as many of them masked."""
    factor = {"mm": 2, ATTENTION: 2.5}
    return tuple(
        OpKind(
            name="mm" if kind.name == "mm" else f"{kind.name}_backward",
            calls=kind.calls * (2 if kind.name == "mm" else 1),
            flops=int(kind.flops * factor[kind.name]),
            bytes=2 * kind.bytes,
            weight_bytes=2 * kind.weight_bytes,
            masked_flops=int(kind.masked_flops * factor[kind.name]),
            head_dim_flops=int(kind.head_dim_flops * factor[kind.name]),
        )
        for kind in products
    )


def _elementwise(name: str, calls: int, nbytes: int, weight_bytes: int = 0) -> OpKind:
    return OpKind(
        name=name, calls=calls, flops=0, bytes=nbytes + weight_bytes, weight_bytes=weight_bytes
    )


def _sliced(
    fwd_kinds: tuple[OpKind, ...], bwd_kinds: tuple[OpKind, ...], names: tuple[str, ...], **facts
) -> TensorParallelFacts:
    """The block's ops called `names` (forward, and their backward) slice whole over the tp ranks (nanotron's
    column- and row-parallel linears, the attention over a rank's heads, the vocab-parallel cross entropy)."""
    fwd = tuple(kind for kind in fwd_kinds if kind.name in names)
    bwd = tuple(kind for kind in bwd_kinds if kind.name.removesuffix("_backward") in names)
    return TensorParallelFacts(
        fwd_kinds=fwd,
        bwd_kinds=bwd,
        sliced_fwd_flops=sum(k.flops for k in fwd),
        sliced_bwd_flops=sum(k.flops for k in bwd),
        **facts,
    )


def _block(
    index: int,
    name: str,
    numel: int,
    fwd_kinds: tuple[OpKind, ...],
    bwd_kinds: tuple[OpKind, ...],
    *,
    saved: int,
    inp: int,
    out: int,
    fwd_transient: int,
    bwd_transient: int,
    tensor_parallel: TensorParallelFacts,
) -> Block:
    return Block(
        tensor_parallel=tensor_parallel,
        index=index,
        name=name,
        modules=(name,),
        param_names=(f"{name}.weight",),
        param_numel=numel,
        param_bytes=FP32_BYTES * numel,
        buffer_bytes=0,
        fwd_flops=sum(k.flops for k in fwd_kinds),
        bwd_flops=sum(k.flops for k in bwd_kinds),
        saved_bytes=saved,
        input_bytes=inp,
        output_bytes=out,
        fwd_transient_bytes=fwd_transient,
        bwd_transient_bytes=bwd_transient,
        first_node=name,
        last_node=name,
        fwd_ops=sum(k.calls for k in fwd_kinds),
        bwd_ops=sum(k.calls for k in bwd_kinds),
        fwd_kinds=fwd_kinds,
        bwd_kinds=bwd_kinds,
    )


def llama_chain(
    dims: LlamaDims,
    samples: int,
    seq_len: int,
    *,
    pipelined: bool,
    sequence_sharded_norm: bool = False,
    code: NanotronCode = NanotronCode(),
) -> BlockChain:
    """The chain of a LLaMA decoder over `samples` sequences (one replica's batch), fp32 master
    parameters computed in bf16, flash attention, the loss in fp32 over the whole vocabulary.

    Per layer and token, in bf16 (2 bytes): saved for backward are both norms' inputs and outputs
    (4 h), what flash attention keeps of q, k, v after rotary and its output (the output is o_proj's
    input), the MLP's gate and up outputs, SiLU(gate) and their product (4 i). nanotron's attention
    (models/llama.py at e24d2483) keeps more of q, k, v than their own bytes: with as many kv heads as
    heads it permutes the fused qkv output into one contiguous [3, b, s, heads, d] tensor (lines
    469-473), copies k and v out of it into a new [b, s, 2, heads, d] tensor for rotary (cat, then
    permute and contiguous: lines 655-657), rotates q in place (flash_attn's RotaryEmbedding with kv
    given) and hands flash attention q as a view of the first tensor and k, v as views of the second
    (line 660): flash attention saves those views, so the whole qkv tensor (h + 2 kv) and the kv copy
    (2 kv) stay for backward, 2 h + 4 kv with the output; with fewer kv heads q, k and v are
    separate copies (lines 449-467) and it keeps q, the kv copy and the output, 2 h + 2 kv. The head
    keeps the final norm's input and output and the loss's fp32 softmax over the vocabulary
    (4 V bytes a token: nanotron's cross entropy casts the logits to fp32 and saves exp(logits) /
    sum, tensor_parallel/functional.py lines 43-85). While the loss runs the fp32 logits it reads
    sit beside that softmax: the cast_to_fp32 block's output (line 909) is held by
    LlamaForTraining.forward's `sharded_logits` until the loss returns (lines 1013-1021), the bf16
    logits are dropped when forward_with_hidden_states returns; the head's forward reaches 2 x 4 V
    bytes a token above what it started with. Tied weights are one parameter,
    held by the embedding's block, unless `pipelined`: nanotron then keeps the embedding on the
    first stage and a copy on the last (the copies' gradient sync is not priced).

    Over tp ranks (nanotron's TP in REDUCE_SCATTER mode: sequence parallel, vocab-parallel embedding
    and head): a layer slices its linears (all but the norms' weights), matmuls and attention, and the
    outputs of q, k, v, the attention and the MLP (all of its saved bytes a token but the norms' 4 h;
    those divide too under sequence parallelism), with two pairs: four exchanges of the
    hidden states a micro-batch. The embedding slices its table (one exchange: the forward's
    reduce-scatter), the head its matmul and the loss over the vocabulary, with the logits (one
    exchange: the norm's output gathered; the loss's all-reduces of a few bytes a token are left out).
    With `sequence_sharded_norm` the final norm divides too, its input and output and its time: nanotron
    runs it on the last layer's reduce-scattered output, a 1/tp slice of the sequence (line 905), and
    its LM head saves that slice, not the gathered input (tp_recompute_allgather, true by default).
    Of a layer's transients, one hidden-state tensor stays whole on every tp rank: a row-parallel linear's
    output before its reduce-scatter (tensor_parallel/functional.py line 466 at e24d2483) and a column-parallel
    linear's input gradient before its (line 296).

    Time: the kernels nanotron's code launches (models/llama.py and tensor_parallel/functional.py, the same at
    67c5ebb6 and e24d2483; flash-attn v2.5.8), each priced by its bytes. A layer's attention (with as many kv heads
    as heads, as in every playbook model: the grouped path copies otherwise) moves q, k, v through
    three layout copies (the fused qkv output permuted contiguous, lines 470-473; k and v concatenated and
    permuted, 655-657: 2 q + 6 k + 6 v bytes a token in bf16); backward copies again where autograd undoes the
    splits (the kv split's cat, the unbind's stack, the view's reshape: 4 q + 6 k + 6 v) and cats the MLP's gate and
    up gradients (line 200). Rotary runs in place both ways; a norm's backward reads its input and gradient and
    writes one; the residual adds' backward is autograd's two sums of 3 streams. The loss casts the logits to fp32,
    then max, subtracts into a new tensor, exp and div_ in place, sum (38 bytes a logit), and its backward is a
    mul_ and the cast back (14). The embedding's backward zeroes its whole gradient table each micro-batch, and
    with tied weights autograd sums the LM head's gradient into it. Under tp the playbook's column-parallel
    linears gather their input again in backward (tp_recompute_allgather), unpriced: the gather runs beside the
    input gradient's GEMM, which does not need it (tp_linear_async_communication; functional.py lines 268-332).

    `code` is what an older nanotron keeps beyond that (NanotronCode; by default the playbook's code)."""
    tokens, h, i, v = samples * seq_len, dims.hidden, dims.intermediate, dims.vocab
    stream = tokens * h * BF16_BYTES
    head_dim = h // dims.heads
    kv = dims.kv_heads * head_dim
    layer_numel = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    # QK^T and PV, 2 s^2 h each, counted over every score as torch counts a captured call; the causal half
    # masked (as FlashAttention's benchmark counts it), which FlashAttention-2 skips: the profile reads the
    # call's sequence off these FLOPs over its bytes (hardware.py, [Note: attention by sequence length])
    attention_flops = 4 * samples * seq_len * seq_len * h
    attention = OpKind(
        name=ATTENTION,
        calls=1,
        flops=attention_flops,
        masked_flops=attention_flops // 2,
        head_dim_flops=attention_flops * head_dim,
        bytes=(2 * h + 2 * kv) * tokens * BF16_BYTES,
    )
    layer_products = (
        _matmul(tokens, h, h + 2 * kv),
        attention,
        _matmul(tokens, h, h),
        _matmul(tokens, h, i, calls=2),
        _matmul(tokens, i, h),
    )
    qkv_bytes = tokens * (h + 2 * kv) * BF16_BYTES
    kv_bytes = 2 * tokens * kv * BF16_BYTES
    ffn = tokens * i * BF16_BYTES
    layer_kinds = layer_products + (
        _elementwise("rms_norm", 2, 4 * stream),
        _elementwise("rotary", 2, 2 * stream + kv_bytes),
        _elementwise("add", 2, 6 * stream),
        _elementwise("silu_mul", 2, 5 * ffn),
        _elementwise("layout_copy", 3, 2 * qkv_bytes + 4 * kv_bytes),
    )
    layer_bwd_kinds = _backward(layer_products) + (
        _elementwise("rms_norm_backward", 2, 6 * stream),
        _elementwise("rotary_backward", 2, 2 * stream + kv_bytes),
        _elementwise("add_backward", 2, 6 * stream),
        _elementwise("silu_mul_backward", 3, 9 * ffn),
        _elementwise("layout_copy_backward", 4, 4 * qkv_bytes + 2 * kv_bytes + 4 * ffn),
    )
    attention_saved = (
        2 * h
        + (4 if dims.kv_heads == dims.heads else 2) * kv
        + (h if code.o_proj_input_copy else 0)
    )
    layer_saved = (4 * h + attention_saved + 4 * i) * tokens * BF16_BYTES
    logits = tokens * v
    divides = math.gcd(dims.heads, dims.kv_heads, i)
    # the embedding's backward writes a whole zeroed gradient table a micro-batch, and autograd sums the LM head's
    # gradient into it where both are one parameter
    table_writes = v * h * BF16_BYTES * (1 + (3 if dims.tied and not pipelined else 0))
    embedding_bwd = _elementwise(
        "embedding_dense_backward", 2, 5 * stream, weight_bytes=table_writes
    )
    blocks = [
        _block(
            0,
            "model.embed_tokens",
            v * h,
            (_elementwise("embedding", 1, 2 * stream),),
            (embedding_bwd,),
            saved=tokens * 8,
            inp=tokens * 8,
            out=stream,
            fwd_transient=stream,
            bwd_transient=stream,
            tensor_parallel=TensorParallelFacts(
                divides=v,
                sliced_numel=v * h,
                all_reduces=1,
                exchange_bytes=stream,
                # only the table's writes slice: the lookup runs over every token on each tp rank
                bwd_kinds=(_elementwise(embedding_bwd.name, 0, 0, weight_bytes=table_writes),),
                sharded=(("model.embed_tokens", "vocab_embedding"),),
            ),
        )
    ]
    layer_facts = [
        _sliced(
            layer_kinds,
            layer_bwd_kinds,
            ("mm", ATTENTION),
            divides=divides,
            sliced_numel=layer_numel - 2 * h,
            sliced_saved_bytes=(attention_saved + 4 * i) * tokens * BF16_BYTES,
            sequence_layer=True,
            all_reduces=4,
            exchange_bytes=stream,
            gathered_saved_bytes=2 * stream if code.saves_gathered_input else 0,
            sharded=tuple((f"model.layers.{n}.{module}", style) for module, style in LAYER_STYLES),
        )
        for n in range(dims.layers)
    ]
    blocks += [
        _block(
            1 + n,
            f"model.layers.{n}",
            layer_numel,
            layer_kinds,
            layer_bwd_kinds,
            saved=layer_saved,
            inp=stream,
            out=stream,
            fwd_transient=2 * ffn,
            bwd_transient=4 * ffn,
            tensor_parallel=layer_facts[n],
        )
        for n in range(dims.layers)
    ]
    head_products = (_matmul(tokens, h, v),)
    head_kinds = head_products + (
        _elementwise("rms_norm", 1, 2 * stream),
        _elementwise("cross_entropy", 6, 38 * logits),
    )
    head_bwd_kinds = _backward(head_products) + (
        _elementwise("rms_norm_backward", 1, 3 * stream),
        _elementwise("cross_entropy_backward", 2, 14 * logits),
    )
    head_numel = h if dims.tied and not pipelined else v * h + h
    norm = 2 * stream  # the final norm's input and output
    # of the norm, what a rank keeps of a 1/tp slice of the sequence: its input, and its output unless the LM
    # head keeps that output gathered
    sliced_norm = (stream if code.saves_gathered_input else norm) if sequence_sharded_norm else 0
    head_facts = _sliced(
        head_kinds,
        head_bwd_kinds,
        ("mm", "cross_entropy") + (("rms_norm",) if sequence_sharded_norm else ()),
        divides=v,
        sliced_numel=head_numel - h,
        sliced_saved_bytes=logits * FP32_BYTES + sliced_norm,
        all_reduces=1,
        exchange_bytes=stream,
        sharded=(("lm_head", "vocab_head"),),
    )
    blocks.append(
        _block(
            1 + dims.layers,
            "lm_head",
            head_numel,
            head_kinds,
            head_bwd_kinds,
            saved=norm + logits * FP32_BYTES,
            inp=stream,
            out=0,
            fwd_transient=norm + 2 * logits * FP32_BYTES,
            bwd_transient=logits * BF16_BYTES + stream,
            tensor_parallel=head_facts,
        )
    )
    return BlockChain(
        blocks=tuple(blocks),
        fingerprint=f"llama-{dims.layers}x{h}",
        param_dtype="torch.float32",
        compute_dtype="bfloat16",  # its activations' bytes are bf16's, as nanotron computes
        inputs=(InputSpec(name="0", shape=(samples, seq_len), dtype="int64"),),
        input_bytes=tokens * 8,
        extra={"model": "LlamaForCausalLM"},
    )


LAYER_STYLES = (
    ("self_attn.q_proj", "colwise"),
    ("self_attn.k_proj", "colwise"),
    ("self_attn.v_proj", "colwise"),
    ("self_attn.o_proj", "rowwise"),
    ("mlp.gate_proj", "colwise"),
    ("mlp.up_proj", "colwise"),
    ("mlp.down_proj", "rowwise"),
)
"""How a decoder layer's linears slice over tp (LLaMA's module names; nanotron fuses q/k/v and gate/up)."""


def nanotron_block_stages(dims: LlamaDims, pp: int) -> list[int]:
    """The stage of each of nanotron's pipeline blocks as it assigns them (models/base.py `build_model`, "Setting
    PP block ranks"). Its blocks, in order: the embedding, the decoder layers, the final norm, the LM head, the
    fp32 cast, the loss; each weighs its weight count (a layer 4 h^2 + 3 h i, the head V h, the others nothing:
    models/llama.py get_block_compute_costs) and goes to the current stage, which moves on once the running
    weight passes its share (stage + 1) / pp of the total."""
    h = dims.hidden
    costs = [0] + [4 * h * h + 3 * h * dims.intermediate] * dims.layers + [0, dims.vocab * h, 0, 0]
    total, running, stage, stage_of = sum(costs), 0, 0, []
    for block_cost in costs:
        stage_of.append(stage)
        running += block_cost
        if running * pp > total * (stage + 1):
            stage += 1
    return stage_of


def nanotron_stage_starts(dims: LlamaDims, pp: int) -> list[int]:
    """The first block of each stage as nanotron assigns pipeline blocks (nanotron_block_stages), -1 for a stage
    it leaves without any.

    This chain holds the final norm, the head, the cast and the loss in one block. Where nanotron
    leaves the last stage only the cast and the loss, the head's block takes that stage and each
    stage before it that is left without blocks takes the last block of the stage before (an
    approximation: the head's matmul and the loss share one stage here, two in nanotron)."""
    stage_of = nanotron_block_stages(dims, pp)
    head = (
        dims.layers + 1
    )  # this chain's block holding the final norm, the head, the cast and the loss
    starts = [stage_of.index(s) if s in stage_of else -1 for s in range(pp)]
    if -1 in starts:
        return starts
    starts = [min(start, head) for start in starts]
    if pp > 1 and starts[-1] == starts[-2]:  # the last stage held only the cast and the loss
        for s in range(pp - 2, 0, -1):
            if starts[s] >= starts[s + 1]:
                starts[s] = starts[s + 1] - 1
    return starts


P2P_POLL_SLEEP_S = 0.1
"""What a polled wait of nanotron's pre-fix PP code sleeps between checks, at least once (NanotronCode.polls_p2p)."""


def polled_waits(dims: LlamaDims, pp: int) -> list[int]:
    """Polled waits each stage of nanotron's pre-fix PP code does a micro-batch (NanotronCode.polls_p2p): two a
    tensor each way it crosses a stage boundary, on each side of it (the sender's two metadata sends, the
    receiver's two receives; the data itself is waited for on the stream). Into a decoder layer cross its
    hidden states and sequence mask (models/llama.py, the layers' module_input_keys), into the final norm, the
    head, the fp32 cast or the loss one tensor (the loss's labels are made on its stage); every one but the mask
    sends a gradient back (the mask's backward sends nothing: pipeline_parallel/functional.py
    SendTensorWithoutGradientToPipelineBuffer). So a boundary between decoder layers costs each side 6 waits,
    one before the final norm 4: a middle stage between layers 12, the first 6."""
    stages = nanotron_block_stages(dims, pp)
    crossing = (
        [(0, 0)] + [(2, 1)] * dims.layers + [(1, 1)] * 4
    )  # into each block: (tensors, gradients back)
    waits = [0] * pp
    for block, (before, after) in enumerate(zip(stages, stages[1:]), start=1):
        if before != after:
            tensors, gradients = crossing[block]
            waits[before] += 2 * (tensors + gradients)
            waits[after] += 2 * (tensors + gradients)
    return waits


def p2p_polling_s(row: "Row", dims: LlamaDims) -> float:
    """What nanotron's pre-fix PP code sleeps in a step: its busiest stage's polled waits a micro-batch, a sleep
    each, over (micro-batches + stages - 1), as nanotron_host_s's host bound counts a step's micro-batches."""
    return (row.grad_accum + row.pp - 1) * max(polled_waits(dims, row.pp)) * P2P_POLL_SLEEP_S


def plan_for(row: Row, chain: BlockChain, dims: LlamaDims) -> Plan:
    """The plan nanotron ran for `row` on `chain` (which holds one replica's batch)."""
    strategy = ZERO_STAGES[row.zero_stage]
    units = tuple(
        Unit(name=b.name, modules=b.modules, params=b.param_names, strategy=strategy)
        for b in chain.blocks
    )
    starts = nanotron_stage_starts(dims, row.pp) + [len(units)]
    stages = tuple(
        Stage(index=s, units=tuple(u.name for u in units[starts[s] : starts[s + 1]]))
        for s in range(row.pp)
    )
    mesh = Mesh(dp_shard=row.dp, tp=row.tp, pp=row.pp)
    return Plan(
        fingerprint=chain.fingerprint,
        model=row.model,
        world_size=mesh.size,
        hardware="h100-80g",
        inputs=chain.inputs,
        mesh=mesh,
        tensor_parallel=tensor_parallel_section(
            chain, Configuration(mesh=mesh, schedule=Schedule(), sequence_parallel=True)
        ),
        schedule=Schedule(num_micro_batches=row.grad_accum, name="1f1b" if row.pp > 1 else "none"),
        mixed_precision=BF16_MIXED,
        units=units,
        stages=stages,
        predicted=Predicted(peak_bytes=0, step_time_s=0.0),
        reasoning=Reasoning(budget_bytes=0, binding_constraint="none: written by hand"),
    )


def as_run(dims: LlamaDims, tp: int) -> LlamaDims:
    """`dims` as nanotron builds them over `tp` ranks: it pads the vocabulary with dummy rows to a
    multiple of tp (trainer.py `init_model`, helpers.py `_vocab_size_with_padding`; its
    make_vocab_size_divisible_by is 1 in these runs), so the embedding and the head slice evenly."""
    return dataclasses.replace(dims, vocab=-(-dims.vocab // tp) * tp)


def why_not_expressible(row: Row) -> str:
    """ "" when the row can be planned, else the reason it cannot."""
    if row.model not in MODELS:
        return f"model {row.model!r} has no dimensions in MODELS"
    dims = MODELS[row.model]
    if math.gcd(dims.heads, dims.kv_heads, dims.intermediate) % row.tp:
        return f"tp={row.tp} does not divide the heads and widths of {row.model}"
    if row.zero_stage not in ZERO_STAGES:
        return f"ZeRO stage {row.zero_stage} has no shardplan strategy here"
    if row.pp > dims.layers + 2:
        return f"pp={row.pp} is more stages than the model's {dims.layers + 2} blocks"
    starts = nanotron_stage_starts(dims, row.pp)
    if -1 in starts:
        return (
            f"pp={row.pp}: nanotron's cut by weight count leaves stage {starts.index(-1)} without blocks "
            "(every such run crashed)"
        )
    if row.dp * row.tp * row.pp != row.n_gpus:
        return f"dp x tp x pp = {row.dp * row.tp * row.pp} is not the {row.n_gpus} GPUs of the row"
    return ""


NANOTRON_TENSORS = {"embedding": 1, "layer": 6, "head": 2}
"""Parameter tensors nanotron keeps per block: the embedding's table; a decoder layer's two norms, fused
qkv_proj, o_proj, fused gate_up_proj and down_proj; the final norm and the LM head (tied: the table)."""


def zero1_runtime_s(row: Row, chain: BlockChain, dims: LlamaDims, hw) -> float:
    """What nanotron's ZeRO-1 step does beyond the plan's shard_optimizer, on the stage with the most
    parameters. With fp32 gradient accumulation and ZeRO-1 the model is not wrapped in DDP (trainer.py,
    `make_ddp`): after the last backward one all-reduce of the stage's whole fp32 gradient buffer runs,
    blocking (gradient_accumulator.py, `sync_gradients_across_dp` with reduce_scatter=False: "too
    memory hungry, instead we run all_reduce"); after the step `_all_gather_params` (optim/zero.py,
    distributed.py `all_gather_coalesced`) gathers the bf16 parameters and copies every rank's slice of
    every tensor back in place: dp x tensors copy kernels, each paying the profile's fixed cost per op."""
    if row.zero_stage != "1" or row.dp == 1:
        return 0.0
    starts = nanotron_stage_starts(dims, row.pp) + [len(chain.blocks)]
    stages = [chain.blocks[a:b] for a, b in zip(starts, starts[1:])]
    blocks = max(stages, key=lambda stage: sum(b.param_numel for b in stage))
    numel = sum(b.param_numel for b in blocks) // row.tp
    tensors = sum(
        NANOTRON_TENSORS[
            "embedding" if b.index == 0 else "head" if b.name == "lm_head" else "layer"
        ]
        for b in blocks
    )
    ranks_per_node = max(1, hw.devices_per_node // row.tp)
    reduce_s = hw.collective_time_s(
        "all_reduce", FP32_BYTES * numel, row.dp, ranks_per_node=ranks_per_node
    )
    copies_s = hw.compute_time_s(0, 2 * BF16_BYTES * numel, "bfloat16", calls=row.dp * tensors)
    return reduce_s + copies_s


def nanotron_runtime_kernels(
    sizes: UnitSizes, decision: Decision, ctx: CostContext
) -> RuntimeKernels:
    """What nanotron (e24d2483, accumulate_grad_in_fp32: the playbook's config) runs over a unit's parameters and
    gradients beside the model's ops, priced in place of shardplan's runtime's ([Note: the runtime's kernels] in
    cost.py), each by the analysis's byte rule (an in-place op reads and writes its target): each micro-batch
    adds every bf16 gradient into its fp32 accumulator (optim/gradient_accumulator.py `_accumulate_grad`, or
    `fp32_accum_hook` on DDP's syncing micro-batch); once a step, at ZeRO-0 over dp > 1, DDP copies that
    micro-batch's bf16 gradients into its buckets (not views of them: trainer.py line 847), and the stepped
    fp32 parameters are copied into the bf16 model (the accumulator's `step`: the rank's slice at ZeRO-1), and
    before that clip_grad_norm (the config's clip_grad 1.0; optim/clip_grads.py lines 13-96) reads every fp32
    gradient for its norm and scales it in place.
    The accumulator's `zero_` is the optimizer term's over the gradient the rank steps; at ZeRO-1 it zeroes
    the rest too (optimizers' own zero_grad sets None). Its all-reduces average in NCCL (ReduceOp.AVG), no
    `div_`; ZeRO-1's copies around its gather are zero1_runtime_s (--nanotron-zero1)."""
    zero1 = decision.traits.shards_optimizer

    def stepped(nbytes: int) -> int:
        return -(-nbytes // ctx.dp) if zero1 else nbytes

    ddp_copy = (
        (("copy_", 3 * sizes.param_bytes),) if not zero1 and ctx.dp * ctx.dp_replicate > 1 else ()
    )
    rest_zeroed = (
        (("zero_", 2 * (sizes.grad_bytes - stepped(sizes.grad_bytes))),)
        if zero1 and ctx.dp > 1
        else ()
    )
    return RuntimeKernels(
        forward=(),
        backward=(("add_", sizes.param_bytes + 2 * sizes.grad_bytes),),
        step=ddp_copy
        + (
            ("clip_grad_norm", 3 * sizes.grad_bytes),
            ("copy_", stepped(sizes.storage_bytes + 2 * sizes.param_bytes)),
        )
        + rest_zeroed,
    )


NANOTRON_HOST_CALLS = {"layer": 220, "embedding": 23, "head": 101, "boundary": 47}
"""ATen calls nanotron's host dispatches a micro-batch, counted by executing its code (e24d2483, the playbook's
commit, with flash-attn v2.5.8's Python) on CPU under a TorchDispatchMode: `benchmarks/count_nanotron_calls.py
--tp 4` (and `--pp 2` for a boundary); only Triton's and flash-attn's CUDA kernels are stubbed, with the ATen
calls flash-attn's C++ makes around them. On the busiest rank (a middle tp rank, ZeRO-0), per micro-batch: a
decoder layer 99 forward, 115 in the autograd engine's backward and 6 for the fp32 accumulation (one add_ a
parameter; ZeRO-1 adds a view and a slice a parameter, 18); the embedding 23; the final norm, the head, the
sharded cross entropy and the engine's loss scaling 101; a stage boundary 47 (its send and its receive, forward
and backward, metadata included). tp = 1 dispatches fewer (a layer 144, the embedding 8, the head 79) and tp = 2
204 a layer (no rank computes both a before- and an after-shard); counting them apart moves no mean or lowest
tau by more than 0.01. About 70% of a layer's calls are views and allocations, which launch nothing on a GPU:
each is priced at the profile's op cost all the same."""

NANOTRON_TRITON_LAUNCHES = {"layer": 8, "embedding": 0, "head": 2, "boundary": 0}
"""Triton kernels a micro-batch launches: TritonRMSNorm (flash_attn's layer_norm_fn) and flash_attn's rotary,
forward and backward, two of each a layer; the final norm (counted by the same script)."""

TRITON_LAUNCH_S = 50e-6
"""Host time of one launch through Triton 2's Python launcher, which the playbook's environment (torch 2.1)
shipped: ~40 us with few arguments to ~62 us with many (github.com/triton-lang/triton/pull/3503), 42-55 us on
Triton's CI (pull/1431)."""


def nanotron_host_s(row: Row, chain: BlockChain, dims: LlamaDims, hw) -> float:
    """Host time of one micro-batch on nanotron's busiest stage: the ATen calls it dispatches at the profile's
    fixed cost of an op and its Triton launches at TRITON_LAUNCH_S. The host runs ahead of the GPU within a
    micro-batch but not across them once pipelined (every receive reads its metadata back on the host, every
    send copies it in from the host: p2p.py 220-287), and without a pipeline it can run ahead only as fast as
    it dispatches: either way a step is never shorter than (micro-batches + stages - 1) of these."""
    starts = nanotron_stage_starts(dims, row.pp) + [len(chain.blocks)]

    def kind(block) -> str:
        return "embedding" if block.index == 0 else "head" if block.name == "lm_head" else "layer"

    def stage_s(blocks, boundaries: int) -> float:
        kinds = [kind(b) for b in blocks] + ["boundary"] * boundaries
        return sum(
            NANOTRON_HOST_CALLS[k] * hw.op_overhead_s
            + NANOTRON_TRITON_LAUNCHES[k] * TRITON_LAUNCH_S
            for k in kinds
        )

    return max(
        stage_s(chain.blocks[a:b], (s > 0) + (s < row.pp - 1))
        for s, (a, b) in enumerate(zip(starts, starts[1:]))
    )


ADAM_BYTES = OPTIMIZER_STATE_BYTES_PER_PARAM["adamw"]


def plan_state_per_param(row: Row) -> float:
    """Bytes a parameter of the rank costs the plan between steps ([Note: the cost model] in cost.py):
    its fp32 copy whole, its fp32 gradient and AdamW state whole (replicate) or 1/dp (shard_optimizer),
    and an fp32 accumulator when the step has more than one micro-batch."""
    shards = 1 if row.zero_stage == "0" else row.dp
    return (
        FP32_BYTES + (FP32_BYTES + ADAM_BYTES) / shards + (FP32_BYTES if row.grad_accum > 1 else 0)
    )


def nanotron_state_per_param(row: Row) -> float:
    """Bytes a parameter of the rank costs nanotron between steps, at e24d2483 with accumulate_grad_in_fp32
    (the playbook's config): the bf16 model parameter, an fp32 gradient accumulator over every parameter at
    any number of micro-batches (optim/gradient_accumulator.py line 173, built for all of the model's
    parameters also under ZeRO-1: helpers.py lines 365-367), and the fp32 master copy with AdamW's two
    fp32 moments (line 95, the accumulator's copy of the parameters the rank steps: all of them at ZeRO-0,
    1/dp at ZeRO-1). At ZeRO-0 with dp > 1 the model is wrapped in DDP (trainer.py line 786: not at
    ZeRO-1 with fp32 accumulation), whose gradient buckets hold a bf16 gradient of every parameter.
    Checked against the playbook's own "Mem Alloc" column (the peak after the pipeline, where only this
    state and nanotron's buffers are left: see the docs): within 0.1 GiB at ZeRO-0 and ZeRO-1."""
    if row.zero_stage == "0":
        return BF16_BYTES + FP32_BYTES + FP32_BYTES + ADAM_BYTES + (BF16_BYTES if row.dp > 1 else 0)
    return BF16_BYTES + FP32_BYTES + (FP32_BYTES + ADAM_BYTES) / row.dp


def memory_buffer_bytes(row: Row, dims: LlamaDims) -> int:
    """What nanotron's MemoryBuffer (parallel/utils.py lines 14-28 at e24d2483) holds on a tp > 1 rank of a
    playbook row: one tensor per name for the whole run, grown to the largest request, never freed. Two
    names are asked for, each the micro-batch's whole sequence x hidden in bf16, whole on every tp rank:
    "allgather", where the column-parallel linears gather their sequence-sharded input in forward and
    again in backward (tensor_parallel/functional.py lines 153-156 and 286-288; tp_recompute_allgather is
    true by default, config/parallelism_config.py line 37, and the playbook's config leaves it), and
    "allgather2", where the async row-parallel linear gathers its output gradient in backward (lines
    491-493; tp_linear_async_communication is on in REDUCE_SCATTER mode, scripts/scaling_benchmarks.py
    line 88). Both are live at the step's peak from the second step on, on every stage (each holds a
    column- and a row-parallel linear). oldbench's runs (July 2024, async communication off) ran code from
    around the buffers' introduction (2024-07-17): none counted there."""
    if row.tp == 1 or not row.model.startswith("playbook-"):
        return 0
    return 2 * row.micro_batch_size * row.seq_len * dims.hidden * BF16_BYTES


def zero1_gather_per_param(row: Row) -> float:
    """Bytes a parameter of the rank costs while nanotron's ZeRO-1 gathers the stepped bf16 parameters after
    the optimizer's step (optim/zero.py `_all_gather_params`, lines 217-247; distributed.py
    `all_gather_coalesced`, lines 201-206): the slices of each rank flattened into one buffer per rank (the
    whole bf16 model), torch's all_gather of a list into one flat tensor of its own before it copies into
    them (the whole model again), and the rank's own slice flattened. Nothing at ZeRO-0 (DDP reduced the
    gradients in the backward; the optimizer steps in place)."""
    return 2 * BF16_BYTES + BF16_BYTES / row.dp if row.zero_stage == "1" and row.dp > 1 else 0.0


def after_pipeline(stage_memory: dict[str, int], row: Row, dims: LlamaDims) -> dict[str, int]:
    """What a rank of nanotron holds once the pipeline is done and the activations are gone, at its largest:
    nanotron's state for the parameters of a stage (read back from the plan's state there, `stage_memory` its
    peak's terms), its all-gather buffers and, at ZeRO-1, the gather of the stepped parameters. The playbook's
    "Mem Alloc" column measures exactly this: at the measured step the trainer resets the peak right after
    the pipeline (trainer.py line 498, logging.py `log_memory` line 259) and rank 0 writes
    max_memory_allocated when the step is done (helpers.py lines 609 and 674)."""
    params = stage_memory["sharded_state"] / plan_state_per_param(
        row
    )  # the stage's parameters on a rank
    return {
        "sharded_state": round(params * nanotron_state_per_param(row)),
        "memory_buffer": memory_buffer_bytes(row, dims),
        "parameter_gather": round(params * zero1_gather_per_param(row)),
    }


def as_nanotron_holds(
    plan: Predicted, stages: tuple[StepCost, ...], row: Row, dims: LlamaDims
) -> Predicted:
    """The plan's peak with what nanotron holds beside the activations in place of the plan's state, at the
    largest over the pipeline's stages (`stages`, compile.evaluate_stages: nanotron's state per parameter
    differs from the plan's, so a stage with more parameters and fewer activations than the plan's peak stage
    can overtake it): on each, nanotron's state (its bf16 parameters are whole, so the plan's gathered bf16
    copies go) and its all-gather buffers; or, where it is larger, the step after the pipeline
    (after_pipeline)."""

    def held(stage_memory: dict[str, int]) -> dict[str, int]:
        after = after_pipeline(stage_memory, row, dims)
        during = {
            **stage_memory,
            "sharded_state": after["sharded_state"],
            "gathered_params": 0,
            "memory_buffer": after["memory_buffer"],
        }
        return max(during, after, key=lambda memory: sum(memory.values()))

    memory = max(
        (held(stage.memory_bytes) for stage in stages), key=lambda found: sum(found.values())
    )
    return dataclasses.replace(plan, peak_bytes=sum(memory.values()), memory_bytes=memory)


def predict(
    rows: list[Row],
    hardware: str | HardwareProfile,
    *,
    nanotron_zero1: bool = False,
    fabric_jobs: dict[tuple, list[dict[str, str]]] | None = None,
    pp_code_jobs: dict[tuple, list[dict[str, str]]] | None = None,
) -> list[Outcome]:
    """Each row's plan priced on `hardware` as nanotron runs it (nanotron_runtime_kernels), its peak memory as
    nanotron holds it (as_nanotron_holds); with `nanotron_zero1`, each ZeRO-1 row's step also pays what
    nanotron's ZeRO-1 does beyond the plan (zero1_runtime_s); with `fabric_jobs` (nanotron_jobs), each row across
    nodes on the fabric its own job measured (job_fabric); with `pp_code_jobs`, each pipelined row whose own job
    ran nanotron's pre-fix PP code also pays its polling (NanotronCode.polls_p2p, p2p_polling_s)."""
    base = get_hardware(hardware)
    chains: dict[tuple, BlockChain] = {}
    outcomes = []
    for row in rows:
        reason = why_not_expressible(row)
        if reason:
            outcomes.append(Outcome(row=row, reason=reason))
            continue
        hw = job_fabric(base, row, fabric_jobs) if fabric_jobs else base
        dims = as_run(MODELS[row.model], row.tp)
        samples = row.micro_batch_size * row.grad_accum
        code = nanotron_code(row, row_job(row, pp_code_jobs) if pp_code_jobs else None)
        key = (dims, samples, row.seq_len, row.pp > 1, code)
        if key not in chains:
            chains[key] = llama_chain(
                dims,
                samples,
                row.seq_len,
                pipelined=row.pp > 1,
                sequence_sharded_norm=True,
                code=code,
            )
        chain = chains[key]
        plan, stages = evaluate_stages(
            chain, plan_for(row, chain, dims), hw, runtime=nanotron_runtime_kernels
        )
        predicted = as_nanotron_holds(plan, stages, row, dims)
        host_bound_s = (row.grad_accum + row.pp - 1) * nanotron_host_s(
            row, chain, dims, hw
        ) + plan.time_s["optimizer"]
        step_s = (
            max(predicted.step_time_s, host_bound_s)
            + (zero1_runtime_s(row, chain, dims, hw) if nanotron_zero1 else 0.0)
            + (p2p_polling_s(row, dims) if code.polls_p2p else 0.0)
        )
        tokens = samples * row.seq_len * row.dp / step_s / row.n_gpus
        outcomes.append(
            Outcome(
                row=row,
                predicted=predicted,
                tokens_per_s_per_gpu=tokens,
                rank0_peak_bytes=as_nanotron_holds(plan, stages[:1], row, dims).peak_bytes,
                after_pipeline_bytes=sum(
                    after_pipeline(stages[0].memory_bytes, row, dims).values()
                ),
            )
        )
    return outcomes


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GroupScore:
    """One model at one GPU count."""

    model: str
    n_gpus: int
    rows: int
    expressed: int
    ranked: int
    """Rows that ran, with a measured throughput and a prediction: what tau and the ratios are over."""
    tau: float
    ratios: tuple[float, ...]
    """Predicted / measured tokens/s/GPU of the ranked rows."""
    ratio_median: float
    ratio_p10: float
    ratio_p90: float
    crashed: int
    crashed_over: int
    ran: int
    ran_within: int


def _percentile(values: list[float], percent: float) -> float:
    return float(np.percentile(values, percent)) if values else math.nan


def score(outcomes: list[Outcome], usable_bytes: int) -> list[GroupScore]:
    groups: dict[tuple[str, int], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        groups[outcome.row.model, outcome.row.n_gpus].append(outcome)
    scores = []
    for (model, n_gpus), members in sorted(groups.items()):
        expressed = [o for o in members if o.predicted is not None]
        ranked = [o for o in expressed if o.row.ran and o.row.tokens_per_s_per_gpu]
        ratios = sorted(o.tokens_per_s_per_gpu / o.row.tokens_per_s_per_gpu for o in ranked)
        tau = (
            kendalltau(
                [o.tokens_per_s_per_gpu for o in ranked],
                [o.row.tokens_per_s_per_gpu for o in ranked],
            )[0]
            if len(ranked) > 1
            else math.nan
        )
        crashed = [o for o in expressed if o.row.crashed]
        ran = [o for o in expressed if o.row.ran]
        scores.append(
            GroupScore(
                model=model,
                n_gpus=n_gpus,
                rows=len(members),
                expressed=len(expressed),
                ranked=len(ranked),
                tau=float(tau),
                ratios=tuple(ratios),
                ratio_median=_percentile(ratios, 50),
                ratio_p10=_percentile(ratios, 10),
                ratio_p90=_percentile(ratios, 90),
                crashed=len(crashed),
                crashed_over=sum(o.predicted.peak_bytes > usable_bytes for o in crashed),
                ran=len(ran),
                ran_within=sum(o.predicted.peak_bytes <= usable_bytes for o in ran),
            )
        )
    return scores


def _share(part: int, whole: int) -> str:
    return f"{part}/{whole} ({part / whole:.0%})" if whole else "-"


def print_table(scores: list[GroupScore]) -> None:
    print(
        "| model | GPUs | rows (planned) | ranked | Kendall tau | pred/meas median | p10 | p90 "
        "| crashed predicted over | ran predicted within |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for s in scores:
        print(
            f"| {s.model} | {s.n_gpus} | {s.rows} ({s.expressed}) | {s.ranked} | {s.tau:+.2f} | "
            f"{s.ratio_median:.2f} | {s.ratio_p10:.2f} | {s.ratio_p90:.2f} | {_share(s.crashed_over, s.crashed)} | "
            f"{_share(s.ran_within, s.ran)} |"
        )
    print(
        "\n| model | mean tau over GPU counts | lowest tau | pred/meas median | p90 | crashed predicted over "
        "| ran predicted within |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for model in sorted({s.model for s in scores}):
        mine = [s for s in scores if s.model == model]
        taus = [s.tau for s in mine if not math.isnan(s.tau)]
        ratios = [ratio for s in mine for ratio in s.ratios]
        mean_tau, lowest_tau = (
            (f"{statistics.mean(taus):+.2f}", f"{min(taus):+.2f}") if taus else ("-", "-")
        )
        print(
            f"| {model} | {mean_tau} | {lowest_tau} | {_percentile(ratios, 50):.2f} | "
            f"{_percentile(ratios, 90):.2f} | {_share(sum(s.crashed_over for s in mine), sum(s.crashed for s in mine))} | "
            f"{_share(sum(s.ran_within for s in mine), sum(s.ran for s in mine))} |"
        )


TP_DEGREES = (1, 2, 4, 8, 16, 32)


def memory_ratios(outcomes: list[Outcome]) -> dict[tuple[str, bool, int], float]:
    """Median predicted / reported memory of the rows that ran, by (model, pp > 1, tp): both rank 0's, the
    first stage's (Outcome.rank0_peak_bytes)."""
    groups: dict[tuple[str, bool, int], list[float]] = defaultdict(list)
    for o in outcomes:
        if o.predicted is not None and o.row.ran and o.row.reported_gib:
            groups[o.row.model, o.row.pp > 1, o.row.tp].append(
                o.rank0_peak_bytes / 2**30 / o.row.reported_gib
            )
    return {key: statistics.median(ratios) for key, ratios in groups.items()}


def throughput_ratios(outcomes: list[Outcome]) -> dict[tuple[str, str, int], float]:
    """Median predicted / measured throughput of the rows that ran, by (model, pp = 1 or > 1, tp)."""
    groups: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for o in outcomes:
        if o.predicted is not None and o.row.ran and o.row.tokens_per_s_per_gpu:
            groups[o.row.model, "> 1" if o.row.pp > 1 else "1", o.row.tp].append(
                o.tokens_per_s_per_gpu / o.row.tokens_per_s_per_gpu
            )
    return {key: statistics.median(ratios) for key, ratios in groups.items()}


def allocated_ratios(outcomes: list[Outcome]) -> dict[int, list[float]]:
    """Predicted peak / the measured peak allocated memory (old_bench's rows that logged it), by tp. The
    prediction is the largest stage's: old_bench's log parser read one rank, which one unknown
    (Row.allocated_gib)."""
    groups: dict[int, list[float]] = defaultdict(list)
    for o in outcomes:
        if o.predicted is not None and o.row.ran and o.row.allocated_gib:
            groups[o.row.tp].append(o.predicted.peak_bytes / 2**30 / o.row.allocated_gib)
    return {tp: sorted(ratios) for tp, ratios in sorted(groups.items())}


def print_allocated_ratios(ratios: dict[int, list[float]]) -> None:
    print("\nPredicted peak / measured peak allocated (old_bench's log), rows that ran:")
    for tp, found in ratios.items():
        print(
            f"  tp {tp}: median {statistics.median(found):.2f} ({found[0]:.2f}-{found[-1]:.2f}), "
            f"within 5%: {sum(abs(r - 1) <= 0.05 for r in found)}/{len(found)}"
        )


FAST, SLOW = 0.8, 0.5
"""A row's throughput over the best of its group (model, tp, micro-batch size) above which it counts as fast, below
which as slow (reservation_by_speed)."""


def reservation_by_speed(outcomes: list[Outcome]) -> dict[str, list[float]]:
    """Reported (reserved) / predicted peak of the pp = 1, tp > 1 rows that ran, split by how fast each ran
    against the best row of its (model, tp, micro-batch size) group: "fast" (over FAST of it), "slow" (under
    SLOW). A rank in such a group runs the same micro-batch (its optimizer state, priced, and its number of
    micro-batches differ), so what a row reserves beyond the prediction that follows the speed is the caching
    allocator's, not a tensor of the program. (At pp = 1 rank 0 is the whole model: the prediction is its.)"""
    groups: dict[tuple, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        row = o.row
        if (
            o.predicted is not None
            and row.ran
            and row.reported_gib
            and row.tokens_per_s_per_gpu
            and row.pp == 1
            and row.tp > 1
        ):
            groups[row.model, row.tp, row.micro_batch_size].append(o)
    found: dict[str, list[float]] = {"fast": [], "slow": []}
    for members in (m for m in groups.values() if len(m) > 1):
        best = max(o.row.tokens_per_s_per_gpu for o in members)
        for o in members:
            speed = o.row.tokens_per_s_per_gpu / best
            if speed > FAST or speed < SLOW:
                found["fast" if speed > FAST else "slow"].append(
                    o.row.reported_gib * 2**30 / o.predicted.peak_bytes
                )
    return found


def print_reservation_by_speed(found: dict[str, list[float]]) -> None:
    bounds = {"fast": f"over {FAST:.0%}", "slow": f"under {SLOW:.0%}"}
    print(
        "\nReported / predicted at pp = 1 and tp > 1, median, by throughput against the best row of the same "
        "model, tp and micro-batch size: "
        + ", ".join(
            f"{kind} ({bounds[kind]}) {statistics.median(ratios):.2f} ({len(ratios)} rows)"
            for kind, ratios in found.items()
            if ratios
        )
    )


def print_memory_ratios(ratios: dict[tuple[str, bool, int], float]) -> None:
    print(
        "\nPredicted / reported memory of rank 0 (the first stage; GiB reserved), median of the rows that ran:\n"
    )
    print_by_tp(
        {
            (model, "> 1" if pipelined else "1", tp): ratio
            for (model, pipelined, tp), ratio in ratios.items()
        },
        "pp",
        "{:.2f}",
    )


def print_by_tp(values: dict[tuple[str, str, int], float], label: str, shown: str) -> None:
    """A markdown table of `values` by (model, `label`'s value) in rows and tp in columns."""
    print(f"| model | {label} | " + " | ".join(f"tp {tp}" for tp in TP_DEGREES) + " |")
    print("|---|---|" + "---:|" * len(TP_DEGREES))
    for model, kind in sorted({(m, k) for m, k, _ in values}):
        cells = (
            shown.format(values[model, kind, tp]) if (model, kind, tp) in values else "-"
            for tp in TP_DEGREES
        )
        print(f"| {model} | {kind} | " + " | ".join(cells) + " |")


def crashed_within(outcomes: list[Outcome], usable_bytes: int) -> dict[str, dict[str, int]]:
    """Per model, the crashed rows predicted within the device, by what the same configuration (GPUs, dp,
    tp, pp, ZeRO stage) did at other micro-batch sizes: ran at the same or a larger one (so the crash was
    not out of memory), ran only at smaller ones (likely out of memory: the model's miss), or never ran."""

    def configuration(row: Row) -> tuple:
        return row.model, row.n_gpus, row.dp, row.tp, row.pp, row.zero_stage

    ran: dict[tuple, list[int]] = defaultdict(list)
    for o in outcomes:
        if o.row.ran:
            ran[configuration(o.row)].append(o.row.micro_batch_size)
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for o in outcomes:
        if o.row.crashed and o.predicted is not None and o.predicted.peak_bytes <= usable_bytes:
            sizes = ran[configuration(o.row)]
            kind = (
                "never ran"
                if not sizes
                else "ran at the same or a larger micro-batch"
                if max(sizes) >= o.row.micro_batch_size
                else "ran only at smaller micro-batches"
            )
            counts[o.row.model][kind] += 1
    return counts


PLAYBOOK_WIDTHS = {
    "2048": "playbook-1B",
    "3072": "playbook-3B",
    "4096": "playbook-8B",
    "8192": "playbook-80B",
}
"""hidden_size in nanotron's benchmark CSV -> the playbook model of runs.csv."""


def nanotron_jobs(path: str) -> dict[tuple, list[dict[str, str]]]:
    """The lines of nanotron's own benchmark CSV (one a job) of each configuration of a playbook model, keyed as
    configuration_key keys a row. The playbook's figures read this CSV (scripts/scaling_benchmarks.py line 484
    at e24d2483, which re-runs whatever is neither Success nor OOM); a public copy: github.com/eyao600/Rapid-LLM,
    validation_scripts/huggingface_data/bench_final2_mfu2.csv."""
    jobs: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    with open(path, newline="") as handle:
        for r in csv.DictReader(handle):
            if r["hidden_size"] in PLAYBOOK_WIDTHS:
                jobs[
                    PLAYBOOK_WIDTHS[r["hidden_size"]],
                    int(r["dp"]),
                    int(r["tp"]),
                    int(r["pp"]),
                    int(r["mbs"]),
                    int(float(r["batch_accum"])),
                    r["zero_stage"],
                ].append(r)
    return jobs


def nanotron_statuses(path: str) -> dict[tuple, set[str]]:
    """The statuses nanotron's own benchmark CSV gives each configuration (nanotron_jobs): Success, OOM (its
    `oom_error` column: the run's log holds an out-of-memory error) or Other (any other failure, oom_error false)."""
    return {key: {job["status"] for job in found} for key, found in nanotron_jobs(path).items()}


JOB_FABRIC_COLUMNS = {
    "all_reduce": "AllReduce (GB/s)",
    "all_gather_into_tensor": "AllGather (GB/s)",
    "reduce_scatter_tensor": "ReduceScatter (GB/s)",
}
"""Where nanotron's CSV logs what its job's measure_bandwidth read over the world group (PLAYBOOK_FABRIC_GBPS)."""


def row_job(row: Row, jobs: dict[tuple, list[dict[str, str]]]) -> dict[str, str] | None:
    """The line of nanotron's CSV (nanotron_jobs) of the job that measured `row`: the successful job of its
    configuration whose throughput is the row's (within 1 token/s); None where there is none."""
    return next(
        (
            job
            for job in jobs.get(configuration_key(row), ())
            if job["status"] == "Success"
            and row.tokens_per_s_per_gpu
            and abs(float(job["tok/s/gpu"]) - row.tokens_per_s_per_gpu) < 1
        ),
        None,
    )


def job_fabric(
    hw: HardwareProfile, row: Row, jobs: dict[tuple, list[dict[str, str]]]
) -> HardwareProfile:
    """`hw` on the fabric `row`'s own job (row_job) measured at its start (measure_bandwidth, as
    PLAYBOOK_FABRIC_GBPS). The job measured its whole world and nothing smaller, so every collective of the row
    across nodes keeps that share (a pipeline pair or a tp group over fewer nodes too). `hw` where the row spans
    one node or no job with a measurement is found."""
    nodes = row.n_gpus // GPUS_PER_NODE
    job = row_job(row, jobs)
    if nodes < 2 or not job or not job[JOB_FABRIC_COLUMNS["all_reduce"]]:
        return hw
    return with_fabric(
        hw,
        {kind: {nodes: float(job[column])} for kind, column in JOB_FABRIC_COLUMNS.items()},
        f"job {job['job_id']}'s fabric",
    )


def configuration_key(row: Row) -> tuple:
    return row.model, row.dp, row.tp, row.pp, row.micro_batch_size, row.grad_accum, row.zero_stage


def crashed_by_nanotron_status(
    outcomes: list[Outcome], usable_bytes: int, statuses: dict[tuple, set[str]]
) -> dict[tuple[str, str], tuple[int, int]]:
    """Per (model, what nanotron's CSV says of the crash: "OOM" if any attempt ran out of memory, else
    "other failure"), the crashed rows predicted over the device and all of them."""
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for o in outcomes:
        if o.row.crashed and o.predicted is not None and o.row.model.startswith("playbook-"):
            found = statuses.get(configuration_key(o.row), set())
            kind = "OOM" if "OOM" in found else "other failure" if found else "not in the CSV"
            counts[o.row.model, kind][0] += o.predicted.peak_bytes > usable_bytes
            counts[o.row.model, kind][1] += 1
    return {key: (over, total) for key, (over, total) in counts.items()}


def print_crashed_by_nanotron_status(counts: dict[tuple[str, str], tuple[int, int]]) -> None:
    print(
        "\nCrashed rows predicted over the device, by what nanotron's benchmark CSV says of the crash:"
    )
    for (model, kind), (over, total) in sorted(counts.items()):
        print(f"  {model}, {kind}: {_share(over, total)}")


def nanotron_communicators(row: Row) -> int:
    """NCCL communicators world rank 0 of a playbook row holds for the whole run, read from the runs' code
    (nanotron bench2 at 67c5ebb6; torch 2.1 builds a process group's communicator at its first collective and
    keeps it): the default group's (init_process_group; its barrier), world_pg's (a group of every rank of its
    own, context.py line 59; measure_bandwidth's collectives, trainer.py lines 1074-1200), and one for each
    distinct set of ranks among the groups of more than one rank that run a collective, a set built once
    (create_new_group, world_ranks_to_pg): local_pg (the node's ranks: measure_bandwidth), tp_pg, dp_pg, mp_pg
    (tp x pp ranks: clip_grad_norm's all_reduce, optim/clip_grads.py lines 60-72) and at pp > 1 the tied
    embedding's pair of the first and last stage (tied_parameters.py lines 84-100, its gradients' all_reduce);
    at pp > 1 also the two-rank communicator torch 2.1 keys to the pair of ranks of a send and receive
    (ProcessGroupNCCL's point-to-point) to the next stage. Ranks are laid out (pp, dp, tp), tp fastest
    (context.py, the expert dimension 1)."""
    ranks = np.arange(row.n_gpus).reshape(row.pp, row.dp, row.tp)
    groups = (
        ranks.reshape(-1)[:GPUS_PER_NODE],
        ranks[0, 0, :],
        ranks[0, :, 0],
        ranks[:, 0, :].reshape(-1),
        ranks[[0, -1], 0, 0],
    )
    built = {tuple(sorted(int(rank) for rank in group)) for group in groups if len(set(group)) > 1}
    return 2 + len(built) + (row.pp > 1)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CommunicatorBound:
    """The playbook rows whose rank 0 holds one number of NCCL communicators (nanotron_communicators)."""

    ran: int
    """Rows that ran with a reported memory."""
    most_reserved_bytes: int
    """The most any of them reserved: the device held that beside the CUDA context and every communicator's
    buffers, so what is left of the device bounds those."""
    short_bytes: tuple[int, ...]
    """Each crashed row predicted within the usable memory (the ones nanotron logged out of memory where its
    statuses are given): the usable memory less its prediction, what a term would have to add to put it over."""


def communicator_bound(
    outcomes: list[Outcome], usable_bytes: int, statuses: dict[tuple, set[str]] | None = None
) -> dict[int, CommunicatorBound]:
    """Per number of communicators rank 0 holds, the most that rows that ran reserved and how far below the
    usable memory the crashed rows predicted within it are (with `statuses`, those nanotron logged OOM)."""
    reserved: dict[int, list[int]] = defaultdict(list)
    short: dict[int, list[int]] = defaultdict(list)
    for o in outcomes:
        if o.predicted is None or not o.row.model.startswith("playbook-"):
            continue
        count = nanotron_communicators(o.row)
        if o.row.ran and o.row.reported_gib:
            reserved[count].append(round(o.row.reported_gib * 2**30))
        out_of_memory = statuses is None or "OOM" in statuses.get(configuration_key(o.row), set())
        if o.row.crashed and out_of_memory and o.predicted.peak_bytes <= usable_bytes:
            short[count].append(usable_bytes - o.predicted.peak_bytes)
    return {
        count: CommunicatorBound(
            ran=len(reserved[count]),
            most_reserved_bytes=max(reserved[count], default=0),
            short_bytes=tuple(sorted(short[count])),
        )
        for count in sorted(set(reserved) | set(short))
    }


def print_communicator_bound(
    bounds: dict[int, CommunicatorBound], device_bytes: int, out_of_memory: bool
) -> None:
    crashed = "crashed rows nanotron logged OOM" if out_of_memory else "crashed rows"
    print(
        f"\nNCCL communicators rank 0 holds (nanotron_communicators): what the rows that ran leave them of the "
        f"device ({device_bytes / 2**30:.1f} GiB), and how far below the usable memory the {crashed} predicted "
        "within it are:\n"
    )
    print(
        "| communicators | rows that ran | most reserved GiB | device less that, GiB | a communicator at most, GiB "
        f"| {crashed} within | GiB below usable: median (range) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---|")
    for count, bound in bounds.items():
        left = (device_bytes - bound.most_reserved_bytes) / 2**30
        cells = (
            f"{bound.most_reserved_bytes / 2**30:.1f} | {left:.2f} | {left / count:.2f}"
            if bound.ran
            else "- | - | -"
        )
        short = [s / 2**30 for s in bound.short_bytes]
        gap = f"{statistics.median(short):.1f} ({short[0]:.1f}-{short[-1]:.1f})" if short else "-"
        print(f"| {count} | {bound.ran} | {cells} | {len(short)} | {gap} |")


def print_crashed_within(counts: dict[str, dict[str, int]]) -> None:
    print(
        "\nCrashed rows predicted within the device, by what their configuration did at other micro-batches:"
    )
    for model, kinds in sorted(counts.items()):
        print(
            f"  {model}: " + ", ".join(f"{kind} {count}" for kind, count in sorted(kinds.items()))
        )


SLOW_MODE_S = 0.5
"""Seconds a micro-batch past which a pipelined row is in the data's slow mode (print_what_rows_show)."""


def step_s(row: Row) -> float:
    """A row's measured step: the global batch's tokens over the cluster's tokens/s."""
    return (
        row.micro_batch_size
        * row.grad_accum
        * row.seq_len
        * row.dp
        / row.tokens_per_s_per_gpu
        / row.n_gpus
    )


def busiest_stage_layers(row: Row) -> float:
    """Decoder layers' worth of weight on the row's busiest stage as nanotron cuts it (the LM head weighs
    V h, i.e. V h / (4 h^2 + 3 h i) layers)."""
    dims = MODELS[row.model]
    h = dims.hidden
    weights = (
        [0.0] + [1.0] * dims.layers + [dims.vocab * h / (4 * h * h + 3 * h * dims.intermediate)]
    )
    starts = nanotron_stage_starts(dims, row.pp) + [len(weights)]
    return max(sum(weights[a:b]) for a, b in zip(starts, starts[1:]))


def twin_ratios(rows: list[Row]) -> list[float]:
    """Throughput ratio (faster / slower) of each pair of rows that ran and differ only in the ZeRO stage."""
    twins: dict[tuple, list[float]] = defaultdict(list)
    for row in rows:
        if row.ran and row.tokens_per_s_per_gpu:
            twins[
                dataclasses.replace(
                    row,
                    zero_stage="",
                    status="",
                    tokens_per_s_per_gpu=None,
                    line=0,
                    reported_gib=None,
                    allocated_gib=None,
                )
            ].append(row.tokens_per_s_per_gpu)
    return [max(pair) / min(pair) for pair in twins.values() if len(pair) == 2]


def layer_ms(rows: list[Row]) -> dict[tuple[str, str, int], float]:
    """Median ms a layer of the busiest stage takes a micro-batch of one sequence, by (model, where, tp):
    `where` is pp = 1, pp > 1 on one node, or pp > 1 over several nodes (nanotron lays pp outermost, so
    a boundary then crosses nodes). A micro-batch is the step over
    (micro-batches + stages - 1); rows in the slow mode (over SLOW_MODE_S a micro-batch) are left out."""
    groups: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for row in rows:
        if not (
            row.ran
            and row.tokens_per_s_per_gpu
            and row.micro_batch_size == 1
            and row.model in MODELS
            and not why_not_expressible(row)
        ):
            continue
        per_micro_batch = step_s(row) / (row.grad_accum + row.pp - 1)
        if row.pp > 1 and per_micro_batch > SLOW_MODE_S:
            continue
        where = (
            "pp = 1"
            if row.pp == 1
            else "pp > 1, across nodes"
            if row.n_gpus > 8
            else "pp > 1, one node"
        )
        groups[row.model, where, row.tp].append(1e3 * per_micro_batch / busiest_stage_layers(row))
    return {key: statistics.median(values) for key, values in groups.items()}


def print_what_rows_show(rows: list[Row]) -> None:
    """What the measurements show that no configuration term prices."""
    ratios = twin_ratios(rows)
    print(
        f"\nRows that differ only in the ZeRO stage: {sum(r > 2 for r in ratios)} of {len(ratios)} pairs differ "
        f"more than 2x in throughput (at most {max(ratios, default=1):.0f}x)"
    )
    print(
        "\nms a layer of the busiest stage takes a micro-batch of one sequence, median (slow mode left out):\n"
    )
    print_by_tp(layer_ms(rows), "pipeline", "{:.1f}")


def op_breakdown(dims: LlamaDims, hw) -> dict[str, list[tuple[str, float, float, float]]]:
    """What the profile prices of one sequence of 4096 tokens on one rank at tp = 1, forward and backward, for a
    decoder layer and for the head (the final norm, the LM head and the fp32 loss): per op kind its seconds, FLOPs
    and bytes, as cost.py prices a micro-batch of one sequence (each call's fixed cost and its factor included)."""
    chain = llama_chain(dims, 1, 4096, pipelined=False)
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    found: dict[str, list[tuple[str, float, float, float]]] = {}
    for block in (chain.blocks[1], chain.blocks[-1]):
        merged: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for kind in block.fwd_kinds + block.bwd_kinds:
            for i, value in enumerate((kind_time_s(kind, ctx), kind.flops, kind.bytes)):
                merged[kind.name.removesuffix("_backward")][i] += value
        if hw.view_overhead_s:  # forward and backward
            merged["views"][0] += 2 * unpriced_dispatches(block) * hw.view_overhead_s
        found["head" if block.name == "lm_head" else "layer"] = [
            (name, *values) for name, values in merged.items()
        ]
    return found


def per_sequence_s(rows: list[Row], model: str, hw) -> dict[int, tuple[float, float]]:
    """(measured, predicted) seconds a rank takes a sequence in the one-node rows of `model` at tp = pp = 1, by
    micro-batch size (the fastest measured row of each): what op_breakdown's layers and head, with the
    per-micro-batch and per-step terms, add up to."""
    found: dict[int, tuple[float, float]] = {}
    single = [
        r
        for r in rows
        if r.model == model
        and r.n_gpus == 8
        and r.tp == r.pp == 1
        and r.ran
        and r.tokens_per_s_per_gpu
    ]
    for outcome in predict(single, hw):
        row = outcome.row
        sequences = row.micro_batch_size * row.grad_accum
        seconds = (
            step_s(row) / sequences,
            step_s(dataclasses.replace(row, tokens_per_s_per_gpu=outcome.tokens_per_s_per_gpu))
            / sequences,
        )
        found[row.micro_batch_size] = min(seconds, found.get(row.micro_batch_size, (math.inf, 0.0)))
    return dict(sorted(found.items()))


def print_op_breakdown(rows: list[Row], hw) -> None:
    """The single-node budget: each op kind of a layer and of the head as priced, with the rate
    it implies, beside what the published one-node rows took a sequence."""
    for model in ("playbook-1B", "playbook-3B"):
        dims = MODELS[model]
        print(f"\n{model} on {hw.name}, one sequence of 4096 tokens, tp = 1, forward + backward:")
        for part, kinds in op_breakdown(dims, hw).items():
            for name, seconds, flops, nbytes in kinds:
                rate = (
                    f"{flops / seconds / 1e12:.0f} TFLOP/s"
                    if flops
                    else f"{nbytes / seconds / 1e12:.2f} TB/s"
                )
                print(f"  {part} {name}: {seconds * 1e3:.3f} ms ({rate})")
            print(f"  {part}: {sum(k[1] for k in kinds) * 1e3:.2f} ms")
        print(
            "  a sequence on 8 GPUs at tp = pp = 1, measured / predicted, by micro-batch size: "
            + ", ".join(
                f"{mbs}: {measured * 1e3:.1f} / {predicted * 1e3:.1f} ms"
                for mbs, (measured, predicted) in per_sequence_s(rows, model, hw).items()
            )
        )


@functools.cache
def captured_and_built_layer(zoo_name: str, seq_len: int) -> tuple[Block, Block]:
    """A layer of zoo model `zoo_name` (a LLaMA: "llama-7b", "llama-70b") over one sequence: captured as compile
    captures it (the zoo model at one layer on meta, analysed computing in bf16 on fake CPU tensors, so CPU's flash
    attention op with torch's FLOPs over every score and the masked ones apart) and as llama_chain builds it from the
    same model's config (FlashAttention-2's op, its FLOPs counted alike)."""
    from shardplan.frontend.passes import analyze
    from shardplan.models import zoo

    entry = zoo.ZOO[zoo_name](n_layer=1, batch=1, seq=seq_len)
    config = entry.model.config
    dims = LlamaDims(
        layers=1,
        hidden=config.hidden_size,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        tied=config.tie_word_embeddings,
    )
    captured = next(
        block
        for block in analyze(entry.model, entry.args, entry.kwargs, compute_dtype="bfloat16").blocks
        if block.name == "model.layers.0"
    )
    return captured, llama_chain(dims, 1, seq_len, pipelined=False).blocks[1]


CAPTURED_ATTENTION_SEQ_LEN = 4096
"""The sequence --captured-attention prices a layer's attention over."""


def attention_ms(
    hw, seq_len: int = CAPTURED_ATTENTION_SEQ_LEN, tp: int = 1, zoo_name: str = "llama-7b"
) -> dict[str, tuple[float, float]]:
    """captured_and_built_layer's attention on a rank of `tp`, forward and backward milliseconds as `hw` prices
    them, by source: "captured" and "hand-built"."""
    ctx = CostContext(hardware=hw, dp=1, tp=tp, param_dtype="bfloat16")

    def milliseconds(block: Block) -> tuple[float, float]:
        on_tp_rank = on_rank(block, ctx)
        fwd, bwd = (
            sum(kind_time_s(kind, ctx) for kind in kinds if kind.name.startswith(ATTENTION)) * 1e3
            for kinds in (on_tp_rank.fwd_kinds, on_tp_rank.bwd_kinds)
        )
        return fwd, bwd

    return dict(
        zip(
            ("captured", "hand-built"),
            map(milliseconds, captured_and_built_layer(zoo_name, seq_len)),
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--data", default=DEFAULT_DATA, help="runs.csv of the published-h100 data set"
    )
    parser.add_argument(
        "--hardware", default="h100-80g", help="built-in profile name or calibrated profile path"
    )
    parser.add_argument(
        "--fabric",
        choices=(*FABRICS, "job"),
        default="",
        help="price collectives across nodes with a measured fabric: playbook, the bandwidth by node "
        "count of the cluster that ran the rows (PLAYBOOK_FABRIC_GBPS); p5, a tuned AWS p5 "
        "cluster's (P5_FABRIC_GBPS); job, what each row's own job measured (needs "
        "--nanotron-csv; not with --picks)",
    )
    parser.add_argument("--model", action="append", help="only these models (repeatable)")
    parser.add_argument(
        "--nanotron-csv",
        help="nanotron's own benchmark CSV (bench_final2_mfu2.csv): split the "
        "crashed rows by the status it gives them (OOM or another failure)",
    )
    parser.add_argument(
        "--picks",
        action="store_true",
        help="only what compile picks on the published shapes (1B/3B/8B at 8-512 GPUs, 256 sequences "
        "a step) and the best step of each tp degree",
    )
    parser.add_argument(
        "--nanotron-space",
        action="store_true",
        help="with --picks: each shape's pick again among the plans nanotron runs (ZeRO-0/1 over all "
        "its dp ranks, no recomputation)",
    )
    parser.add_argument(
        "--job-pp-code",
        action="store_true",
        help="each pipelined row whose own job ran nanotron's pre-fix PP code (after_pp_fix False in "
        "--nanotron-csv) pays that code's polling: 0.1 s a polled wait, its busiest stage's "
        "waits a micro-batch (needs --nanotron-csv; combines with --fabric job)",
    )
    parser.add_argument(
        "--nanotron-zero1",
        action="store_true",
        help="add nanotron's own ZeRO-1 step to its rows (blocking fp32 all-reduce, a copy kernel "
        "per rank and tensor after the gather): what shardplan's shard_optimizer does not do",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="only the single-node budget: each op kind of a layer and of the head as priced, beside "
        "what the one-node tp = pp = 1 rows took a sequence",
    )
    parser.add_argument(
        "--captured-attention",
        action="store_true",
        help=f"only a LLaMA-7B layer's attention on one sequence of {CAPTURED_ATTENTION_SEQ_LEN} tokens, "
        "forward and backward, captured as compile captures it beside the hand-built chain's",
    )
    args = parser.parse_args()
    if args.nanotron_space and not args.picks:
        parser.error("--nanotron-space narrows --picks: give both")
    if (args.fabric == "job" or args.job_pp_code) and (
        args.picks or args.breakdown or not args.nanotron_csv
    ):
        parser.error(
            "--fabric job and --job-pp-code read each row's job from --nanotron-csv: give it, and not "
            "with --picks or --breakdown (which price no row's job)"
        )
    hw = get_hardware(args.hardware)
    hw = (
        with_fabric(hw, FABRICS[args.fabric], f"the {args.fabric} fabric")
        if args.fabric in FABRICS
        else hw
    )
    if args.picks:
        print_tensor_parallel_picks(hw, nanotron_space=args.nanotron_space)
        return
    if args.captured_attention:
        for source, (fwd, bwd) in attention_ms(hw, CAPTURED_ATTENTION_SEQ_LEN).items():
            print(
                f"LLaMA-7B layer, one sequence of {CAPTURED_ATTENTION_SEQ_LEN} tokens on {hw.name}, {source}: "
                f"attention forward {fwd:.3f} ms, backward {bwd:.3f} ms"
            )
        return
    rows = [r for r in read_rows(args.data) if not args.model or r.model in args.model]
    if args.breakdown:
        print_op_breakdown(rows, hw)
        return
    jobs = nanotron_jobs(args.nanotron_csv) if args.nanotron_csv else None
    outcomes = predict(
        rows,
        hw,
        nanotron_zero1=args.nanotron_zero1,
        fabric_jobs=jobs if args.fabric == "job" else None,
        pp_code_jobs=jobs if args.job_pp_code else None,
    )
    fabric = ", each row across nodes on its job's fabric" if args.fabric == "job" else ""
    pp_code = ", each pipelined row on its job's PP code" if args.job_pp_code else ""
    print(
        f"{len(rows)} rows from {os.path.normpath(args.data)} on {hw.name}{fabric}{pp_code} "
        f"(usable memory {hw.usable_memory_bytes / 2**30:.1f} GiB)\n"
    )
    print_table(score(outcomes, hw.usable_memory_bytes))
    print("\nPredicted / measured throughput, median of the rows that ran:\n")
    print_by_tp(throughput_ratios(outcomes), "pp", "{:.2f}")
    print_memory_ratios(memory_ratios(outcomes))
    print_allocated_ratios(allocated_ratios(outcomes))
    print_reservation_by_speed(reservation_by_speed(outcomes))
    print_crashed_within(crashed_within(outcomes, hw.usable_memory_bytes))
    statuses = nanotron_statuses(args.nanotron_csv) if args.nanotron_csv else None
    if statuses is not None:
        print_crashed_by_nanotron_status(
            crashed_by_nanotron_status(outcomes, hw.usable_memory_bytes, statuses)
        )
    print_communicator_bound(
        communicator_bound(outcomes, hw.usable_memory_bytes, statuses),
        hw.device_memory_bytes,
        out_of_memory=statuses is not None,
    )
    print_what_rows_show(rows)
    print_left_out([o for o in outcomes if o.reason])


PICK_SHAPES = [
    (model, gpus)
    for gpus in (8, 32, 128, 256, 512)
    for model in ("playbook-1B", "playbook-3B", "playbook-8B")
]
"""The (model, GPU count) cells where the published runs say whether tensor parallelism wins."""


def nanotron_options(chain: BlockChain) -> dict[str, Any]:
    """solve's options that leave only the plans nanotron runs: its ZeRO stages (ZERO_STAGES) over all its dp
    ranks (no replica groups), no recomputation (the published runs set none)."""
    space = dataclasses.replace(
        default_space(len(chain.blocks)),
        strategies=tuple(ZERO_STAGES.values()),
        checkpoints=(Checkpoint.NONE,),
    )
    return {"space": space, "allow_replica_groups": False}


def print_tensor_parallel_picks(hardware: HardwareProfile, nanotron_space: bool = False) -> None:
    """What compile picks for one sequence of 4096 a rank and 256 sequences a step (tests/test_published.py pins
    the picks), with the step time of the best plan of each tp degree (the pick's own, or its reasoning's; "-"
    where none fits), each plan as shardplan's runtime runs it (SHARDPLAN_RUNTIME); with `nanotron_space`, each
    shape's pick among nanotron's plans too, as nanotron runs them."""
    print(
        f"compile on {hardware.name}, 256 sequences of 4096 a step, no pipelines: step s of its pick; of the best plan "
        "at tp 1 / 2 / 4 / 8"
    )
    for model, gpus in PICK_SHAPES:
        own = llama_chain(MODELS[model], 1, 4096, pipelined=False, code=SHARDPLAN_RUNTIME)
        spaces: list[tuple[str, BlockChain, dict[str, Any]]] = [("", own, {})]
        if nanotron_space:
            nanotrons = llama_chain(MODELS[model], 1, 4096, pipelined=False)
            spaces.append(("  nanotron's plans:", nanotrons, nanotron_options(nanotrons)))
        for label, chain, options in spaces:
            plan = solve(
                chain,
                gpus,
                hardware=hardware,
                mixed_precision=BF16_MIXED,
                global_batch_size=256,
                allow_pipeline=False,
                **options,
            )
            by_tp = {
                alt.description: alt.step_time_s
                for alt in plan.reasoning.runner_ups
                if not alt.description.startswith("expert default")
            }
            best = [
                f"{plan.predicted.step_time_s:.3f}"
                if tp == plan.mesh.tp
                else next(
                    (
                        f"{t:.3f}"
                        for d, t in by_tp.items()
                        if (f"tp={tp} " in d if tp > 1 else "tp=" not in d)
                    ),
                    "-",
                )
                for tp in (1, 2, 4, 8)
            ]
            print(
                f"  {label or f'{model} {gpus:>3} GPUs:'} {plan.mesh.describe()} {plan.predicted.step_time_s:.3f} s; "
                f"{' / '.join(best)}"
            )


def print_left_out(left_out: list[Outcome]) -> None:
    """Every row that is not a plan with its reason; the tp > 1 rows counted by tp degree and reason."""
    tensor_parallel: dict[tuple[int, str], int] = defaultdict(int)
    print(f"\n{len(left_out)} rows not expressible:")
    for outcome in left_out:
        if outcome.row.tp > 1:
            tensor_parallel[outcome.row.tp, outcome.reason] += 1
        else:
            print(f"  {outcome.row.describe()}: {outcome.reason}")
    for (_, reason), count in sorted(tensor_parallel.items()):
        print(f"  {count} rows: {reason}")


if __name__ == "__main__":
    main()
