"""Time and memory of a unit, a stage and a step under given decisions, as named terms.

Plain data in, plain data out: blocks (shardplan.frontend.chain.Block) and a hardware
profile read only through `compute_time_s`, `collective_time_s`,
`overlaps_communication` and `usable_memory_bytes`. The solver composes these
same terms; `evaluate_stage`
composes them independently (an event-by-event walk), which is what the
brute force and the tests check the solver against.

[Note: the cost model] — what the runtime is expected to do, per rank
----------------------------------------------------------------------
Units run in chain order; a stage is a run of units; one replica batch is split
into `num_micro_batches` (m) micro-batches, each carrying 1/m of every
activation byte and FLOP (bytes are rounded up per micro-batch).

Memory, by category (the peak is the largest of these events):
- sharded_state: parameters + gradients + optimizer state kept between steps,
  each whole or 1/dp as the strategy's traits (plan.StrategyTraits) shard it
  (SHARD_OPTIMIZER: param + (grad + optimizer) / dp), plus a full gradient
  accumulator through the step when m > 1 in units that all-reduce once per
  step. Offloaded units keep it in CPU memory: 0 on the device. Gradients count for the whole step, as with
  zero_grad(set_to_none=False); freeing them between steps (set_to_none=True)
  lowers the real peak by up to their bytes. Gradients are in the parameters' capture dtype,
  the optimizer state is OPTIMIZER_STATE_BYTES_PER_PARAM (fp32).
- gathered_params: unsharded parameters (param dtype of mixed precision; none
  at dp = 1 unless cast to it or copied in from the host) of the unit computing, of the unit it
  prefetches, of SHARD_GRAD_OP units between their forward and backward, plus gradients
  ([Note: gradients in backward]).
- activations: what each finished block keeps for backward (saved_bytes; for
  FULL checkpointing its input_bytes; for SELECTIVE its input_bytes and
  selective_bytes, or, in a chain built by hand, a SELECTIVE_KEEP_FRACTION of
  saved_bytes; for SELECTIVE_ALTERNATE its input_bytes and alternate_bytes, or half
  SELECTIVE's share), for the micro-batches in flight: 1 (pp == 1), m (GPipe), or
  min(m, pp - stage) (1F1B; the other in-flight micro-batches hold the whole
  stage's activations); under interleaved 1F1B and the zero-bubble schedule, as their order of
  operations holds them ([Note: virtual stages and the zero-bubble schedule]).
- transient: a block's fwd_transient_bytes / bwd_transient_bytes (and for a
  checkpointed block its recomputed saved_bytes) while it runs, the backward's at whichever of its
  moments peaks once the parameter gradients there are held whole and the rest per micro-batch and
  replica batch (Block.bwd_peaks, bwd_transient_bytes below); in its backward, the
  gradient of its outputs too ([Note: a block's output gradient] at working_bytes), and the
  parameter gradients made before its peak ([Note: live parameter gradients] there).
Events: the forward of each unit (held activations of earlier units + this
unit's gathered params + the prefetched next unit's + its forward working set),
the end of forward, and the backward of each unit k (activations of units before
k + the larger of unit k's backward working set and recompute, and its gradient as
it is assembled + gathered params of unit k + the prefetched unit k-1 + SHARD_GRAD_OP
units still gathered + the reduction of unit k+1 in flight).

[Note: gradients in backward] What the runtime (runtime/scheduler.py, unit.py) allocates for
gradients in a unit's backward, beside the `.grad` kept between steps (sharded_state):
- autograd holds each parameter's gradient until the unit's last one is made, then concatenates
  them into the flat gradient (its `_GatherFlat` backward), which the unit casts to the reduce
  dtype if that differs: the parameters' gradients, the flat one and its cast at once, at the end
  of the backward, when its working set is spent (measured: a layer's activation gradients are
  freed by then, and at the working set's peak few of its parameters' gradients exist: those the
  working set holds ([Note: live parameter gradients] at working_bytes); in bf16 with fp32
  reduction a Llama layer at 2 x 64 tokens peaks there, with all three). So the backward event
  takes the larger of the working set and the assembly (UnitCost.grad_assembly_bytes), not their
  sum.
- the flat gradient is then reduced asynchronously, and the reduction is finished (its result
  added into `.grad`) only when the next unit's backward ends: through the backward of unit k,
  unit k+1's reduction stays allocated (UnitCost.reducing_bytes). What of it depends on when the
  collective runs. Beside the compute (overlaps_communication: NCCL, whose async collectives keep
  their input until the wait), a reduce-scatter holds the flat gradient and the shard it writes.
  Where collectives take the compute's cores (CPU ranks on gloo), the time model runs each one
  exposed, before the compute goes on, and so does the memory model: gloo drops a collective's
  input when it completes, so through unit k's backward only the shard waits (measured at the
  peak, a layer's backward: Mixtral's full_shard/full held the shard, not the 6.8 MiB flat
  gradient). An all-reduce writes in place:
  the flat gradient either way. None over a group of one (finished when issued), nor for a unit
  that all-reduces its step's accumulator (m > 1: that buffer is sharded_state).

Time, by component (per step):
- compute: each op kind of the block (Block.fwd_kinds / bwd_kinds: an ATen op's
  calls, FLOPs and bytes) through compute_time_s: its calls' fixed cost + the
  factor the profile measured for that op x its roofline time. A block built
  by hand has totals only: its FLOPs by roofline over its params (param dtype)
  and its input and output activations, plus its memory-bound ops (fwd_ops /
  fwd_memory_bytes): their fixed costs and the bytes they stream.
  [Note: the runtime's kernels] Beside the model's ops, the runtime (runtime/unit.py,
  collectives.py) runs kernels over each unit's parameters and gradients, priced by their bytes at
  their op's factor (runtime_kernels): per micro-batch (in compute), the casts of gathered parameters to the
  compute dtype (mixed precision), the flat gradient's assembly (GRADIENT_ASSEMBLY) and its cast to
  the reduce dtype, the adding into the accumulator (m > 1, all-reducing units), and for
  reduce-scattering units the averaging `div_` (AVERAGING) and the adding of the reduced shard into
  `.grad` (GRADIENT_ADD, after its cast to the parameters' dtype); once a step (counted in the
  optimizer term), the same averaging, cast and adding for all-reducing units, and SHARD_OPTIMIZER's
  copies around its gather of the stepped parameters (PARAMETERS_SYNC). In Mixtral's 2-rank
  shard_optimizer step on CPU they took about 4.7 ms, where the assembly's 1.5 alone was priced
  before. `.grad` is taken as kept between steps (zero_grad(set_to_none=False)), which the runtime
  adds into.
- recompute: FULL re-runs the block's forward in backward; SELECTIVE re-runs
  every forward op but the matmul-like ones whose outputs it kept
  (plan.SELECTIVE_SAVED_OPS; a hand-built block: its memory-bound ops), priced as
  in compute; SELECTIVE_ALTERNATE re-runs those and every second matmul
  (Block.alternate_recompute_kinds; a hand-built block: half its FLOP-counted ops). The dispatch
  modes of both add the profile's selective_op_overhead_s to every op the forward dispatches
  (Block.fwd_dispatches).
- views: each dispatch no op kind prices (a view; cost.unpriced_dispatches) costs the profile's
  view_overhead_s in forward, again in backward (autograd's view of its gradient) and in any recompute.
- exposed_comm: collectives not hidden by compute, each with the in-step wait
  the profile adds (hardware.py). The all-gather of the next
  unit (unit i+1 in forward, i-1 in backward) is issued when a prefetching unit
  starts computing and hides under its compute (on hardware that overlaps
  communication with compute: not CPU ranks on gloo); without prefetch it is fully
  exposed; the first unit's forward gather and the last unit's backward gather
  are exposed. A unit's gradient reduction runs beside the compute and hides
  under the backward of the unit before it; the first unit's is exposed. The
  collectives share one communication stream, in the order issued: a backward
  hides the prefetched gather only in what the reduction issued just before it
  (the next unit's, priced at this unit's size) leaves (UnitCost.free_bwd_s). Units
  that shard parameters gather every micro-batch, in forward and, when they
  reshard after it, again in backward; gradients are reduce-scattered every
  micro-batch or all-reduced once per step, and stepped slices of full
  parameters all-gathered after the step (exposed), as the traits say. Pipeline stages send the
  boundary activation (forward) and its gradient (backward) per micro-batch.
  [Note: collectives beside the compute] A collective running beside the compute takes the
  hardware's collective_compute_share of its rate (NCCL holds an SM per channel and streams
  through the same memory): compute of w seconds beside collectives of c seconds ends after
  max(c, w + share × c), so only (1 - share) × c can hide and share × c shows even when the
  collectives fit (UnitCost.contention; the window left after a reduction, free_bwd_s, is what
  the slowed compute has not done by then).
- offload: an offloaded shard is copied host→device before each gather and its
  gradient shard device→host after each reduce-scatter at OFFLOAD_BYTES_PER_S,
  not overlapped.
- optimizer: the runtime's kernels once a step ([Note: the runtime's kernels]) and its check of the
  kept gradients (GRADIENT_CHECK), then the step and zero_grad stream the rank's shard of
  parameters, gradients and optimizer state (OPTIMIZER_STEPS: 92 bytes per parameter for AdamW, not
  just the state's 16 read and written once): memory bound, each kernel at its op's measured factor,
  plus its fixed cost.
- bubble: (pp - 1) × the stage's per-micro-batch time (GPipe and 1F1B alike); (pp - 1) / v of it
  with v virtual stages per rank, less the deferred weight gradients under the zero-bubble schedule
  ([Note: virtual stages and the zero-bubble schedule]).
A stage's step time is (m + pp - 1) × its per-micro-batch time + its per-step
terms; the step time of a plan is that of its slowest stage (with virtual stages: of its slowest rank,
the sum of the rank's stages, pipeline_ranks).

[Note: virtual stages and the zero-bubble schedule] With v virtual stages per rank (interleaved 1F1B:
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
section 2.2.2) each rank runs v stages of 1/v of its work, and the pipeline fills and drains one stage
at a time: the bubble is (pp - 1) / v micro-batch times of the rank (a bubble fraction of
(pp - 1) / (v · m)), so a stage of the v counts (m + (pp - 1) / v) times its per-micro-batch time
(CostContext.pipeline_factor); the rank's time is the sum of its stages'. The zero-bubble schedule
(Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 3; torch's ScheduleInterleavedZeroBubble,
its ZB1P, which is ZB-H1 at v = 1) splits each backward into the input gradient B, sent on at once, and
the weight gradient W, deferred into the idle slots: the bubble drops from (pp - 1)(F + B + W) to
(pp - 1)(F + B - W). With B = W = half the backward's compute (the paper's assumption), that takes
(pp - 1) / v times the backward's compute off the step (CostContext.weight_grad_credit, own_time_s).
What each rank holds follows its order of operations, torch's (schedule_order: warm-up of
(v - 1) · m / rounds + f · (pp - 1 - rank) forwards, f = 2 interleaved, 1 zero-bubble, then one forward
and one backward; the zero-bubble schedule defers rank r's first W by r micro-batches): a micro-batch's
activations are held from its forward to its backward, under the zero-bubble schedule to its W (the
input-gradient pass retains the autograd graph for it). A stage is priced at the micro-batches it holds
at its rank's fullest moment (in_flight_at_peak); the rank's peak is taken over every operation of its
order, each stage holding its own state and the activations of the micro-batches it holds then, and the
stage running adding its working set (pipeline_ranks).

The 4-D mesh (plan.Mesh: pp × dp_replicate × dp_shard × tp, tp innermost):
- a block on a rank (on_rank, [Note: a block on a tp rank] in chain.py): activations and FLOPs × a
  replica's batch / the captured batch (a global batch split over dp); over tp ranks, with
  TensorParallelFacts f and t = tp where f.divides % t = 0: params = numel - f.sliced + f.sliced / t;
  FLOPs, op bytes, saved = whole - sliced + sliced / t; with sequence parallelism in a sequence layer
  all of them, and its input and output, / t (params as without), but for the pairs' inputs the
  column-parallel linears keep after the all-gather (f.gathered_saved_bytes, whole); transients
  scale as the saved bytes do, but for one whole-width tensor of the hidden states under sequence
  parallelism (f.exchange_bytes, whole), what the sliced ops make (f.sliced_fwd_transient_bytes, / t:
  a head's logits and its loss's tensors over them, where the loss runs on its vocabulary slices) and
  what their backward makes at the backward's peak (f.sliced_bwd_transient_bytes, / t), beside which,
  under sequence parallelism, a row-parallel linear's backward at the peak holds its output gradient gathered whole (f.gathered_bwd_peak_bytes); the parameter
  gradients live at the peak (Block.bwd_peak_grad_numel) as the parameters divide (f.sliced_peak_grad_numel,
  / t). Every term above then reads the rank's blocks.
- tp exchanges, per micro-batch, exposed: Σ_blocks f.all_reduces × all_reduce(f.exchange_bytes /
  m, t), or with sequence parallelism × (all_gather + reduce_scatter) of the same bytes, on the tp
  group (consecutive ranks: one node while t ≤ its devices), and a vocab-parallel head's
  f.loss_exchanges (its logits all-gathered, or a float per token twice when the loss runs on the slices).
- data-parallel groups: state shards over dp_shard (ctx.dp) only; gathers over dp_shard and
  reduce-scatters over dp_shard, then (HSDP) an all-reduce of the 1/dp_shard shard over dp_replicate;
  all-reducing strategies reduce over dp_shard × dp_replicate. A dp group's ranks stride by t, so
  max(1, devices_per_node // t) of them share a node; a replica group strides by t × dp_shard.
- pipeline sends: each rank sends its own (1/t under sequence parallelism) boundary activations,
  across nodes once the world spans them (solver/search.py, boundary_times_s).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import NamedTuple

from shardplan.common.dtypes import FLOAT_DTYPES, dtype_bytes
from shardplan.costmodel.hardware import HardwareModel
from shardplan.errors import ShardplanError
from shardplan.frontend.chain import Block, OpKind, TensorParallelFacts, merge_op_kinds
from shardplan.plan import (
    Checkpoint,
    Decision,
    ShardStrategy,
    UnitPrediction,
    kept_by_selective,
)

OPTIMIZER_STATE_BYTES_PER_PARAM = {"adamw": 8, "adam": 8, "sgd": 4, "none": 0}
"""fp32 state per parameter: Adam keeps two moments, SGD one momentum buffer."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerStep:
    """The kernels `optimizer.step(); optimizer.zero_grad(set_to_none=False)` runs over each flat shard
    of fp32 parameters it steps (the runtime gives the optimizer one shard per unit)."""

    ops: tuple[tuple[str, int], ...]
    """Each elementwise kernel: its ATen op (as the op time factors name it) and the bytes it reads
    plus writes per parameter, each kernel reading its inputs and writing its outputs once (an
    in-place op reads and writes its tensor)."""

    @property
    def bytes_per_param(self) -> int:
        return sum(nbytes for _, nbytes in self.ops)

    @property
    def kernels(self) -> int:
        return len(self.ops)


_ADAM = (
    ("lerp_", 12),
    ("mul_", 8),
    ("addcmul_", 16),
    ("sqrt", 8),
    ("div", 8),
    ("add_", 8),
    ("addcdiv_", 16),
)
_ZERO_GRAD = (("zero_", 8),)
OPTIMIZER_STEPS = {
    # torch's single-tensor Adam (CPU's default): exp_avg.lerp_, exp_avg_sq.mul_ and .addcmul_,
    # its sqrt, div and add_ (a fresh denominator), param.addcdiv_; AdamW first decays param.mul_.
    "adamw": OptimizerStep(ops=(("mul_", 8),) + _ADAM + _ZERO_GRAD),
    "adam": OptimizerStep(ops=_ADAM + _ZERO_GRAD),
    # SGD with momentum: buf.mul_ and .add_(grad), param.add_(buf).
    "sgd": OptimizerStep(ops=(("mul_", 8), ("add_", 12), ("add_", 12)) + _ZERO_GRAD),
    "none": OptimizerStep(ops=()),
}
"""Counted by running each optimizer's step under the analysis's byte rule (passes/execution.py, moved_bytes);
tests/test_cost.py checks them the same way against torch.optim."""
GRADIENT_ASSEMBLY = ("", 2)
"""The cat of a unit's parameters' gradients into its flat gradient (`_GatherFlat`'s backward), reading
and writing it once. Priced at the copy bandwidth, not at `cat`'s factor: the calibration's cats are
the models' small ones, hot in cache (0.6 of the copy bandwidth's time on a CPU rank), where Mixtral's
7 MB gradients' took 0.9-1.7 times it."""
GRADIENT_CHECK = ("any", 4)
"""What the runtime reads of each unit's kept gradient at a step's start (runtime/sharded.py, all_zeros):
one `any` over it, 4 bytes a float32 parameter."""
AVERAGING = ("div_", 2)
"""What the runtime runs over a gradient before each reduction (runtime/collectives.py, [Note: averaging]):
a `div_` by the group's size, in place, reading and writing its bytes once."""
GRADIENT_ADD = ("add_", 3)
"""How the runtime adds a gradient into another, in place: a reduced one into `.grad` (runtime/unit.py,
finish_reduction) or a micro-batch's into the step's accumulator. It reads both and writes one, 3
bytes a byte of the sum."""
PARAMETERS_SYNC = (("clone", 2), ("copy_", 3))
"""What SHARD_OPTIMIZER's runtime runs around its all-gather after a step (runtime/unit.py, _sync_full):
a clone of the stepped shard (2 bytes a byte of it), which it gathers, then a `copy_` of the gathered
parameters into the full buffer (3 bytes a byte of it, as the analysis counts `copy_`)."""
SELECTIVE_KEEP_FRACTION = 0.5
"""Share of saved_bytes selective checkpointing keeps in a block the analysis did not measure
(a chain built by hand: _selective_measured): the matmul outputs of a transformer layer
are about half its saved bytes (Korthikanti et al. 2022, with flash attention)."""
OFFLOAD_BYTES_PER_S = 25e9
"""Effective host↔device copy rate (PCIe Gen5 x16 at about 40% of line rate with pinned buffers)."""
CPU_MEMORY_BYTES_PER_S = 50e9
"""Host memory bandwidth an offloaded optimizer step streams through."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CostContext:
    """Everything about the step that is not a per-unit decision."""

    hardware: HardwareModel
    dp: int
    """Ranks a unit's state is sharded over and gathered from: the mesh's dp_shard."""
    dp_replicate: int = 1
    """Groups of `dp` ranks holding the same shards (HSDP), whose gradients are all-reduced across groups."""
    tp: int = 1
    sequence_parallel: bool = False
    cp: int = 1
    """Ranks one sequence is split over (context parallelism): batch_scale holds their 1/cp share of the
    tokens, and attention gathers the whole sequence's keys and values ([Note: a block on a cp rank])."""
    ep: int = 1
    """Ranks the routed experts are split over, borrowed from the dp × cp ranks ([Note: experts on an
    ep rank])."""
    batch_scale: float = 1.0
    """A replica's batch over the batch the chain was captured with, per cp rank: activations and FLOPs
    scale by it."""
    num_micro_batches: int = 1
    in_flight: int = 1
    """Micro-batches whose activations a rank of this stage holds at once."""
    pipeline_degree: int = 1
    """pp: the stage's per-micro-batch time counts (m + pp - 1) times in the step."""
    schedule: str = "none"
    """The pipeline schedule (plan.SCHEDULE_NAMES)."""
    virtual_stages: int = 1
    """Stages per pipeline rank (v)."""
    stage: int = 0
    """The stage priced (0 .. pp · v - 1); it runs on pipeline rank stage mod pp."""
    param_dtype: str = "float32"
    reduce_dtype: str = "float32"
    optimizer: str = "adamw"
    runtime: "Runtime | None" = None
    """The kernels the runtime executing the plan runs around its collectives ([Note: the runtime's
    kernels]); None: shardplan's own (runtime_kernels). Runs of another runtime are priced with that
    runtime's (benchmarks/bench_published.py: nanotron's), not with shardplan's on top."""

    @property
    def bubble_share(self) -> float:
        """Micro-batch times of this stage its rank idles in the bubble: (pp - 1) / v ([Note: virtual
        stages and the zero-bubble schedule])."""
        return (self.pipeline_degree - 1) / self.virtual_stages

    @property
    def pipeline_factor(self) -> float:
        """Times the stage's per-micro-batch time counts in the step: m, and the bubble."""
        return self.num_micro_batches + self.bubble_share

    @property
    def weight_grad_credit(self) -> float:
        """Times the backward's compute leaves the step: the zero-bubble schedule fills the bubble with
        deferred weight gradients ([Note: virtual stages and the zero-bubble schedule])."""
        return self.bubble_share if self.schedule == "zero_bubble" else 0.0

    def ranks_per_node(self, stride: int) -> int:
        """Ranks of one group sharing a node when its members sit `stride` ranks apart ([Note: rank
        layout] in plan.py): a node's devices // stride, at least 1; 0 (fills nodes) on a hardware
        model without a node size."""
        devices = getattr(self.hardware, "devices_per_node", 0)
        return max(1, devices // stride) if devices else 0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZER_STATE_BYTES_PER_PARAM:
            raise ShardplanError(
                f"unknown optimizer {self.optimizer!r}: use one of "
                f"{', '.join(sorted(OPTIMIZER_STATE_BYTES_PER_PARAM))}"
            )
        for dtype in (self.param_dtype, self.reduce_dtype):
            if dtype not in FLOAT_DTYPES:
                raise ShardplanError(
                    f"unknown dtype {dtype!r}: use one of {', '.join(sorted(FLOAT_DTYPES))}"
                )


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitCost:
    """One unit's own terms; the coupling with its neighbours is in `pair_exposed_s`."""

    state_bytes: int
    """Sharded state kept on the device between steps."""
    activation_bytes: int
    """Kept for backward per micro-batch."""
    gathered_bytes: int
    """Unsharded parameters while gathered (0 when never gathered)."""
    gathered_fwd_bytes: int
    """What a prefetch of this unit's forward gather allocates."""
    gathered_bwd_bytes: int
    """What a prefetch of this unit's backward gather allocates (FULL_SHARD only)."""
    kept_gathered_bytes: int
    """SHARD_GRAD_OP: stays gathered from forward to backward."""
    grad_assembly_bytes: int
    """The parameters' gradients beside the flat gradient they are concatenated into, at the end of
    the unit's backward ([Note: gradients in backward])."""
    reducing_bytes: int
    """What the unit's gradient reduction holds while in flight, through the backward of the unit
    before it ([Note: gradients in backward])."""
    fwd_working: tuple[int, int]
    """(activations, transient) of the unit's forward at its peak, above earlier units' holdings."""
    bwd_working: tuple[int, int]
    """(activations, transient) of the unit's backward (recompute included) at its peak."""
    compute_fwd_s: float
    compute_bwd_s: float
    recompute_s: float
    gather_fwd_s: float
    gather_bwd_s: float
    reduce_s: float
    """Per micro-batch (sharded) or per step (REPLICATE / SHARD_OPTIMIZER): see reduce_per_step."""
    reduce_per_step: bool
    post_step_gather_s: float
    offload_s: float
    """Per micro-batch host↔device copies."""
    optimizer_s: float
    runtime_step_s: float
    """The runtime's kernels once a step, counted in the optimizer term: around an all-reduce of the step's
    gradient, and SHARD_OPTIMIZER's around its gather after the step ([Note: the runtime's kernels])."""
    tensor_parallel_s: float
    """Per micro-batch exchanges of the tp ranks, and of the cp ranks (context_parallel_s), exposed."""
    prefetch: bool
    hide_fwd_s: float
    """Forward compute that collectives issued beside it can hide under: compute_fwd_s, or 0 on
    hardware whose collectives take the cores the compute needs (overlaps_communication)."""
    hide_bwd_s: float
    """The same for the backward (recompute included)."""
    contention: float
    """Share of a collective's time the compute beside it loses (HardwareProfile.collective_compute_share;
    0 where nothing overlaps): only the rest of the collective can hide ([Note: collectives beside the compute])."""

    @property
    def bwd_window_s(self) -> float:
        return self.compute_bwd_s + self.recompute_s

    @property
    def free_bwd_s(self) -> float:
        """Backward compute left to hide the previous unit's prefetched gather: one communication
        stream runs the collectives in the order issued, and the next unit's reduction, issued as
        this backward starts, goes first (priced as this unit's own, its neighbour's size)."""
        return max(
            0.0,
            self.hide_bwd_s
            - (0.0 if self.reduce_per_step else self.reduce_s * (1 - self.contention)),
        )


def on_rank(block: Block, ctx: CostContext) -> Block:
    """`block` as one rank runs it: a replica's batch (ctx.batch_scale of the captured one), and over
    ctx.tp ranks what the block's TensorParallelFacts slice divided by tp ([Note: a block on a tp rank]
    in chain.py). Transients and the memory-bound ops' bytes scale as the saved activations do (an
    approximation: the analysis does not split them by op), but under sequence parallelism the
    whole-width tensor exchanged around a pair (TensorParallelFacts.exchange_bytes) stays whole, what the
    sliced ops make in forward (sliced_fwd_transient_bytes: a head's logits and its loss's tensors over
    them, where the loss runs on its vocabulary slices) is 1/tp, and the part of the backward's peak the
    sliced ops make (sliced_bwd_transient_bytes) is 1/tp, beside which a
    row-parallel linear's peak holds its output gradient gathered whole under sequence parallelism
    (gathered_bwd_peak_bytes)."""
    facts = block.tensor_parallel
    sliced = facts is not None and facts.slices_at(ctx.tp)
    if ctx.cp > 1:
        return _gathering_keys(_on_tp_rank(block, ctx, facts, sliced), block, ctx, sliced)
    return _on_tp_rank(block, ctx, facts, sliced)


def _gathering_keys(block: Block, whole: Block, ctx: CostContext, sliced: bool) -> Block:
    """[Note: a block on a cp rank] A cp rank computes 1/cp of the tokens (ctx.batch_scale holds the
    share): every token-wise op, and attention's queries over all keys, which the zigzag split balances
    exactly (context_parallel.py). Its attention's keys and values are gathered whole over the cp
    group: autograd saves them for the backward, whose gradients of them are whole too until the
    reduce-scatter, so both hold the whole sequence's (its attention_kv_bytes, as it now counts them)."""
    tp = ctx.tp if sliced else 1
    local = round(whole.attention_kv_bytes * ctx.batch_scale / tp)
    gathered = local * ctx.cp
    return replace(
        block,
        attention_kv_bytes=gathered,
        saved_bytes=block.saved_bytes + gathered - local,
        bwd_transient_bytes=block.bwd_transient_bytes + gathered - local,
    )


def _on_tp_rank(
    block: Block, ctx: CostContext, facts: TensorParallelFacts | None, sliced: bool
) -> Block:
    if ctx.batch_scale == 1 and not sliced:
        return block
    scale, tp = ctx.batch_scale, ctx.tp if sliced else 1
    everything = sliced and ctx.sequence_parallel and facts.sequence_layer  # type: ignore[union-attr]
    rest_scale = scale / tp if everything else scale  # what the facts do not slice
    parts = facts if sliced else None

    def split(total: int, part: int) -> int:
        return round((total - part) * rest_scale + part * scale / tp)

    def kinds(whole: tuple[OpKind, ...], part: tuple[OpKind, ...]) -> tuple[OpKind, ...]:
        """Each kind with its share of the sliced part of its name (a name may come in several kinds:
        the part is spread over them in proportion)."""
        totals, cuts = merge_op_kinds([whole]), {kind.name: kind for kind in merge_op_kinds([part])}
        share = {
            total.name: (
                (cuts[total.name].flops / total.flops if total.flops else 0.0),
                (cuts[total.name].bytes - cuts[total.name].weight_bytes)
                / max(1, total.bytes - total.weight_bytes),
                cuts[total.name].weight_bytes / max(1, total.weight_bytes),
            )
            for total in totals
            if total.name in cuts
        }
        found = []
        for kind in whole:
            flops, moved, weights = share.get(kind.name, (0.0, 0.0, 0.0))
            activations = kind.bytes - kind.weight_bytes
            cut_weights = round(kind.weight_bytes * weights)
            weight_bytes = kind.weight_bytes - cut_weights + cut_weights // tp
            on_rank_flops = split(kind.flops, round(kind.flops * flops))
            found.append(
                OpKind(
                    name=kind.name,
                    calls=kind.calls,
                    flops=on_rank_flops,
                    bytes=split(activations, round(activations * moved)) + weight_bytes,
                    weight_bytes=weight_bytes,
                    masked_flops=kind.masked_flops * on_rank_flops // max(1, kind.flops),
                    head_dim_flops=kind.head_dim_flops * on_rank_flops // max(1, kind.flops),
                )
            )
        return tuple(found)

    cut_numel = parts.sliced_numel if parts else 0
    numel = block.param_numel - cut_numel + -(-cut_numel // tp)
    saved = split(block.saved_bytes, parts.sliced_saved_bytes if parts else 0)
    if everything:  # the pairs' inputs are saved after sequence parallelism's all-gather: whole
        saved += round(parts.gathered_saved_bytes * (scale - rest_scale))  # type: ignore[union-attr]
    ratio = saved / block.saved_bytes if block.saved_bytes else rest_scale
    whole = parts.exchange_bytes if everything else 0  # type: ignore[union-attr]
    # what the sliced ops' backward makes at its peak divides by tp, not at the saved ratio, which keeps the
    # norms' and residual adds' whole share; under sequence parallelism a row-parallel linear's backward at
    # the peak holds its output gradient gathered whole beside it (both measured: benchmarks/probe_rank_peak.py)
    divided = parts.sliced_bwd_transient_bytes if sliced else 0  # type: ignore[union-attr]
    made = parts.sliced_fwd_transient_bytes if sliced else 0  # type: ignore[union-attr]
    gathered = parts.gathered_bwd_peak_bytes if everything else 0  # type: ignore[union-attr]
    cut_grads = parts.sliced_peak_grad_numel if sliced else 0  # type: ignore[union-attr]

    def transient(total: int, cut: int = 0, beside: int = 0) -> int:
        """Of a transient, the whole-width part stays whole (or, held `beside` it, is added whole), the sliced
        part `cut` is 1/tp; the rest scales as the saved bytes do."""
        kept = 0 if beside else min(total, whole)
        cut = min(cut, total - kept)
        return round((total - kept - cut) * ratio + (kept + beside) * scale + cut * scale / tp)

    return replace(
        block,
        param_numel=numel,
        param_bytes=block.param_bytes * numel // block.param_numel
        if block.param_numel
        else block.param_bytes,
        fwd_flops=split(block.fwd_flops, parts.sliced_fwd_flops if parts else 0),
        bwd_flops=split(block.bwd_flops, parts.sliced_bwd_flops if parts else 0),
        saved_bytes=saved,
        input_bytes=round(block.input_bytes * rest_scale),
        output_bytes=round(block.output_bytes * rest_scale),
        fwd_transient_bytes=transient(block.fwd_transient_bytes, made),
        recompute_transient_bytes=(
            None
            if block.recompute_transient_bytes is None
            else transient(block.recompute_transient_bytes, made)
        ),
        bwd_transient_bytes=transient(block.bwd_transient_bytes, divided, gathered),
        # the gradients at a moment do not grow with the batch (sliced ones divide by tp); the rest scales as
        # the transient does
        bwd_peaks=tuple(
            (-(-grads // tp), transient(other, max(divided - grads, 0), gathered))
            for grads, other in block.bwd_peaks
        ),
        bwd_peak_grad_numel=block.bwd_peak_grad_numel - cut_grads + -(-cut_grads // tp),
        fwd_memory_bytes=round(block.fwd_memory_bytes * ratio),
        bwd_memory_bytes=round(block.bwd_memory_bytes * ratio),
        selective_bytes=round(block.selective_bytes * ratio),
        selective_saved_bytes=round(block.selective_saved_bytes * ratio),
        selective_dropped_bytes=round(block.selective_dropped_bytes * ratio),
        alternate_bytes=round(block.alternate_bytes * ratio),
        alternate_saved_bytes=round(block.alternate_saved_bytes * ratio),
        alternate_dropped_bytes=round(block.alternate_dropped_bytes * ratio),
        alternate_recompute_kinds=kinds(
            block.alternate_recompute_kinds,
            _share_of(block.alternate_recompute_kinds, block.fwd_kinds, parts.fwd_kinds)
            if parts
            else (),
        ),
        fwd_kinds=kinds(block.fwd_kinds, parts.fwd_kinds if parts else ()),
        bwd_kinds=kinds(block.bwd_kinds, parts.bwd_kinds if parts else ()),
    )


def _share_of(
    kinds: tuple[OpKind, ...], whole: tuple[OpKind, ...], part: tuple[OpKind, ...]
) -> tuple[OpKind, ...]:
    """Of `kinds` (some of the calls of `whole`'s), the sliced part: `part`'s share of `whole` by name, each
    count in proportion (the matmuls SELECTIVE_ALTERNATE re-runs slice as the block's matmuls do)."""
    totals = {kind.name: kind for kind in merge_op_kinds([whole])}
    cuts = {kind.name: kind for kind in merge_op_kinds([part])}

    def share(count: str, kind: OpKind) -> int:
        total = getattr(totals[kind.name], count)
        return getattr(kind, count) * getattr(cuts[kind.name], count) // total if total else 0

    return tuple(
        OpKind(name=kind.name, calls=kind.calls, **{c: share(c, kind) for c in _SHARED_COUNTS})
        for kind in merge_op_kinds([kinds])
        if kind.name in cuts and kind.name in totals
    )


_SHARED_COUNTS = tuple(f.name for f in fields(OpKind) if f.name not in ("name", "calls"))
"""OpKind's counts a share of its calls' work takes in proportion; each call still runs on every rank."""


def context_parallel_s(blocks: tuple[Block, ...], ctx: CostContext) -> float:
    """The cp ranks' exchanges of one micro-batch (on_rank's blocks, [Note: a block on a cp rank]): each
    attention's keys and values all-gathered in forward and their gradients reduce-scattered in
    backward, over the cp group (ranks tp apart). Not hidden: attention waits for its keys."""
    if ctx.cp == 1:
        return 0.0
    total = 0.0
    for block in blocks:
        each = -(-block.attention_kv_bytes // (2 * ctx.num_micro_batches))  # keys, then values
        if each:
            total += 2 * sum(
                ctx.hardware.collective_time_s(
                    kind, each, ctx.cp, ranks_per_node=ctx.ranks_per_node(ctx.tp)
                )
                for kind in ("all_gather_into_tensor", "reduce_scatter_tensor")
            )
    return total


def expert_parallel_s(blocks: tuple[Block, ...], ctx: CostContext) -> float:
    """The ep ranks' exchanges of one micro-batch ([Note: experts on an ep rank]): each block's routed
    hidden states dispatched to their experts' ranks and combined back in forward, and their gradients
    the same two ways in backward, by all-to-all over the ep group (consecutive ranks). An all-to-all
    sends and receives (ep - 1) / ep of each rank's buffer, as an all-gather's ring does: it is priced
    as one (no profile calibrates all-to-all). Not hidden: the experts wait for their tokens."""
    if ctx.ep == 1:
        return 0.0
    total = 0.0
    for block in blocks:
        routed = block.routed_elements * ctx.batch_scale / ctx.num_micro_batches
        if routed:
            total += 4 * ctx.hardware.collective_time_s(
                "all_gather_into_tensor",
                routed * dtype_bytes(ctx.param_dtype),
                ctx.ep,
                ranks_per_node=ctx.ranks_per_node(ctx.tp),
            )
    return total


def _experts_on_rank(
    blocks: tuple[Block, ...], ctx: CostContext
) -> tuple[tuple[Block, ...], "UnitSizes | None"]:
    """[Note: experts on an ep rank] At ep > 1 an ep rank holds 1/ep of each block's routed experts
    whole, in a REPLICATE unit of their own beside the planned unit (runtime/expert_parallel.py), its
    gradient all-reduced over the dp × cp / ep ranks holding the same experts. Returns the blocks with
    that share of the experts counted in their parameters (the gradients their backward holds), and the
    experts' sizes on this rank (None without experts or at ep = 1), which the unit's terms then count
    apart from the planned unit's. Routed tokens are balanced in expectation: every ep rank is priced as
    computing 1/ep of the routed work, which on_rank leaves whole: its FLOPs are counted as if the rank
    ran all of its own tokens' experts, the same total."""
    expert_numel = sum(block.expert_param_numel for block in blocks)
    if ctx.ep == 1 or not expert_numel:
        return blocks, None
    kept = tuple(
        replace(
            block,
            param_numel=block.param_numel - block.expert_param_numel,
            param_bytes=block.param_bytes
            - block.param_bytes * block.expert_param_numel // block.param_numel,
        )
        for block in blocks
    )
    storage = sum(block.param_bytes for block in blocks) - sum(block.param_bytes for block in kept)
    numel = expert_numel // ctx.ep
    return kept, UnitSizes(
        numel=numel,
        storage_bytes=storage // ctx.ep,
        param_bytes=numel * dtype_bytes(ctx.param_dtype),
        grad_bytes=numel * dtype_bytes(ctx.reduce_dtype),
        optimizer_bytes=numel * OPTIMIZER_STATE_BYTES_PER_PARAM[ctx.optimizer],
    )


def tensor_parallel_s(blocks: tuple[Block, ...], ctx: CostContext) -> float:
    """The tp ranks' exchanges of one micro-batch ([Note: a block on a tp rank] in chain.py), on the tp
    group: consecutive ranks, inside a node while tp divides its devices. Not hidden: the runtime
    waits for each before the next op."""

    def per_micro_batch(nbytes: int) -> int:
        return -(-round(nbytes * ctx.batch_scale) // ctx.num_micro_batches)

    total = 0.0
    for block in blocks:
        facts = block.tensor_parallel
        if facts is None or not facts.slices_at(ctx.tp):
            continue
        kinds = (
            ("all_gather_into_tensor", "reduce_scatter_tensor")
            if ctx.sequence_parallel
            else ("all_reduce",)
        )
        total += facts.all_reduces * sum(
            ctx.hardware.collective_time_s(kind, per_micro_batch(facts.exchange_bytes), ctx.tp)
            for kind in kinds
        )
        total += sum(
            ctx.hardware.collective_time_s(kind, per_micro_batch(nbytes), ctx.tp)
            for kind, nbytes in facts.loss_exchanges
        )
    return total


def _block_times_s(block: Block, ctx: CostContext) -> tuple[float, float, dict[Checkpoint, float]]:
    """(forward, backward, recompute by checkpoint mode) seconds of one block for one micro-batch.

    Each op kind the analysis counted pays its calls' fixed cost plus the factor the profile
    measured for it times its roofline time (per micro-batch: 1/m of its FLOPs and activation
    bytes, all of its parameter bytes). FULL re-runs the forward; SELECTIVE re-runs every forward op
    but the matmul-like ones it keeps (SELECTIVE_SAVED_OPS), SELECTIVE_ALTERNATE those and the matmuls it
    does not keep (Block.alternate_recompute_kinds); the selective modes' dispatch modes cost each op the
    forward dispatches a fixed cost of their own (views included; they see it in forward and in
    recompute: 30-60 us an op on a CPU rank, ten times a kernel's). Views cost their own fixed cost
    in forward, backward and any recompute (unpriced_dispatches).
    A chain built by hand has only totals: its FLOP-counted ops are priced together by roofline
    over the parameters and the block's input and output, its memory-bound ops by their bytes; of those
    SELECTIVE re-runs the memory-bound ones, SELECTIVE_ALTERNATE half the FLOP-counted ones too."""
    hw = ctx.hardware
    if block.fwd_kinds or block.bwd_kinds:
        fwd = [kind_time_s(kind, ctx) for kind in block.fwd_kinds]
        views_s = unpriced_dispatches(block) * hw.view_overhead_s
        selective = (
            sum(s for kind, s in zip(block.fwd_kinds, fwd) if not kept_by_selective(kind.name))
            + views_s
            + block.fwd_dispatches * hw.selective_op_overhead_s
        )
        forward = sum(fwd) + views_s
        backward = sum(kind_time_s(kind, ctx) for kind in block.bwd_kinds) + views_s
        alternate = selective + sum(kind_time_s(k, ctx) for k in block.alternate_recompute_kinds)
    else:
        moved = block.param_numel * dtype_bytes(ctx.param_dtype) + _per_micro_batch(
            block.input_bytes + block.output_bytes, ctx
        )
        selective = _memory_bound_s(hw, block.fwd_memory_bytes, block.fwd_ops, ctx)
        arithmetic = _arithmetic_s(hw, block.fwd_flops, moved, block.fwd_ops, ctx)
        forward = arithmetic + selective
        backward = _arithmetic_s(
            hw, block.bwd_flops, 2 * moved, block.bwd_ops, ctx
        ) + _memory_bound_s(hw, block.bwd_memory_bytes, block.bwd_ops, ctx)
        alternate = selective + arithmetic / 2
    return (
        forward,
        backward,
        {
            Checkpoint.FULL: forward,
            Checkpoint.SELECTIVE: selective,
            Checkpoint.SELECTIVE_ALTERNATE: alternate,
        },
    )


def kind_time_s(kind: OpKind, ctx: CostContext) -> float:
    """Seconds of one op kind's calls for one micro-batch: 1/m of its FLOPs and activation bytes, all of its
    parameter bytes, at the factor and fixed cost the profile measured for it."""
    moved = kind.weight_bytes + _per_micro_batch(kind.bytes - kind.weight_bytes, ctx)
    return ctx.hardware.compute_time_s(
        kind.flops / ctx.num_micro_batches,
        moved,
        ctx.param_dtype,
        calls=kind.calls,
        op=kind.name,
        masked_flops=kind.masked_flops / ctx.num_micro_batches,
        head_dim=kind.head_dim_flops / kind.flops if kind.flops else 0.0,
    )


def unpriced_dispatches(block: Block) -> int:
    """Ops the block's forward dispatches that no op kind prices: views, and ops that move nothing
    (_unsafe_view). Each costs the profile's view_overhead_s in forward, and again in backward,
    where autograd dispatches a view of its gradient ([Note: views' fixed cost] in calibrate.py)."""
    # a block given op kinds but no dispatch count (fwd_dispatches 0, e.g. built by hand) prices no views
    return max(
        0,
        block.fwd_dispatches
        - sum(kind.calls for kind in block.fwd_kinds if kind.flops or kind.bytes),
    )


def _memory_bound_s(hw: HardwareModel, memory_bytes: int, ops: int, ctx: CostContext) -> float:
    """A hand-built block's memory-bound ops for one micro-batch: each pays a fixed cost and streams
    its bytes. Blocks built without op counts cost nothing here."""
    if ops == 0:
        return 0.0
    return hw.compute_time_s(0, _per_micro_batch(memory_bytes, ctx), ctx.param_dtype, calls=ops)


def _arithmetic_s(
    hw: HardwareModel, flops: int, moved_bytes: int, ops: int, ctx: CostContext
) -> float:
    """A hand-built block's FLOP-counted ops for one micro-batch, by roofline over the bytes they
    stream. A block without any whose ops were counted (an embedding, a norm) pays nothing here."""
    if flops == 0 and ops:
        return 0.0
    return hw.compute_time_s(flops / ctx.num_micro_batches, moved_bytes, ctx.param_dtype)


def _per_micro_batch(nbytes: int, ctx: CostContext) -> int:
    return -(-nbytes // ctx.num_micro_batches)


def _kept_bytes(block: Block, checkpoint: Checkpoint, ctx: CostContext) -> int:
    if checkpoint is Checkpoint.FULL:
        return _per_micro_batch(block.input_bytes, ctx)
    if checkpoint.selective:
        if _selective_measured(block):  # the block's input and the outputs the mode keeps
            return _per_micro_batch(block.input_bytes + _selective_keeps(block, checkpoint)[0], ctx)
        share = SELECTIVE_KEEP_FRACTION / (2 if checkpoint is Checkpoint.SELECTIVE_ALTERNATE else 1)
        return _per_micro_batch(math.ceil(block.saved_bytes * share), ctx)
    return _per_micro_batch(block.saved_bytes, ctx)


def _selective_keeps(block: Block, checkpoint: Checkpoint) -> tuple[int, int, int]:
    """(the outputs kept, of saved_bytes those kept, of the outputs kept those its recompute drops) of a
    block under a selective mode: Block.selective_bytes, selective_saved_bytes, selective_dropped_bytes
    or their SELECTIVE_ALTERNATE counterparts."""
    if checkpoint is Checkpoint.SELECTIVE_ALTERNATE:
        return block.alternate_bytes, block.alternate_saved_bytes, block.alternate_dropped_bytes
    return block.selective_bytes, block.selective_saved_bytes, block.selective_dropped_bytes


def _selective_measured(block: Block) -> bool:
    """Whether what selective checkpointing keeps of the block is known: its matmul-like outputs are given,
    or the analysis measured the block (it counts the ops each block dispatches), which keeps its input
    alone where it has none (an embedding, a norm). A chain built by hand carries neither count."""
    return bool(block.selective_bytes or block.fwd_dispatches)


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitSizes:
    """A unit's parameters counted in the bytes each term below moves or keeps."""

    numel: int
    storage_bytes: int
    """The parameters as stored (their capture dtype), which the optimizer steps."""
    param_bytes: int
    """The parameters in mixed precision's param_dtype: what a gather moves."""
    grad_bytes: int
    """The gradient in mixed precision's reduce_dtype: what a reduction moves."""
    optimizer_bytes: int

    @classmethod
    def of(cls, blocks: tuple[Block, ...], ctx: CostContext) -> "UnitSizes":
        numel = sum(b.param_numel for b in blocks)
        return cls(
            numel=numel,
            storage_bytes=sum(b.param_bytes for b in blocks),
            param_bytes=numel * dtype_bytes(ctx.param_dtype),
            grad_bytes=numel * dtype_bytes(ctx.reduce_dtype),
            optimizer_bytes=numel * OPTIMIZER_STATE_BYTES_PER_PARAM[ctx.optimizer],
        )


def accumulates_grads(decision: Decision, ctx: CostContext) -> bool:
    """Whether micro-batches' gradients are summed in a full buffer before one reduction per step
    ([Note: gradient accumulation] in runtime/unit.py)."""
    return not decision.traits.reduce_scatters_grads and ctx.num_micro_batches > 1


def state_bytes(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> int:
    """Parameters, gradient and optimizer state kept on the device between steps: each whole, or the
    rank's 1/dp of it where the strategy shards it; none when offloaded."""
    if decision.offload:
        return 0
    traits = decision.traits
    params, rest = (
        sizes.storage_bytes,
        sizes.storage_bytes + sizes.optimizer_bytes,
    )  # rest: gradient, optimizer
    whole = (0 if traits.shards_params else params) + (0 if traits.shards_optimizer else rest)
    sliced = (params if traits.shards_params else 0) + (rest if traits.shards_optimizer else 0)
    accumulator = sizes.grad_bytes if accumulates_grads(decision, ctx) else 0
    return whole + -(-sliced // ctx.dp) + accumulator


def gathered_bytes(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> int:
    """A unit's parameters in the compute dtype while in use, beside its stored ones. A sharded unit's
    gathered buffer: over a single rank a gather returns the shard itself, so only a cast to the compute
    dtype, or a copy in from the host, allocates ([Note: groups of one] in runtime/collectives.py). A unit
    keeping its parameters whole allocates only their cast to the compute dtype (mixed precision), whose
    views autograd saves from the unit's forward to its backward, as SHARD_GRAD_OP keeps its gathered
    buffer (measured in bf16 on CPU: REPLICATE and SHARD_OPTIMIZER held the model's bf16 copy)."""
    cast = sizes.param_bytes != sizes.storage_bytes
    if decision.traits.shards_params:
        return sizes.param_bytes if ctx.dp > 1 or cast or decision.offload else 0
    return sizes.param_bytes if cast else 0


def grad_assembly_bytes(sizes: UnitSizes) -> int:
    """The parameters' gradients (param dtype), the flat gradient they are concatenated into, and its
    cast to the reduce dtype where that differs ([Note: gradients in backward])."""
    cast = sizes.grad_bytes if sizes.grad_bytes != sizes.param_bytes else 0
    return 2 * sizes.param_bytes + cast


def reducing_bytes(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> int:
    """What the unit's reduction holds until it is finished ([Note: gradients in backward]): the shard
    a reduce-scatter writes, and its flat gradient where the collective runs beside the compute; an
    all-reduce's flat gradient; none where the reduction is finished when issued (a group of one) or
    reduces the step's accumulator (counted in state_bytes)."""
    if decision.traits.reduce_scatters_grads:
        if ctx.dp == 1:
            return 0
        shard = -(-sizes.grad_bytes // ctx.dp)
        return shard + (sizes.grad_bytes if ctx.hardware.overlaps_communication else 0)
    if accumulates_grads(decision, ctx) or ctx.dp * ctx.dp_replicate == 1:
        return 0
    return sizes.grad_bytes


def working_bytes(
    blocks: tuple[Block, ...], checkpoint: Checkpoint, ctx: CostContext
) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """(activations kept for backward, forward working set, backward working set) of one micro-batch;
    a working set is (activations, transient) at its peak, above earlier units' holdings.

    [Note: a block's output gradient] A block's backward begins holding the gradient of its outputs,
    which the block after it made (output_bytes: a GPT layer's hidden states; none at the loss's
    block), and holds it through its recompute and until its own ops have read it. The analysis
    measured bwd_transient_bytes above what was live as the backward began, that gradient included,
    so it is added here. A fully checkpointed block's recompute saves its kept input again, the same
    tensor: of its saved bytes that share is held already. A selectively checkpointed block's backward
    holds it too, beside what its recompute brings back less the kept outputs the recompute drops
    (Block.selective_dropped_bytes: traced op by op on Llama, benchmarks/probe_rank_peak.py). On a GPT
    layer the one dropped output, the attention projection's, is as wide as the gradient, so the two
    cancel; on Llama its query and key projections are dropped too (0.75 MiB more). A block built by
    hand carries no dropped bytes: the two are taken to cancel.

    [Note: live parameter gradients] The runtime holds each parameter's gradient until its unit's last one
    is made ([Note: gradients in backward]), whatever the strategy: the `.grad` the state term counts is
    another tensor, added into after the reduction. So a block's backward peak holds, beside its
    transient, the gradients its backward made before the op at the peak (Block.bwd_peak_grad_numel: a
    GPT-2 layer peaks in its GELU's backward, after its output projection's), and those of the unit's
    blocks after it, whose backward ran first; in the parameters' compute dtype, per micro-batch whole."""
    kept = [_kept_bytes(b, checkpoint, ctx) for b in blocks]
    grad_bytes = dtype_bytes(ctx.param_dtype)
    later_numel = sum(
        b.param_numel for b in blocks
    )  # of the blocks after this one: their backward ran first
    fwd_working, bwd_working, running = (sum(kept), 0), (0, 0), 0
    for block, kept_bytes in zip(blocks, kept):
        later_numel -= block.param_numel
        fwd_transient = _per_micro_batch(block.fwd_transient_bytes, ctx)
        bwd_transient = bwd_transient_bytes(block, ctx) + block.bwd_peak_grad_numel * grad_bytes
        output_grad = _per_micro_batch(block.output_bytes, ctx)
        saved = _per_micro_batch(block.saved_bytes, ctx)
        fwd_working = max(fwd_working, (running, fwd_transient), key=sum)
        if (
            checkpoint is Checkpoint.FULL
        ):  # recompute from the kept input, then the block's backward
            recomputed = saved - min(kept_bytes, saved)
            rerun = (
                block.fwd_transient_bytes
                if block.recompute_transient_bytes is None
                else block.recompute_transient_bytes
            )
            transient = output_grad + max(_per_micro_batch(rerun, ctx), recomputed + bwd_transient)
        elif (
            checkpoint.selective
        ):  # the recompute brings back what was not kept before the backward
            transient = (
                _selective_backward_start(block, checkpoint, saved, kept_bytes, output_grad, ctx)
                + bwd_transient
            )
        else:
            transient = output_grad + bwd_transient
        working = (running + kept_bytes, transient + later_numel * grad_bytes)
        bwd_working = max(bwd_working, working, key=sum)
        running += kept_bytes
    return sum(kept), fwd_working, bwd_working


def bwd_transient_bytes(block: Block, ctx: CostContext) -> int:
    """A block's backward transient for one micro-batch: of the moments it may peak (Block.bwd_peaks), the
    one holding the most with its parameter gradients whole (they do not split over micro-batches) and
    the rest per micro-batch; a block built by hand, its transient per micro-batch."""
    if not block.bwd_peaks:
        return _per_micro_batch(block.bwd_transient_bytes, ctx)
    return max(grads + _per_micro_batch(other, ctx) for grads, other in block.bwd_peaks)


def _selective_backward_start(
    block: Block, checkpoint: Checkpoint, saved: int, kept: int, output_grad: int, ctx: CostContext
) -> int:
    """What a selectively checkpointed block's backward holds above its kept bytes once its recompute has
    run: the gradient of its outputs, and its saved bytes but those it kept (Block.selective_saved_bytes),
    less the kept outputs the recompute drops (Block.selective_dropped_bytes): [Note: a block's output
    gradient]. It keeps some outputs autograd does not save (a head's logits, which only the loss's
    log-softmax reads: 4 MiB beside the saved ones at Llama's loss), so its kept bytes are not all saved
    ones. A block built by hand: what it did not keep, its output gradient taken to cancel what its
    recompute drops (a transformer layer's output projection, as wide)."""
    if _selective_measured(block):
        _, kept_saved, dropped = _selective_keeps(block, checkpoint)
        return (
            output_grad + saved - _per_micro_batch(kept_saved, ctx) - _per_micro_batch(dropped, ctx)
        )
    return saved - kept


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeKernels:
    """The runtime's kernels over one unit's parameters and gradients, each (op, bytes it reads plus
    writes) ([Note: the runtime's kernels])."""

    forward: tuple[tuple[str, int], ...]
    """Each micro-batch's forward."""
    backward: tuple[tuple[str, int], ...]
    """Each micro-batch's backward."""
    step: tuple[tuple[str, int], ...]
    """Once a step."""


def runtime_kernels(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> RuntimeKernels:
    """What the runtime runs around a unit's collectives ([Note: the runtime's kernels]). An offloaded
    shard's copies to and from the host are offload_s, the casts they make on the way included."""
    traits = decision.traits

    def shard(nbytes: int) -> int:
        return -(-nbytes // ctx.dp)

    def over(kernel: tuple[str, int], nbytes: int) -> tuple[tuple[str, int], ...]:
        return ((kernel[0], kernel[1] * nbytes),)

    def cast(
        source: int, target: int, *, with_host_copy: bool = False
    ) -> tuple[tuple[str, int], ...]:
        if source == target or (with_host_copy and decision.offload):
            return ()
        return (("_to_copy", source + target),)

    gather_cast = (
        cast(shard(sizes.storage_bytes), shard(sizes.param_bytes), with_host_copy=True)
        if traits.shards_params
        else cast(sizes.storage_bytes, sizes.param_bytes)
    )
    # the reduced gradient, cast back to the parameters' dtype and added into `.grad`: the rank's shard
    # of it where the optimizer steps a shard
    grad, stored = (
        (shard(sizes.grad_bytes), shard(sizes.storage_bytes))
        if traits.shards_optimizer
        else (sizes.grad_bytes, sizes.storage_bytes)
    )
    into_grad = cast(grad, stored, with_host_copy=True) + over(GRADIENT_ADD, stored)
    backward = (
        (gather_cast if traits.reshard_after_forward else ())
        + over(GRADIENT_ASSEMBLY, sizes.param_bytes)
        + cast(sizes.param_bytes, sizes.grad_bytes)
        + (over(GRADIENT_ADD, sizes.grad_bytes) if accumulates_grads(decision, ctx) else ())
    )
    step = (
        (
            over(PARAMETERS_SYNC[0], shard(sizes.storage_bytes))
            + over(PARAMETERS_SYNC[1], sizes.storage_bytes)
        )
        if traits.gathers_after_step
        else ()
    )
    if traits.reduce_scatters_grads:
        backward += (
            (over(AVERAGING, sizes.grad_bytes) if ctx.dp > 1 else ())
            + (over(AVERAGING, grad) if ctx.dp_replicate > 1 else ())
            + into_grad
        )
    else:
        step = (
            (over(AVERAGING, sizes.grad_bytes) if ctx.dp * ctx.dp_replicate > 1 else ())
            + into_grad
            + step
        )
    return RuntimeKernels(forward=gather_cast, backward=backward, step=step)


Runtime = Callable[[UnitSizes, Decision, CostContext], RuntimeKernels]
"""The kernels a runtime runs over a unit's parameters and gradients (runtime_kernels: shardplan's)."""


def kernels_s(kernels: tuple[tuple[str, int], ...], ctx: CostContext) -> float:
    """Memory-bound kernels, each (op, bytes), at their op's factor and fixed cost."""
    return sum(ctx.hardware.compute_time_s(0, nbytes, "float32", op=op) for op, nbytes in kernels)


def compute_s(
    blocks: tuple[Block, ...], kernels: RuntimeKernels, decision: Decision, ctx: CostContext
) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one micro-batch, the runtime's kernels of each
    micro-batch included ([Note: the runtime's kernels])."""
    fwd_total = bwd_total = recompute = 0.0
    for block in blocks:
        fwd_s, bwd_s, recompute_s = _block_times_s(block, ctx)
        fwd_total += fwd_s
        bwd_total += bwd_s
        recompute += recompute_s.get(decision.checkpoint, 0.0)
    return (
        fwd_total + kernels_s(kernels.forward, ctx),
        bwd_total + kernels_s(kernels.backward, ctx),
        recompute,
    )


def gather_s(gathered: int, ctx: CostContext) -> float:
    """One all-gather of a unit's parameters over its shard group (none when nothing is gathered)."""
    if not gathered:
        return 0.0
    return ctx.hardware.collective_time_s(
        "all_gather_into_tensor", gathered, ctx.dp, ranks_per_node=ctx.ranks_per_node(ctx.tp)
    )


def reduce_s(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> float:
    """One reduction of the gradient (see StrategyTraits): a reduce-scatter over the shard group, then
    (HSDP) an all-reduce of the rank's shard across the replica groups; or an all-reduce over every
    data-parallel rank."""
    hw = ctx.hardware
    if not decision.traits.reduce_scatters_grads:
        return hw.collective_time_s(
            "all_reduce",
            sizes.grad_bytes,
            ctx.dp * ctx.dp_replicate,
            ranks_per_node=ctx.ranks_per_node(ctx.tp),
        )
    return hw.collective_time_s(
        "reduce_scatter_tensor", sizes.grad_bytes, ctx.dp, ranks_per_node=ctx.ranks_per_node(ctx.tp)
    ) + hw.collective_time_s(
        "all_reduce",
        -(-sizes.grad_bytes // ctx.dp),
        ctx.dp_replicate,
        ranks_per_node=ctx.ranks_per_node(ctx.tp * ctx.dp),
    )


def post_step_gather_s(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> float:
    """The all-gather of the stepped slices back into every rank's full parameters, once per step."""
    if not decision.traits.gathers_after_step:
        return 0.0
    return ctx.hardware.collective_time_s(
        "all_gather_into_tensor",
        sizes.storage_bytes,
        ctx.dp,
        ranks_per_node=ctx.ranks_per_node(ctx.tp),
    )


def offload_s(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> float:
    """Per micro-batch host↔device copies of an offloaded shard: in before each gather, its gradient out."""
    if not decision.offload:
        return 0.0
    gathers = 2 if decision.traits.reshard_after_forward else 1
    return (gathers + 1) * -(-sizes.storage_bytes // ctx.dp) / OFFLOAD_BYTES_PER_S


def optimizer_s(sizes: UnitSizes, decision: Decision, ctx: CostContext) -> float:
    """The optimizer step over the rank's parameters: on the device, each kernel of OPTIMIZER_STEPS over
    the unit's shard at its op's measured factor ([Note: the step's own kernels] in op_factors.py),
    after the runtime's check of its kept gradient (GRADIENT_CHECK); or from host memory when offloaded."""
    stepped = OPTIMIZER_STEPS[ctx.optimizer]
    numel = -(-sizes.numel // ctx.dp) if decision.traits.shards_optimizer else sizes.numel
    if decision.offload:
        return numel * stepped.bytes_per_param / CPU_MEMORY_BYTES_PER_S
    return kernels_s(
        tuple((op, numel * nbytes) for op, nbytes in (GRADIENT_CHECK,) + stepped.ops), ctx
    )


def unit_cost(blocks: tuple[Block, ...], decision: Decision, ctx: CostContext) -> UnitCost:
    """The terms of one unit made of `blocks` (consecutive) under `decision`, on one rank (on_rank)."""
    blocks, experts = _experts_on_rank(tuple(on_rank(block, ctx) for block in blocks), ctx)
    traits, sizes = decision.traits, UnitSizes.of(blocks, ctx)
    gathered = gathered_bytes(sizes, decision, ctx)
    activation_bytes, fwd_working, bwd_working = working_bytes(blocks, decision.checkpoint, ctx)
    own = _expert_terms(experts, ctx)
    kernels = (ctx.runtime or runtime_kernels)(sizes, decision, ctx)
    compute_fwd_s, compute_bwd_s, recompute_s = compute_s(blocks, kernels, decision, ctx)
    gather = gather_s(gathered if traits.shards_params else 0, ctx)
    overlap = ctx.hardware.overlaps_communication
    return UnitCost(
        state_bytes=state_bytes(sizes, decision, ctx) + own.state_bytes,
        activation_bytes=activation_bytes,
        gathered_bytes=gathered,
        # a unit keeping its parameters whole casts them as it runs, not when the unit before prefetches it
        gathered_fwd_bytes=gathered if traits.shards_params else 0,
        gathered_bwd_bytes=gathered if traits.reshard_after_forward else 0,
        kept_gathered_bytes=0 if traits.reshard_after_forward else gathered,
        grad_assembly_bytes=grad_assembly_bytes(sizes) + own.grad_assembly_bytes,
        reducing_bytes=reducing_bytes(sizes, decision, ctx) + own.reducing_bytes,
        fwd_working=fwd_working,
        bwd_working=bwd_working,
        compute_fwd_s=compute_fwd_s,
        compute_bwd_s=compute_bwd_s,
        recompute_s=recompute_s,
        gather_fwd_s=gather,
        gather_bwd_s=gather if traits.reshard_after_forward else 0.0,
        reduce_s=reduce_s(sizes, decision, ctx) + own.reduce_s,
        reduce_per_step=not traits.reduce_scatters_grads,
        post_step_gather_s=post_step_gather_s(sizes, decision, ctx),
        offload_s=offload_s(sizes, decision, ctx),
        optimizer_s=optimizer_s(sizes, decision, ctx) + own.optimizer_s,
        runtime_step_s=kernels_s(kernels.step, ctx),
        tensor_parallel_s=tensor_parallel_s(blocks, ctx)
        + context_parallel_s(blocks, ctx)
        + expert_parallel_s(blocks, ctx),
        prefetch=decision.prefetch,
        hide_fwd_s=compute_fwd_s if overlap else 0.0,
        hide_bwd_s=compute_bwd_s + recompute_s if overlap else 0.0,
        contention=ctx.hardware.collective_compute_share if overlap else 0.0,
    )


class ExpertTerms(NamedTuple):
    """What an ep rank's unit of routed experts adds to the planned unit's terms ([Note: experts on an
    ep rank]): its state whole, its gradient's assembly and all-reduce, its optimizer step."""

    state_bytes: int = 0
    grad_assembly_bytes: int = 0
    reducing_bytes: int = 0
    reduce_s: float = 0.0
    optimizer_s: float = 0.0


def _expert_terms(experts: "UnitSizes | None", ctx: CostContext) -> ExpertTerms:
    if experts is None:
        return ExpertTerms()
    replicated = Decision(strategy=ShardStrategy.REPLICATE)
    same_experts = replace(ctx, dp=ctx.dp * ctx.dp_replicate // ctx.ep, dp_replicate=1)
    return ExpertTerms(
        state_bytes=state_bytes(experts, replicated, same_experts),
        grad_assembly_bytes=grad_assembly_bytes(experts),
        reducing_bytes=reducing_bytes(experts, replicated, same_experts),
        reduce_s=reduce_s(experts, replicated, same_experts),
        optimizer_s=optimizer_s(experts, replicated, same_experts),
    )


def base_bytes(unit: UnitCost, ctx: CostContext) -> int:
    """Bytes a unit adds to every event of its stage: state, other micro-batches' activations
    and, with several micro-batches in flight, SHARD_GRAD_OP params that then never reshard."""
    extra = unit.kept_gathered_bytes if ctx.in_flight > 1 else 0
    return unit.state_bytes + (ctx.in_flight - 1) * unit.activation_bytes + extra


def end_of_forward_bytes(unit: UnitCost, ctx: CostContext) -> int:
    """Bytes a unit holds at the end of its stage's forward: base_bytes + held_bytes."""
    return base_bytes(unit, ctx) + held_bytes(unit, ctx)


def held_bytes(unit: UnitCost, ctx: CostContext) -> int:
    """Bytes a unit holds after its forward until its backward, for the current micro-batch."""
    kept_gathered = unit.kept_gathered_bytes if ctx.in_flight == 1 else 0
    return unit.activation_bytes + kept_gathered


def own_gathered_bytes(unit: UnitCost, ctx: CostContext) -> int:
    """A unit's gathered params while it runs, unless base_bytes already counts them."""
    return unit.gathered_bytes - (unit.kept_gathered_bytes if ctx.in_flight > 1 else 0)


def own_peak_bytes(unit: UnitCost, ctx: CostContext, backward: bool) -> int:
    """A unit's whole working set while it runs (params; activations and transient, or in backward
    its gradient as it is assembled where that is larger: [Note: gradients in backward])."""
    if backward:
        return own_gathered_bytes(unit, ctx) + max(sum(unit.bwd_working), unit.grad_assembly_bytes)
    return own_gathered_bytes(unit, ctx) + sum(unit.fwd_working)


def prefetch_fwd_bytes(unit: UnitCost, nxt: UnitCost | None, ctx: CostContext) -> int:
    """Extra bytes during `unit`'s forward: the next unit's params, when prefetched and not yet held."""
    if nxt is None or not unit.prefetch or (ctx.in_flight > 1 and nxt.kept_gathered_bytes):
        return 0
    return nxt.gathered_fwd_bytes


def prefetch_bwd_bytes(unit: UnitCost, prev: UnitCost | None) -> int:
    """Extra bytes during `unit`'s backward: the previous unit's params gathered again early."""
    return prev.gathered_bwd_bytes if prev is not None and unit.prefetch else 0


def in_flight_bwd_bytes(nxt: UnitCost | None) -> int:
    """Extra bytes during a unit's backward: the next unit's reduction, still in flight."""
    return nxt.reducing_bytes if nxt is not None else 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ExposedTime:
    per_micro_batch_s: float
    per_step_s: float


def exposed_s(comm_s: float, window_s: float, prefetch: bool, contention: float) -> float:
    """What of `comm_s` a prefetch leaves exposed past `window_s` of compute (all of it without): at least
    the `contention` share of it that the compute beside it loses ([Note: collectives beside the compute])."""
    return comm_s - min(comm_s * (1 - contention), window_s) if prefetch else comm_s


def pair_exposed_s(prev: UnitCost | None, unit: UnitCost | None) -> ExposedTime:
    """Communication left exposed between adjacent units `prev` → `unit` (None at a chain end)."""
    if (
        prev is None and unit is not None
    ):  # `unit` is first: its forward gather and reduction hide under nothing
        per_step = unit.reduce_s if unit.reduce_per_step else 0.0
        per_mb = unit.gather_fwd_s + (0.0 if unit.reduce_per_step else unit.reduce_s)
        return ExposedTime(per_micro_batch_s=per_mb, per_step_s=per_step)
    if (
        unit is None and prev is not None
    ):  # `prev` is last: its backward gather runs first in backward, unhidden
        return ExposedTime(per_micro_batch_s=prev.gather_bwd_s, per_step_s=0.0)
    if prev is None or unit is None:
        raise ValueError("pair_exposed_s needs at least one unit")
    per_mb = exposed_s(
        unit.gather_fwd_s, prev.hide_fwd_s, prev.prefetch, prev.contention
    ) + exposed_s(prev.gather_bwd_s, unit.free_bwd_s, unit.prefetch, unit.contention)
    reduce = exposed_s(unit.reduce_s, prev.hide_bwd_s, True, prev.contention)
    if unit.reduce_per_step:
        return ExposedTime(per_micro_batch_s=per_mb, per_step_s=reduce)
    return ExposedTime(per_micro_batch_s=per_mb + reduce, per_step_s=0.0)


def own_time_s(unit: UnitCost, ctx: CostContext) -> float:
    """A unit's own contribution to its stage's step time (everything but neighbour coupling)."""
    per_mb = unit.compute_fwd_s + unit.bwd_window_s + unit.offload_s + unit.tensor_parallel_s
    return (
        ctx.pipeline_factor * per_mb
        - ctx.weight_grad_credit * unit.compute_bwd_s
        + unit.runtime_step_s
        + unit.post_step_gather_s
        + unit.optimizer_s
    )


def pair_time_s(prev: UnitCost | None, unit: UnitCost | None, ctx: CostContext) -> float:
    exposed = pair_exposed_s(prev, unit)
    return ctx.pipeline_factor * exposed.per_micro_batch_s + exposed.per_step_s


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCost:
    """One stage's (or a whole plan's) predicted peak memory and step time, as named terms."""

    peak_bytes: int
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """At the peak event: sharded_state, gathered_params, activations, transient."""
    step_time_s: float
    time_s: dict[str, float] = field(default_factory=dict)
    """compute, recompute, exposed_comm, offload, optimizer, bubble."""
    peak_event: str = ""
    """Where the peak is, e.g. "backward of unit 3"."""
    units: tuple[UnitPrediction, ...] = ()
    """Each unit's memory at its forward's and its backward's peak, and its compute (unnamed: the
    cost model knows blocks, the plan names the units)."""
    held: "HeldBytes | None" = None
    """What the stage holds beside its working set, for its rank's peak (pipeline_ranks); None for a
    rank's own cost."""


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldBytes:
    """A stage's memory as its rank's order of operations adds it up ([Note: virtual stages and the
    zero-bubble schedule]): held all step, held per micro-batch in flight, and what the stage's
    forward or backward of one micro-batch adds while it runs."""

    schedule: str
    pipeline_degree: int
    virtual_stages: int
    num_micro_batches: int
    stage: int
    state_bytes: int
    """Sharded state and tied copies, all step; and torch's receive buffers: a PipelineStage allocates
    one per micro-batch for its inputs (but on stage 0) and for its outputs' gradients (but on the last
    stage) and keeps them through the step, a replica batch of each across its micro-batches."""
    activation_bytes: int
    """Kept for backward by one micro-batch."""
    kept_gathered_bytes: int
    """Parameters kept gathered from forward to backward while a micro-batch is in flight."""
    weight_grad_bytes: int
    """Under the zero-bubble schedule, what one micro-batch keeps from its input gradient to its weight
    gradient beside its activations (weight_grad_inputs_bytes); none on stage 0, whose whole backward runs
    as W."""
    forward_working_bytes: int
    """At the peak of one micro-batch's forward: its own activations so far, gathered parameters,
    transients."""
    backward_working_bytes: int


def evaluate_stage(
    blocks: tuple[Block, ...],
    bounds: tuple[int, ...],
    decisions: tuple[Decision, ...],
    ctx: CostContext,
    *,
    boundary_s: float = 0.0,
    tied=None,
    units: list[UnitCost] | None = None,
) -> StepCost:
    """Walk the stage's events one by one and add up its step time.

    `bounds` are the block offsets where units start (first is 0); `boundary_s` is the
    per-micro-batch pipeline send/receive time of this stage; `tied` what its ties to other
    stages add (solver/search.py, TiedTerms): bytes held all step, and seconds once a step;
    `units` the units' unit_cost, where the caller has them already (the solver memoizes them).
    """
    if units is None:
        spans = list(zip(bounds, bounds[1:] + (len(blocks),)))
        units = [unit_cost(blocks[a:b], d, ctx) for (a, b), d in zip(spans, decisions)]
    state = sum(u.state_bytes for u in units) + (tied.copy_bytes if tied else 0)
    other_micro_batches = sum((ctx.in_flight - 1) * u.activation_bytes for u in units)
    never_resharded = sum(u.kept_gathered_bytes for u in units) if ctx.in_flight > 1 else 0
    events = []  # (name, activations, gathered params and gradient buffers, transient)
    held_acts = held_gathered = 0
    for i, u in enumerate(units):
        nxt = units[i + 1] if i + 1 < len(units) else None
        acts, transient = u.fwd_working
        gathered = own_gathered_bytes(u, ctx) + prefetch_fwd_bytes(u, nxt, ctx)
        events.append(
            (f"forward of unit {i}", held_acts + acts, held_gathered + gathered, transient)
        )
        held_acts += u.activation_bytes
        held_gathered += held_bytes(u, ctx) - u.activation_bytes
    events.append(("end of forward", held_acts, held_gathered, 0))
    for i in reversed(range(len(units))):
        u, prev, nxt = (
            units[i],
            units[i - 1] if i else None,
            units[i + 1] if i + 1 < len(units) else None,
        )
        held_acts -= u.activation_bytes
        held_gathered -= held_bytes(u, ctx) - u.activation_bytes
        acts, transient = u.bwd_working
        gathered = (
            own_gathered_bytes(u, ctx) + prefetch_bwd_bytes(u, prev) + in_flight_bwd_bytes(nxt)
        )
        if u.grad_assembly_bytes > acts + transient:  # the peak is where its gradient is assembled
            acts, transient, gathered = 0, 0, gathered + u.grad_assembly_bytes
        events.append(
            (f"backward of unit {i}", held_acts + acts, held_gathered + gathered, transient)
        )
    always = state + never_resharded + other_micro_batches
    forward_bytes = [always + sum(event[1:]) for event in events[: len(units)]]
    backward_bytes = [always + sum(event[1:]) for event in reversed(events[len(units) + 1 :])]
    per_unit = tuple(
        UnitPrediction(
            unit="",
            forward_bytes=f,
            backward_bytes=b,
            compute_s=float(u.compute_fwd_s + u.bwd_window_s),
        )
        for u, f, b in zip(units, forward_bytes, backward_bytes)
    )
    name, acts, gathered, transient = max(events, key=lambda e: e[1] + e[2] + e[3])
    own = always - other_micro_batches - never_resharded
    stages = ctx.pipeline_degree * ctx.virtual_stages
    receive_buffers = (on_rank(blocks[0], ctx).input_bytes if ctx.stage > 0 else 0) + (
        on_rank(blocks[-1], ctx).output_bytes if ctx.stage < stages - 1 else 0
    )
    held = HeldBytes(
        schedule=ctx.schedule,
        pipeline_degree=ctx.pipeline_degree,
        virtual_stages=ctx.virtual_stages,
        num_micro_batches=ctx.num_micro_batches,
        stage=ctx.stage,
        state_bytes=own + receive_buffers,
        activation_bytes=sum(u.activation_bytes for u in units),
        weight_grad_bytes=sum(
            _per_micro_batch(weight_grad_inputs_bytes(on_rank(block, ctx)), ctx) for block in blocks
        )
        if ctx.schedule == "zero_bubble" and ctx.stage > 0
        else 0,
        kept_gathered_bytes=sum(u.kept_gathered_bytes for u in units),
        forward_working_bytes=max(forward_bytes) - always,
        backward_working_bytes=max(backward_bytes) - always,
    )
    memory = {
        "sharded_state": state,
        "gathered_params": gathered + never_resharded,
        "activations": acts + other_micro_batches,
        "transient": transient,
    }
    time = _stage_time(units, ctx, boundary_s)
    time["exposed_comm"] += tied.sync_s if tied else 0.0
    return StepCost(
        peak_bytes=sum(memory.values()),
        memory_bytes=memory,
        step_time_s=float(sum(time.values())),
        time_s=time,
        peak_event=name,
        units=per_unit,
        held=held,
    )


def _stage_time(units: list[UnitCost], ctx: CostContext, boundary_s: float) -> dict:
    m = ctx.num_micro_batches
    compute_mb = sum(u.compute_fwd_s + u.compute_bwd_s for u in units)
    compute_bwd_mb = sum(u.compute_bwd_s for u in units)
    recompute_mb = sum(u.recompute_s for u in units)
    offload_mb = sum(u.offload_s for u in units)
    chain: list[UnitCost | None] = [None, *units, None]
    pairs = [pair_exposed_s(p, u) for p, u in zip(chain, chain[1:])]
    exposed_mb = (
        sum(p.per_micro_batch_s for p in pairs)
        + sum(u.tensor_parallel_s for u in units)
        + boundary_s
    )
    exposed_step = sum(p.per_step_s for p in pairs) + sum(u.post_step_gather_s for u in units)
    per_mb = compute_mb + recompute_mb + offload_mb + exposed_mb
    terms = {
        "compute": m * compute_mb,
        "recompute": m * recompute_mb,
        "exposed_comm": m * exposed_mb + exposed_step,
        "offload": m * offload_mb,
        "optimizer": sum(u.optimizer_s + u.runtime_step_s for u in units),
        "bubble": ctx.bubble_share * per_mb - ctx.weight_grad_credit * compute_bwd_mb,
    }
    return {name: float(value) for name, value in terms.items()}


ORDERED_SCHEDULES = {"interleaved_1f1b": 2, "zero_bubble": 1}
"""Schedules priced on their order of operations (schedule_order) → the warm-up forwards each rank
before the last adds per hop from it (torch.distributed.pipelining.schedules._get_warmup_ops'
multiply_factor)."""


def schedule_order(
    schedule: str, pp: int, virtual_stages: int, m: int, pipeline_rank: int
) -> list[tuple[str, int]]:
    """The operations pipeline rank `pipeline_rank` runs in a step, in order, as torch 2.13's
    ScheduleInterleaved1F1B and ScheduleInterleavedZeroBubble order them
    (torch/distributed/pipelining/schedules.py, _get_warmup_ops and _get_1f1b_rank_ops): ("F", k) a
    forward of its k-th stage, ("B", k) its backward (under the zero-bubble schedule its input gradient),
    ("W", k) the zero-bubble schedule's deferred weight gradient. Each stage takes its micro-batches in
    order."""
    v, factor = virtual_stages, ORDERED_SCHEDULES[schedule]
    rounds = max(1, m // pp)
    per_round = m // rounds
    warm_up = min((v - 1) * per_round + factor * (pp - 1 - pipeline_rank), m * v)
    total = m * v
    defers = schedule == "zero_bubble"

    def forward_stage(op: int) -> int:
        return (op // per_round) % v

    def backward_stage(op: int) -> int:
        return v - 1 - ((op - warm_up) // per_round) % v

    order = [("F", forward_stage(op)) for op in range(warm_up)]
    backwards: list[int] = []  # the stage of each backward so far: W follows them in order
    weights = 0
    for op in range(warm_up, total + warm_up):
        if op < total:
            order.append(("F", forward_stage(op)))
        order.append(("B", backward_stage(op)))
        backwards.append(backward_stage(op))
        if defers and op - warm_up >= pipeline_rank:  # the first W waits rank micro-batches
            order.append(("W", backwards[weights]))
            weights += 1
    if defers:
        order += [("W", stage) for stage in backwards[weights:]]
    return order


def weight_grad_inputs_bytes(block: Block) -> int:
    """What the zero-bubble schedule's weight gradient starts from in `block`: the gradient of the output
    of every op reading a parameter, kept from the input gradient's pass. The matmul-like ops' outputs
    (Block.selective_bytes), and of the other ops reading a parameter (norms) the half of their activation
    bytes they write (one input read, one output of its size written)."""
    others = sum(
        (kind.bytes - kind.weight_bytes) // 2
        for kind in block.fwd_kinds
        if kind.weight_bytes and not kept_by_selective(kind.name)
    )
    return block.selective_bytes + others


class Moment(NamedTuple):
    """One operation of a rank's order (schedule_order) and what the rank's stages hold while it runs."""

    kind: str
    stage: int
    """The rank's k-th stage."""
    held: tuple[int, ...]
    """Micro-batches each of the rank's stages holds activations of: a forward's own counts from its
    start, a backward's (a W's, under the zero-bubble schedule) until its end."""
    awaiting_weights: tuple[int, ...]
    """Micro-batches past their input gradient whose weight gradient has not run (zero-bubble)."""


def held_micro_batches(
    schedule: str, pp: int, virtual_stages: int, m: int, pipeline_rank: int
) -> list[Moment]:
    """Each operation of schedule_order with what the rank's stages hold while it runs."""
    held, awaiting = [0] * virtual_stages, [0] * virtual_stages
    frees = "W" if schedule == "zero_bubble" else "B"
    moments = []
    for kind, stage in schedule_order(schedule, pp, virtual_stages, m, pipeline_rank):
        if kind == "F":
            held[stage] += 1
        moments.append(Moment(kind, stage, tuple(held), tuple(awaiting)))
        if kind == frees:
            held[stage] -= 1
        if kind == "B" and frees == "W":
            awaiting[stage] += 1
        if kind == "W":
            awaiting[stage] -= 1
    return moments


def in_flight_at_peak(schedule: str, pp: int, virtual_stages: int, m: int, stage: int) -> int:
    """Micro-batches stage `stage` holds at its rank's fullest moment (the most micro-batches held over
    the rank's stages; the first such), 1 at the least: what the solver prices the stage at ([Note:
    virtual stages and the zero-bubble schedule]); pipeline_ranks adds the rank up exactly."""
    moments = held_micro_batches(schedule, pp, virtual_stages, m, stage % pp)
    fullest = max(moments, key=lambda moment: sum(moment.held))
    return max(1, fullest.held[stage // pp])


def pipeline_ranks(stage_costs: list[StepCost]) -> list[StepCost]:
    """Each pipeline rank's cost from its stages' (in stage order): the stages themselves where a rank runs
    one; with virtual stages, their times summed and the peak over the rank's order of operations (see
    [Note: virtual stages and the zero-bubble schedule]): every stage's state, the activations of the
    micro-batches each holds then, and the working set of the forward or backward running."""
    held = [c.held for c in stage_costs]
    if not held or held[0] is None or held[0].schedule not in ORDERED_SCHEDULES:
        return stage_costs
    first = held[0]
    pp, v, m = first.pipeline_degree, first.virtual_stages, first.num_micro_batches
    ranks = []
    for rank in range(pp):
        mine = [h for h in held if h is not None and h.stage % pp == rank]
        costs = [c for c in stage_costs if c.held is not None and c.held.stage % pp == rank]
        state = sum(h.state_bytes for h in mine)
        peak, memory, event = -1, {}, ""
        for kind, local, counts, awaiting in held_micro_batches(first.schedule, pp, v, m, rank):
            running = mine[local]
            activations = (
                sum(
                    count * h.activation_bytes for count, h in zip(counts, mine) if h is not running
                )
                + (counts[local] - 1) * running.activation_bytes
                + sum(count * h.weight_grad_bytes for count, h in zip(awaiting, mine))
            )
            kept = sum(h.kept_gathered_bytes for count, h in zip(counts, mine) if count > 0)
            working = (
                running.forward_working_bytes if kind == "F" else running.backward_working_bytes
            )
            total = state + activations + kept + working
            if total > peak:
                peak, event = total, f"{kind} of stage {running.stage}"
                memory = {
                    "sharded_state": state,
                    "activations": activations,
                    "gathered_params": kept,
                    "transient": working,
                }
        times: dict[str, float] = {}
        for c in costs:
            for name, value in c.time_s.items():
                times[name] = times.get(name, 0.0) + value
        ranks.append(
            StepCost(
                peak_bytes=peak,
                memory_bytes=memory,
                step_time_s=float(sum(times.values())),
                time_s=times,
                peak_event=event,
                units=tuple(u for c in costs for u in c.units),
            )
        )
    return ranks
