"""The plan: frozen, keyword-only dataclasses with a versioned JSON form.

A plan is data, never code: it is parsed as JSON and validated, never pickled
or evaluated. Things are named as a person knows them (module paths,
parameter names) and the plan carries the fingerprint of the captured graph,
so applying it to another model fails loudly.
"""

import dataclasses
import enum
import functools
import json
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any

from shardplan.common.dtypes import FLOAT_DTYPES, INPUT_DTYPES
from shardplan.common.files import parse_json, read_text, write_text_atomically
from shardplan.errors import PlanError
from shardplan.frontend.chain import InputSpec

SCHEMA = "shardplan.plan/7"
READABLE_SCHEMAS = (
    "shardplan.plan/1",
    "shardplan.plan/2",
    "shardplan.plan/3",
    "shardplan.plan/4",
    "shardplan.plan/5",
    "shardplan.plan/6",
    SCHEMA,
)
"""Plan formats this version reads, upgraded on load (_upgrade): format 1 (mesh dp × pp), format 2
(no structural signature: parallelize checks such a plan by capturing the model), format 3 (one stage
per pipeline rank, no sequence limits), format 4 (no context parallelism), format 5 (no expert
parallelism), format 6 (no loss on sharded logits: a vocabulary-parallel head's logits gathered; an
input's dims that may vary, which every input's may now)."""
SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "schemas", "plan.schema.json")
"""JSON Schema of the plan file, shipped in the package; from_json validates against it."""
SCHEDULE_NAMES = ("none", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
"""Pipeline schedules, as torch.distributed.pipelining runs them: ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B (virtual stages per rank) and ScheduleInterleavedZeroBubble (the backward split
into its input gradient and its deferred weight gradient; ZB-H1 at one stage per rank)."""
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
"""Schedules that may run several (virtual) stages per rank."""
MAX_WORLD_SIZE = 2**20
"""The most ranks a plan spans: ten times the largest training clusters built (about 10^5 GPUs),
and a bound that keeps every search over meshes and ranks fast."""
MAX_NDIM = 64
"""The most dims of one input: torch's own limit for a tensor's dims in most kernels."""
MAX_DIM = 2**31 - 1
"""The largest size of one input dim: what torch.export assumes of an unbounded dim."""
MAX_INPUT_NUMEL = 2**40
"""The most elements one example input may hold (4 TiB of bytes at the least): more is a typo."""


class ShardStrategy(str, enum.Enum):
    """How a unit's parameters, gradients and optimizer states are spread over its dp group."""

    FULL_SHARD = "full_shard"
    """ZeRO-3: parameters, gradients, optimizer states sharded; parameters gathered for
    forward, freed after it (reshard after forward), gathered again for backward."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2: as FULL_SHARD but parameters stay gathered from forward until backward."""
    SHARD_OPTIMIZER = "shard_optimizer"
    """ZeRO-1 (FairScale OSS): full parameters on every rank, gradients all-reduced,
    each rank steps its slice of the optimizer state, parameters gathered after the step."""
    REPLICATE = "replicate"
    """DDP: everything replicated, gradients all-reduced."""

    @property
    def traits(self) -> "StrategyTraits":
        return STRATEGY_TRAITS[self]


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyTraits:
    """What a shard strategy does, as data: the cost model, the search space, plan validation and the
    runtime read these and nothing else of a strategy, so a new strategy is one row of STRATEGY_TRAITS."""

    shards_params: bool
    """Parameters live as 1/dp shards between uses and are all-gathered before each use."""
    reshard_after_forward: bool
    """Gathered parameters are freed after forward and gathered again for backward (else kept until then)."""
    reduce_scatters_grads: bool
    """Each micro-batch's gradient is reduce-scattered; else gradients accumulate locally, in full, and
    are all-reduced once per step ([Note: gradient accumulation] in runtime/unit.py)."""
    shards_optimizer: bool
    """Each rank steps only its 1/dp slice of the parameters, with the gradient and optimizer state of
    that slice."""
    may_offload: bool
    """The rank's shard (and its optimizer state) may live in CPU memory between uses."""

    @property
    def gathers_after_step(self) -> bool:
        """Full parameters kept on every rank but stepped in slices: the slices are all-gathered after a step."""
        return self.shards_optimizer and not self.shards_params


STRATEGY_TRAITS = {
    ShardStrategy.FULL_SHARD: StrategyTraits(
        shards_params=True,
        reshard_after_forward=True,
        reduce_scatters_grads=True,
        shards_optimizer=True,
        may_offload=True,
    ),
    ShardStrategy.SHARD_GRAD_OP: StrategyTraits(
        shards_params=True,
        reshard_after_forward=False,
        reduce_scatters_grads=True,
        shards_optimizer=True,
        may_offload=True,
    ),
    ShardStrategy.SHARD_OPTIMIZER: StrategyTraits(
        shards_params=False,
        reshard_after_forward=False,
        reduce_scatters_grads=False,
        shards_optimizer=True,
        may_offload=False,
    ),
    ShardStrategy.REPLICATE: StrategyTraits(
        shards_params=False,
        reshard_after_forward=False,
        reduce_scatters_grads=False,
        shards_optimizer=False,
        may_offload=False,
    ),
}
"""Offload needs a sharded strategy: the runtime gathers an offloaded shard from the host before each use
(runtime/sharded.py), which a rank keeping full parameters never does."""


SELECTIVE_SAVED_OPS = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_grouped_mm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
)
"""ATen ops whose outputs SELECTIVE checkpointing keeps: the matmul-like ones (a mixture of experts'
grouped matmuls among them), costly to recompute and few; every elementwise op, norm and activation
between them is recomputed. The runtime keeps exactly these, and the analysis counts exactly these
(an op of the captured graph under the name of the ATen op it stands for, SELECTIVE_STAND_INS)."""

SELECTIVE_STAND_INS = {"grouped_mm_fallback": "_grouped_mm"}
"""Ops of a captured graph → the ATen op of SELECTIVE_SAVED_OPS the eager runtime runs for them.
transformers 5 runs routed experts eagerly as `_grouped_mm` but, traced by torch.export (float32),
as its own `grouped_mm_fallback` custom op: the same matmul, so the analysis and the cost model
must take it as kept where the runtime keeps `_grouped_mm`."""


ALTERNATED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_grouped_mm")
"""Of SELECTIVE_SAVED_OPS, the matmuls SELECTIVE_ALTERNATE keeps only every second of: all the
matmul-like ops, not torchtitan's `mm` alone, so that a projection with a bias (addmm: GPT-2's, Qwen's
query, key and value) or a grouped expert matmul counts as a Llama projection does; on a Llama layer,
whose projections all run as `mm`, the two count alike. Attention kernels are kept every time."""


def kept_by_selective(op_name: str) -> bool:
    """Whether SELECTIVE checkpointing keeps the outputs of the op the analysis named `op_name`."""
    return _aten_name(op_name) in SELECTIVE_SAVED_OPS


def alternated(op_name: str) -> bool:
    """Whether SELECTIVE_ALTERNATE keeps only every second call of the op the analysis named `op_name`
    (ALTERNATED_OPS)."""
    return _aten_name(op_name) in ALTERNATED_OPS


def _aten_name(op_name: str) -> str:
    return SELECTIVE_STAND_INS.get(op_name, op_name)


class Checkpoint(str, enum.Enum):
    """Activation checkpointing of a unit."""

    NONE = "none"
    FULL = "full"
    """Keep only each block's inputs; recompute the block in backward."""
    SELECTIVE = "selective"
    """Keep the outputs of matmul-like ops, recompute the cheap elementwise ones."""
    SELECTIVE_ALTERNATE = "selective_alternate"
    """torchtitan's selective op policy: keep the outputs of attention and of every second matmul of each
    checkpointed module's call (ALTERNATED_OPS, counted from 1 in the order they run: the odd ones are
    kept), recompute the rest. Of a Llama layer's seven projections it keeps the query, value, gate and
    down projections and recomputes the key, output and up projections: about half the matmul outputs
    SELECTIVE keeps, for some matmuls run again; between SELECTIVE and FULL."""

    @property
    def selective(self) -> bool:
        """Whether the mode keeps some ops' outputs through torch's selective checkpointing."""
        return self in (Checkpoint.SELECTIVE, Checkpoint.SELECTIVE_ALTERNATE)


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """What is decided for one unit: the solver chooses these, the plan's Unit carries them."""

    strategy: ShardStrategy = ShardStrategy.FULL_SHARD
    checkpoint: Checkpoint = Checkpoint.NONE
    offload: bool = False
    """Keep the shard (and its optimizer state) in CPU memory between uses."""
    prefetch: bool = True
    """Start the next unit's gather while this one computes."""

    def __post_init__(self) -> None:
        self._check_offload("a unit")

    @property
    def traits(self) -> StrategyTraits:
        return self.strategy.traits

    def _check_offload(self, who: str) -> None:
        if self.offload and not self.traits.may_offload:
            allowed = " or ".join(s.value for s in ShardStrategy if s.traits.may_offload)
            raise PlanError(
                f"{who} offloads with strategy {self.strategy.value}: offload needs a sharded "
                f"strategy ({allowed}); set offload to false"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class Unit(Decision):
    """One FSDP unit: a run of consecutive blocks whose parameters share one flat buffer, and its Decision."""

    name: str
    """The first and last module path, e.g. "h.3" or "h.3..h.5"."""
    modules: tuple[str, ...]
    """Module paths of the blocks in this unit, in execution order."""
    params: tuple[str, ...]
    """Parameter names (model.named_parameters()) in the unit's flat buffer, in order."""

    def __post_init__(self) -> None:
        if not self.name or not self.modules:
            raise PlanError(
                f"unit {_shown(self.name)} has no name or no modules: every unit holds at least one block"
            )
        self._check_offload(f"unit {_shown(self.name)}")

    @property
    def reshard_after_forward(self) -> bool:
        return self.traits.reshard_after_forward


@dataclass(frozen=True, kw_only=True, slots=True)
class Stage:
    """One pipeline stage: consecutive units, on pipeline rank index mod pp ([Note: rank layout])."""

    index: int
    units: tuple[str, ...]
    """Names of the units in this stage."""


ROUTED_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The parameters holding a mixture of experts' routed experts, 3-D with the expert dim first
(transformers 5's Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 experts): what expert parallelism
splits over the ep ranks ([Note: expert parallelism])."""


MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The mesh's dimensions, outermost first (see Mesh.coordinates)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Mesh:
    """World = pp × dp_replicate × dp_shard × cp × tp, laid out in MESH_DIMS order, tp innermost.

    [Note: rank layout] rank = (((stage · dp_replicate + replica group) · dp_shard + shard) · cp + cp
    rank) · tp + tp rank. A tp group is tp consecutive ranks, so it stays inside a node whenever tp
    divides the node's devices (as torchtitan and Megatron lay it out); a cp group strides by tp, a
    data-parallel group by cp · tp; a pipeline stage is the outermost block of dp · cp · tp ranks. The
    cp ranks of a replica read the same batch and each computes its share of the sequence
    ([Note: context parallelism]); they hold the same parameters, which they shard as dp_shard ranks
    do (parameter_mesh). With tp = dp_replicate = 1 this is the dp × pp layout of
    plan format 1: rank r at stage r // dp, replica r % dp. With v virtual stages per rank
    (Schedule.virtual_stages) the plan's pp · v stages go round the pipeline ranks, stage i on pipeline
    rank i mod pp (Megatron-LM's and torch.distributed.pipelining's interleaved layout), so a
    micro-batch leaves the last rank for the first v - 1 times.

    >>> Mesh(dp_shard=2, tp=2, pp=2).coordinates(5)
    {'pp': 1, 'dp_replicate': 0, 'dp_shard': 0, 'cp': 0, 'tp': 1}

    [Note: context parallelism] At cp > 1 each sequence is cut into 2 · cp chunks along dim 1 and cp
    rank r computes chunks r and 2 · cp - 1 - r (torchtitan's and Megatron's causal load balance: every
    rank attends to the same number of earlier tokens). Everything in a decoder but attention is
    token-wise; attention gathers the keys and values of the whole sequence over the cp group and
    masks by the tokens' global positions.

    [Note: expert parallelism] ep is not a dimension of the world: as in torchtitan, the ep ranks are
    borrowed from the ranks that shard the parameters (dp_shard · cp, Mesh.parameter_mesh), ep
    consecutive ones of them forming one ep group. A mixture of experts' routed experts are split over
    the ep group, ep rank i holding experts i · E/ep .. (i + 1) · E/ep - 1 whole (not sharded); every
    other parameter is sharded over dp_shard · cp as without ep. Tokens stay on the rank that reads
    them; the ones routed to an expert held elsewhere are sent there and their outputs sent back by
    all-to-all over the ep group. An expert's gradient sums the ep group's tokens; it is averaged over
    the ranks holding the same experts (parameter_mesh.dp / ep of them).
    """

    dp_shard: int = 1
    """Ranks a unit's parameters, gradients and optimizer state are sharded over (FSDP's shard group)."""
    dp_replicate: int = 1
    """Groups of dp_shard ranks holding the same shards, whose gradients are all-reduced across groups
    (HSDP); 1 is plain FSDP / ZeRO."""
    tp: int = 1
    """Ranks one tensor-parallel group slices each sharded module over (Plan.tensor_parallel)."""
    pp: int = 1
    cp: int = 1
    """Ranks one sequence is split over (context parallelism, [Note: context parallelism])."""
    ep: int = 1
    """Ranks a mixture of experts' routed experts are split over, borrowed from the dp_shard · cp ranks
    ([Note: expert parallelism])."""

    def __post_init__(self) -> None:
        for dim in (*MESH_DIMS, "ep"):
            if getattr(self, dim) < 1:
                raise PlanError(
                    f"mesh {dim}={getattr(self, dim)}: every mesh dimension is at least 1"
                )
        if (self.dp_shard * self.cp) % self.ep:
            raise PlanError(
                f"mesh ep={self.ep} does not divide dp_shard * cp = {self.dp_shard * self.cp}: the "
                "expert-parallel ranks are borrowed from the ranks that shard the parameters"
            )

    @property
    def dp(self) -> int:
        """Data-parallel replicas of the model: ranks that read different batches."""
        return self.dp_replicate * self.dp_shard

    @property
    def size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def parameter_mesh(self) -> "Mesh":
        """The mesh as the units see it: the cp ranks of a replica hold the same parameters and shard
        them as dp_shard ranks do (torchtitan's dp_shard_cp), so cp folds into dp_shard, shard index
        shard · cp + cp rank ([Note: rank layout]); their gradients are averaged over it as over
        data-parallel ranks, each cp rank's loss scaled to count for its share of the tokens."""
        return Mesh(
            dp_shard=self.dp_shard * self.cp, dp_replicate=self.dp_replicate, tp=self.tp, pp=self.pp
        )

    def describe(self) -> str:
        return " ".join(
            [
                f"{dim}={getattr(self, dim)}"
                for dim in MESH_DIMS
                if dim == "pp" or getattr(self, dim) > 1 or (dim == "dp_shard" and self.dp == 1)
            ]
            + ([f"ep={self.ep}"] if self.ep > 1 else [])
        )

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along each dimension ([Note: rank layout])."""
        found = {}
        for dim in reversed(MESH_DIMS):
            rank, found[dim] = divmod(rank, getattr(self, dim))
        return {dim: found[dim] for dim in MESH_DIMS}

    def stride(self, dim: str) -> int:
        """Distance in ranks between neighbours along `dim`: the product of the dimensions inside it."""
        return math.prod(getattr(self, inner) for inner in MESH_DIMS[MESH_DIMS.index(dim) + 1 :])

    def stage_of(self, rank: int) -> int:
        return rank // (self.dp * self.cp * self.tp)

    def replica_of(self, rank: int) -> int:
        """The data-parallel replica `rank` computes for (0..dp-1): its stages, cp and tp ranks read the
        same batch."""
        return rank // (self.cp * self.tp) % self.dp


TENSOR_PARALLEL_STYLE = re.compile(
    r"colwise|colwise_fused\([2-9][0-9]*\)|rowwise|vocab_embedding|vocab_head"
)
"""How a module is sliced over the tp ranks (passes/tensor_parallel.py finds them): "colwise" by output
features, "colwise_fused(n)" each of a fused projection's n chunks by output features, "rowwise" by input
features (partial products summed), "vocab_embedding" / "vocab_head" by vocabulary rows."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ShardedModule:
    """A module whose parameters the tp ranks slice, each holding 1/tp of them."""

    path: str
    style: str
    """One of TENSOR_PARALLEL_STYLE."""

    def __post_init__(self) -> None:
        if not TENSOR_PARALLEL_STYLE.fullmatch(self.style):
            raise PlanError(
                f"module {_shown(self.path)} has tensor-parallel style {_shown(self.style)}: use colwise, "
                "colwise_fused(n), rowwise, vocab_embedding or vocab_head"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class KeptWhole:
    """A module tensor parallelism could have sliced and does not, with the reason."""

    module: str
    reason: str


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallel:
    """What the mesh's tp ranks slice (nothing at tp = 1); every other parameter is whole on each tp rank."""

    sequence_parallel: bool = False
    """Activations between the sliced modules are split along the sequence over the tp ranks (Megatron SP)."""
    vocab_parallel: bool = False
    """Embedding tables and the LM head are sliced by vocabulary (listed in `sharded`)."""
    loss_parallel: bool = False
    """The loss runs on the vocab-parallel head's slices of the logits, which no rank holds whole
    (torchtitan's loss_parallel; [Note: loss on sharded logits] in runtime/vocab_parallel_loss.py): for
    a model whose loss the runtime knows (frontend/sharded_loss.py). False with a vocab-parallel head:
    its logits are gathered whole on every tp rank before the model's own loss."""
    sharded: tuple[ShardedModule, ...] = ()
    kept_whole: tuple[KeptWhole, ...] = ()
    """Pairs and tables the graph offered that stay whole: the plan says why (indivisible heads, a tie)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    """How one replica's batch flows: micro-batches, the pipeline schedule and the stages per rank."""

    num_micro_batches: int = 1
    name: str = "none"
    """"none" when pp == 1, else one of SCHEDULE_NAMES."""
    virtual_stages: int = 1
    """Stages each pipeline rank runs (v): the plan has pp · v stages, stage i on pipeline rank i mod pp
    ([Note: rank layout]); more than 1 only under MULTI_STAGE_SCHEDULES, and interleaved_1f1b needs 2 at
    least (at 1 it is 1f1b)."""

    def __post_init__(self) -> None:
        if self.num_micro_batches < 1:
            raise PlanError(f"schedule has {self.num_micro_batches} micro-batches: at least 1")
        if self.name not in SCHEDULE_NAMES:
            raise PlanError(
                f"schedule {self.name!r} is unknown: use one of {', '.join(SCHEDULE_NAMES)}"
            )
        if self.virtual_stages < 1 or (
            self.virtual_stages > 1 and self.name not in MULTI_STAGE_SCHEDULES
        ):
            raise PlanError(
                f"schedule {self.name!r} with {self.virtual_stages} virtual stages per rank: give 1, "
                f"or more than 1 under {' or '.join(MULTI_STAGE_SCHEDULES)}"
            )
        if self.name == "interleaved_1f1b" and self.virtual_stages < 2:
            raise PlanError(
                "schedule 'interleaved_1f1b' with 1 virtual stage per rank is 1F1B: give "
                "virtual_stages >= 2, or name '1f1b'"
            )

    def stages_of_rank(self, pipeline_rank: int, pp: int) -> tuple[int, ...]:
        """The stages pipeline rank `pipeline_rank` of `pp` runs, in order: pipeline_rank + k · pp for k
        below virtual_stages ([Note: rank layout])."""
        return tuple(pipeline_rank + k * pp for k in range(self.virtual_stages))

    def in_flight(self, stage: int, pp: int) -> int:
        """Micro-batches whose activations stage `stage` of `pp` holds at once, at one stage per rank:
        every one under GPipe; under 1F1B the forwards of its warm-up, min(m, pp - stage). The schedules
        with virtual stages or a deferred weight gradient are priced on their order of operations
        (costmodel/cost.py, [Note: virtual stages and the zero-bubble schedule])."""
        if pp == 1:
            return 1
        return (
            self.num_micro_batches
            if self.name == "gpipe"
            else min(self.num_micro_batches, pp - stage)
        )

    def runs_as(self, pp: int) -> str:
        """What the schedule does over `pp` stages, in words. 1F1B with fewer micro-batches than
        stages (as nanotron, Megatron and the runtime run it) degrades to fill-drain: the stages
        whose warm-up takes every micro-batch (pp - stage >= m: stages 0..pp - m) run every forward,
        then every backward, the later ones still alternate; its step takes (m + pp - 1)
        micro-batch times, as GPipe's does, and holds fewer activations late (in_flight)."""
        m = self.num_micro_batches
        words = f"{m} micro-batch(es)" + (f", {self.name}" if pp > 1 else "")
        if self.virtual_stages > 1:
            words += f" ({self.virtual_stages} stages per rank)"
        if pp > 1 and self.name == "1f1b" and m < pp:
            words += (
                f" (fewer micro-batches than the {pp} stages: fill-drain on stages 0..{pp - m})"
            )
        return words


@dataclass(frozen=True, kw_only=True, slots=True)
class MixedPrecision:
    """dtypes as torch spells them ("float32", "bfloat16")."""

    param_dtype: str = "float32"
    """dtype parameters are gathered and computed in."""
    reduce_dtype: str = "float32"
    """dtype of gradient reduction."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in FLOAT_DTYPES:
                raise PlanError(
                    f"mixed precision {name} {_shown(getattr(self, name))} is not a floating-point dtype "
                    f"shardplan computes in: use one of {', '.join(FLOAT_DTYPES)}"
                )


BF16_MIXED = MixedPrecision(param_dtype="bfloat16", reduce_dtype="float32")
"""How large models train on GPUs: fp32 master weights, bf16 compute, gradients reduced in fp32."""


@dataclass(frozen=True, kw_only=True, slots=True)
class UnitPrediction:
    """One unit as the cost model walks its stage's step (per micro-batch): for reports and pictures."""

    unit: str
    forward_bytes: int
    """Memory on the rank at the peak of the unit's forward: everything held then, not the unit's share."""
    backward_bytes: int
    """The same at the peak of its backward."""
    compute_s: float
    """Forward and backward compute, recomputation included."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Predicted:
    """What the cost model expects on one rank for one step (one replica batch)."""

    peak_bytes: int
    step_time_s: float
    memory_bytes: dict[str, int] = field(default_factory=dict)
    """Peak memory by category: sharded_state, gathered_params, activations, transient."""
    time_s: dict[str, float] = field(default_factory=dict)
    """Step time by component: compute, recompute, exposed_comm, bubble."""
    samples_per_s: float = 0.0
    mfu: float = 0.0
    """Model FLOPs utilization: the chain's forward and backward FLOPs of a step over the step time and the
    world's peak matmul rate. The FLOPs are counted as torch's FlopCounterMode and nanotron's get_flops
    (huggingface/nanotron 03b83fc8, src/nanotron/models/llama.py: qk and v logits over seq_len x seq_len) count
    them, attention over every score: a causal call's masked FLOPs (OpKind.masked_flops) stay in, though a
    profile that skips them (HardwareProfile.skips_masked_flops) does not time them."""
    units: tuple[UnitPrediction, ...] = ()
    """Every unit, in the plan's order (each stage's units in its own step)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Alternative:
    """A runner-up plan, summarized, with why it lost."""

    description: str
    peak_bytes: int
    step_time_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Reasoning:
    budget_bytes: int
    binding_constraint: str
    """What limits the plan, in words: "memory (96% of budget)" or "none: fastest plan fits"."""
    runner_ups: tuple[Alternative, ...] = ()


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceLimit:
    """The longest sequence whose predicted peak fits the budget at one micro-batch size
    (solver/shapes.py): what the runtime admits a batch by, and what `shardplan explain` shows."""

    micro_batch: int
    longest: int
    """0: not one token fits."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Everything `parallelize` needs to train the model, plus the predictions that justify it."""

    schema: str = SCHEMA
    fingerprint: str
    """Fingerprint of the captured graph (BlockChain.fingerprint)."""
    signature: str = ""
    """The model's structural signature (signature.py), which parallelize checks without capturing the
    model; empty in a plan of format 2 or built by hand, which the fingerprint checks instead."""
    model: str
    """The model's class name, for people."""
    world_size: int
    hardware: str
    inputs: tuple[InputSpec, ...]
    mesh: Mesh
    tensor_parallel: TensorParallel = TensorParallel()
    schedule: Schedule = Schedule()
    mixed_precision: MixedPrecision = MixedPrecision()
    optimizer: str = "adamw"
    units: tuple[Unit, ...]
    stages: tuple[Stage, ...]
    predicted: Predicted
    reasoning: Reasoning
    sequence_limits: tuple[SequenceLimit, ...] = ()
    """By micro-batch size, ascending; none where the inputs have no sequence dim or the plan was
    written by hand."""

    def __post_init__(self) -> None:
        _check_plan(self)

    @property
    def stage_of_unit(self) -> dict[str, int]:
        """Unit name → the index of the pipeline stage it runs on (a virtual stage where a rank runs
        several: stage i runs on pipeline rank i mod pp, [Note: rank layout])."""
        return {name: stage.index for stage in self.stages for name in stage.units}

    def to_json(self) -> str:
        """Deterministic bytes: same plan, same text. Checked against the schema from_json checks, so
        that a plan written (a file, a checkpoint) always loads back."""
        data = _to_data(self)
        _validate_schema(data, _WRITING_FIX)
        try:
            return json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
        except ValueError:  # NaN or infinity: the schema's bounds do not catch them
            raise PlanError(
                f"plan holds a number that is NaN or infinite, which JSON cannot hold: "
                f"{_WRITING_FIX}"
            ) from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        data = parse_json(text, "plan file", PlanError)
        if not isinstance(data, dict):
            raise PlanError("plan file must hold a JSON object")
        schema = data.get("schema")
        if schema not in READABLE_SCHEMAS:
            raise PlanError(
                f"plan schema {_shown(schema)} is not supported by this shardplan (reads "
                f"{', '.join(map(repr, READABLE_SCHEMAS))}): re-plan with this version, or install the "
                "version that wrote it"
            )
        upgraded = _upgrade(data)
        _validate_schema(upgraded, "the file was edited or written by another version")
        return _from_data(cls, upgraded, "plan")

    def diff(self, other: "Plan") -> list[str]:
        """What changes from this plan to `other`, one readable line per difference ([] if equal)."""
        return _diff(_to_data(self), _to_data(other), "")

    @property
    def batch_per_replica(self) -> int:
        """Samples one data-parallel replica takes a step: dim 0 of the first example input."""
        return self.inputs[0].shape[0] if self.inputs and self.inputs[0].shape else 1

    def summary(self, sizes: dict[str, int] | None = None) -> str:
        """The plan as plain text (what `shardplan plan` prints): the step, the units, the predicted
        memory and time; `sizes` (parameter name -> elements) counts each unit's parameters, without
        it the column counts parameter tensors."""
        from shardplan.common.sizes import format_bytes

        inputs = ", ".join(f"{input_label(spec)}: {input_shape(spec)}" for spec in self.inputs)
        batch = self.batch_per_replica
        counts = parameter_counts(self, sizes)
        labels = unit_labels([unit.name for unit in self.units])
        width = max([4, *map(len, labels.values())])
        lines = [
            f"plan for {self.model or 'model'} on {self.world_size} ranks of {self.hardware}",
            f"mesh: {mesh_words(self)}",
            f"schedule: {self.schedule.runs_as(self.mesh.pp)}; params "
            f"{self.mixed_precision.param_dtype}, grads reduced in {self.mixed_precision.reduce_dtype}",
            f"inputs per data-parallel rank: {inputs or 'none'}; global batch "
            f"{self.mesh.dp * batch} samples a step = {self.mesh.dp} data-parallel ranks x {batch}",
            "",
            f"{'stage':>5}  {'unit':<{width}}  {'strategy':<16} {'checkpoint':<10} {'offload':<7} "
            f"{'params' if counts else 'tensors':>7}",
        ]
        units = {unit.name: unit for unit in self.units}
        for stage in self.stages:
            for name in stage.units:
                unit = units[name]
                lines.append(
                    f"{stage.index:>5}  {labels[name]:<{width}}  {unit.strategy.value:<16} "
                    f"{unit.checkpoint.value:<10} {'yes' if unit.offload else 'no':<7} "
                    f"{format_count(counts[name]) if counts else str(len(unit.params)):>7}"
                )
        predicted = self.predicted
        lines += [
            "",
            f"peak memory per rank {format_bytes(predicted.peak_bytes)} "
            f"(budget {format_bytes(self.reasoning.budget_bytes)}):",
        ]
        lines += [
            f"  {name:<16} {format_bytes(value):>12}"
            for name, value in sorted(predicted.memory_bytes.items())
        ]
        lines.append(
            f"step time {predicted.step_time_s:.4g} s, {predicted.samples_per_s:.4g} samples/s, "
            f"MFU {predicted.mfu:.1%}:"
        )
        lines += [
            f"  {name:<16} {value:>12.4g} s" for name, value in sorted(predicted.time_s.items())
        ]
        lines += ["", f"binding constraint: {self.reasoning.binding_constraint}"]
        if self.reasoning.runner_ups:
            lines.append("runner-ups:")
            lines += [
                f"  {alt.step_time_s:>10.4g} s  {format_bytes(alt.peak_bytes):>12}  {alt.description}"
                for alt in self.reasoning.runner_ups
            ]
        return "\n".join(lines)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a crash mid-write leaves any previous file intact."""
        write_text_atomically(path, self.to_json())


def input_label(spec: InputSpec) -> str:
    """How people name an example input: "input 0" by its position, or its keyword ("labels")."""
    return f"input {spec.name}" if spec.name.isdigit() else spec.name


def input_shape(spec: InputSpec) -> str:
    """An example input's shape and dtype: "8 x 128 int64"."""
    return f"{' x '.join(map(str, spec.shape)) or 'scalar'} {spec.dtype}"


def _upgrade(data: dict) -> dict:
    """An older plan as this format says it. Format 1 (mesh dp × pp, no tensor parallelism): its dp
    ranks shard every unit, one replica group, tp = 1; the same ranks do the same work ([Note: rank
    layout]). Formats 1 and 2 record no signature, which is left empty; formats 1 to 3 no virtual stages
    and no sequence limits, formats 1 to 4 no cp, formats 1 to 5 no ep, formats 1 to 6 no
    loss_parallel, whose defaults say so. Formats 1 to 6 could name the dims of an input that may vary
    (dynamic_dims), which nothing read: every dim may, and the names are dropped."""
    if data.get("schema") != SCHEMA and isinstance(data.get("inputs"), list):
        data = {
            **data,
            "inputs": [
                {key: value for key, value in spec.items() if key != "dynamic_dims"}
                if isinstance(spec, dict)
                else spec
                for spec in data["inputs"]
            ],
        }
    if data.get("schema") == "shardplan.plan/1" and isinstance(data.get("mesh"), dict):
        mesh = dict(data["mesh"])
        mesh["dp_shard"] = mesh.pop("dp", None)
        data = {**data, "mesh": {**mesh, "dp_replicate": 1, "tp": 1}}
    return {**data, "schema": SCHEMA}


def unit_labels(names: list[str]) -> dict[str, str]:
    """Each unit's name as it tells units apart: a leading module path every unit shares is dropped
    ("model." where every module is under it), and a range's last module drops what it shares with
    its first ("model.layers.0..model.layers.3" -> "model.layers.0..3"), each module keeping its last two fields."""
    parts = [part.split(".") for name in names for part in name.split("..")]
    shared = os.path.commonprefix(parts) if len(parts) > 1 else []
    # a module keeps its last two fields ("layers.3", not "3")
    cut = min([len(shared)] + [max(0, len(fields) - 2) for fields in parts])
    return {
        name: _range_label([part.split(".")[cut:] for part in name.split("..")]) for name in names
    }


def _range_label(parts: list[list[str]]) -> str:
    first, *rest = parts
    if not rest:
        return ".".join(first)
    last = rest[-1]
    same = len(os.path.commonprefix([first, last[:-1]]))
    return ".".join(first) + ".." + ".".join(last[same:])


def parameter_counts(plan: Plan, sizes: dict[str, int] | None) -> dict[str, int] | None:
    """Each unit's parameters counted in elements, from `sizes` (parameter name -> elements); None
    where `sizes` is None or misses one of the plan's parameters."""
    if sizes is None or any(name not in sizes for unit in plan.units for name in unit.params):
        return None
    return {unit.name: sum(sizes[name] for name in unit.params) for unit in plan.units}


def format_count(count: int) -> str:
    """A number of parameters as people read it: 950, 12.6K, 3.41M, 8.03B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.3g}{suffix}"
    return str(count)


def mesh_words(plan: Plan) -> str:
    """The mesh in the words the command line uses throughout: "data-parallel ranks" read different
    batches; a "replica group" is HSDP's group of ranks holding the same shards; and whether any unit
    is sharded over the dp_shard ranks at all."""
    mesh = plan.mesh
    words = [f"{mesh.dp} data-parallel rank{'s' if mesh.dp > 1 else ''}"]
    if mesh.dp_replicate > 1:
        words.append(f"{mesh.dp_replicate} replica groups (HSDP) of {mesh.dp_shard}")
    if mesh.dp_shard > 1:
        sharded = sum(1 for unit in plan.units if unit.strategy is not ShardStrategy.REPLICATE)
        words.append(
            "every unit replicated: no state is sharded"
            if not sharded
            else f"{sharded} of {len(plan.units)} units sharded over dp_shard={mesh.dp_shard} ranks"
        )
    if mesh.pp > 1:
        words.append(f"{mesh.pp} pipeline stages")
    if mesh.tp > 1:
        words.append(f"tensor parallel over {mesh.tp} ranks")
    if plan.tensor_parallel.vocab_parallel:
        words.append(
            "the loss on the head's vocabulary slices"
            if plan.tensor_parallel.loss_parallel
            else "the head's logits gathered whole before the loss"
        )
    if mesh.cp > 1:
        words.append(f"each sequence split over {mesh.cp} context-parallel ranks")
    if mesh.ep > 1:
        words.append(f"routed experts split over {mesh.ep} expert-parallel ranks")
    return f"{mesh.describe()} ({'; '.join(words)})"


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan written by `Plan.save` (files past files.MAX_FILE_BYTES are refused).

    >>> plan = load_plan("plan.json")  # doctest: +SKIP
    """
    text = read_text(path, "plan file", PlanError)
    try:
        return Plan.from_json(text)
    except PlanError as error:  # from_json reads text, not a file: name the one that was read
        raise PlanError(f"plan file {os.fspath(path)!r}: {error}") from None


def _check_plan(plan: Plan) -> None:
    """The invariants `parallelize` relies on; each message names the fix."""
    if plan.world_size > MAX_WORLD_SIZE:
        raise PlanError(
            f"world_size {plan.world_size} is more than the {MAX_WORLD_SIZE} ranks shardplan plans for: "
            "give the number of ranks you launch"
        )
    _check_inputs(plan.inputs)
    _check_unicode(plan)
    sizes = [limit.micro_batch for limit in plan.sequence_limits]
    if sizes != sorted(set(sizes)) or any(size < 1 for size in sizes):
        raise PlanError(
            f"sequence_limits list micro-batches {sizes}: each size of 1 or more once, ascending; "
            "re-plan to have them computed"
        )
    if plan.mesh.size != plan.world_size:
        raise PlanError(
            f"mesh {plan.mesh.describe()} is {plan.mesh.size} ranks but world_size is {plan.world_size}: "
            "make pp * dp_replicate * dp_shard * cp * tp equal world_size"
        )
    if plan.mesh.tp == 1 and (
        plan.tensor_parallel.sharded
        or plan.tensor_parallel.sequence_parallel
        or plan.tensor_parallel.vocab_parallel
    ):
        raise PlanError(
            "the plan slices modules over tensor-parallel ranks but its mesh has tp=1: set mesh.tp, "
            "or drop tensor_parallel"
        )
    if plan.tensor_parallel.loss_parallel and not plan.tensor_parallel.vocab_parallel:
        raise PlanError(
            "the plan computes the loss on the head's vocabulary slices (loss_parallel) but does not "
            "slice the head by vocabulary: set vocab_parallel, or drop loss_parallel"
        )
    _unique(
        [m.path for m in plan.tensor_parallel.sharded],
        "tensor-parallel module",
        "list each sliced module once",
    )
    stages = plan.mesh.pp * plan.schedule.virtual_stages
    if len(plan.stages) != stages:
        raise PlanError(
            f"plan has {len(plan.stages)} stage(s) but pp={plan.mesh.pp} with "
            f"{plan.schedule.virtual_stages} virtual stage(s) per rank: give pp * virtual_stages "
            f"= {stages} stages"
        )
    if (plan.mesh.pp == 1) != (plan.schedule.name == "none"):
        raise PlanError(
            f"schedule {plan.schedule.name!r} with pp={plan.mesh.pp}: use 'none' without a pipeline "
            f"and one of {', '.join(SCHEDULE_NAMES[1:])} with one"
        )
    _check_micro_batches(plan)
    _unique([u.name for u in plan.units], "unit name", "rename one of the units")
    _unique([m for u in plan.units for m in u.modules], "module", "a module belongs to one unit")
    _unique(
        [p for u in plan.units for p in u.params],
        "parameter",
        "a parameter belongs to one unit's flat buffer",
    )
    in_order = [name for stage in plan.stages for name in stage.units]
    for index, stage in enumerate(plan.stages):
        if stage.index != index:
            raise PlanError(
                f"stage at position {index} has index {stage.index}: number stages 0..{stages - 1} in order"
            )
        if not stage.units:
            raise PlanError(
                f"stage {index} has no units: every pipeline stage runs at least one unit"
            )
    known = {u.name for u in plan.units}
    unknown = [name for name in in_order if name not in known]
    if unknown:
        raise PlanError(
            f"stages name unknown units {_shown(unknown)}: list each unit in Plan.units"
        )
    if in_order != [u.name for u in plan.units]:
        raise PlanError(
            "stages must hold every unit exactly once, in the order of Plan.units "
            f"(stages list {_shown(in_order)}, units are {_shown([u.name for u in plan.units])})"
        )


def _check_micro_batches(plan: Plan) -> None:
    """Each micro-batch holds a sample at least, and a pipeline's equal ones (its stages are cut at one micro-batch's
    shapes); a plan without inputs (written by hand) leaves the batch to its steps."""
    if not (plan.inputs and plan.inputs[0].shape):
        return
    count, batch = plan.schedule.num_micro_batches, plan.batch_per_replica
    if count > batch:
        raise PlanError(
            f"schedule has {count} micro-batches but one replica's batch is {batch} sample(s): give at "
            f"most {batch} micro-batches, or a larger batch"
        )
    if plan.mesh.pp > 1 and batch % count:
        raise PlanError(
            f"schedule splits one replica's batch of {batch} samples into {count} micro-batches, and a "
            f"pipeline runs equal ones: give a count that divides {batch}"
        )


def _check_inputs(inputs: tuple[InputSpec, ...]) -> None:
    _unique(
        [spec.name for spec in inputs], "input name", "name each input once", where="two inputs"
    )
    for spec in inputs:
        name = _shown(spec.name)
        if spec.dtype not in INPUT_DTYPES:
            raise PlanError(
                f"input {name} has dtype {_shown(spec.dtype)}, which is not a torch dtype: use one "
                f"of {', '.join(INPUT_DTYPES)}"
            )
        # dims checked before their product is taken: a million huge dims would multiply for minutes
        if (
            len(spec.shape) > MAX_NDIM
            or any(not 0 <= size <= MAX_DIM for size in spec.shape)
            or math.prod(spec.shape) > MAX_INPUT_NUMEL
        ):
            raise PlanError(
                f"input {name} has shape {_shown(list(spec.shape))}: at most {MAX_NDIM} dims, each "
                f"0..{MAX_DIM}, {MAX_INPUT_NUMEL} elements in all; re-plan from the real example inputs"
            )


def _check_unicode(plan: Plan) -> None:
    """Refuse lone surrogates (from undecodable bytes): JSON tools, terminals and fonts reject them."""
    text = json.dumps(_to_data(plan), ensure_ascii=False, sort_keys=True)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise PlanError(
            f"plan text {text[max(0, error.start - 40) : error.end + 10]!r} holds a lone surrogate "
            f"{text[error.start]!r}, which is not Unicode: rename the model, module or parameter "
            "(decode names as UTF-8)"
        ) from None


def _shown(value: object, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters: an error quotes what a file holds, which may be huge."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _key(key: str) -> str:
    """A key in the path of a field, as an error names it: `.name`, or `['odd key']` quoted."""
    return f".{key}" if key.isidentifier() and len(key) <= 80 else f"[{_shown(key)}]"


def _unique(names: list[str], what: str, fix: str, where: str = "two units") -> None:
    seen, repeated = set(), []
    for name in names:
        if name in seen:
            repeated.append(name)
        seen.add(name)
    if repeated:
        raise PlanError(f"{what} {_shown(sorted(set(repeated))[0])} appears in {where}: {fix}")


@functools.cache
def _schema() -> dict:
    with open(SCHEMA_PATH) as handle:
        return json.load(handle)


_WRITING_FIX = (
    "refused, as a file or checkpoint holding it would not load back: correct the figure it came "
    "from (a hardware profile's, a memory budget, or a Plan built by hand)"
)
"""What to do about a plan that fails the schema as it is written: shardplan makes none of its own."""


def _validate_schema(data: dict, cause: str) -> None:
    """Refuse `data` (a plan as JSON values) unless it matches the plan schema; `cause` ends the error."""
    import jsonschema

    errors = sorted(
        jsonschema.Draft202012Validator(_schema()).iter_errors(data), key=lambda e: list(e.path)
    )
    if errors:
        error = errors[0]
        where = "plan" + "".join(f"[{p}]" if isinstance(p, int) else _key(p) for p in error.path)
        message = (
            error.message if len(error.message) <= 200 else error.message[:200] + "..."
        )  # it quotes the value
        raise PlanError(
            f"plan field {where} does not match the plan schema: {message} "
            f"({len(errors)} problem(s) in all; {cause})"
        )


def _diff(old: Any, new: Any, where: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        lines = []
        for key in sorted(set(old) | set(new)):
            path = f"{where}.{key}" if where else key
            if key not in old:
                lines.append(f"{path}: added {json.dumps(new[key], sort_keys=True)}")
            elif key not in new:
                lines.append(f"{path}: removed")
            else:
                lines += _diff(old[key], new[key], path)
        return lines
    if (
        isinstance(old, list)
        and isinstance(new, list)
        and all(isinstance(x, dict) and "name" in x for x in old + new)
    ):
        before, after = {x["name"]: x for x in old}, {x["name"]: x for x in new}
        lines = [f"{where}: added {name!r}" for name in after if name not in before]
        lines += [f"{where}: removed {name!r}" for name in before if name not in after]
        for name in before:
            if name in after:
                lines += _diff(before[name], after[name], f"{where}[{name!r}]")
        if not lines and [x["name"] for x in old] != [x["name"] for x in new]:
            lines.append(f"{where}: reordered")
        return lines
    if (
        isinstance(old, float)
        and isinstance(new, float)
        and abs(old - new) <= 1e-9 * max(abs(old), abs(new))
    ):
        return []  # the same prediction summed in another order
    if old != new:
        return [f"{where}: {json.dumps(old, sort_keys=True)} -> {json.dumps(new, sort_keys=True)}"]
    return []


def _to_data(value: Any) -> Any:
    """Plain JSON values (dicts, lists, strings, numbers) of a plan's dataclasses, enums and tuples."""
    if dataclasses.is_dataclass(value):
        return {f.name: _to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_to_data(item) for item in value]
    if isinstance(value, dict):
        return {str(key): _to_data(item) for key, item in value.items()}
    return value


_type_hints = functools.cache(typing.get_type_hints)
"""A dataclass's field types, read once per class: a plan holds thousands of units."""


def _from_data(kind: Any, data: Any, where: str) -> Any:
    """Build `kind` (a type annotation) from parsed JSON, naming the path of any bad field."""
    origin = typing.get_origin(kind)
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if not isinstance(data, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(data).__name__}")
        hints = _type_hints(kind)
        names = {f.name for f in dataclasses.fields(kind)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PlanError(
                f"plan field {where} has unknown keys {_shown(unknown)}: the file was edited or "
                "written by another version"
            )
        values = {}
        for f in dataclasses.fields(kind):
            if f.name in data:
                values[f.name] = _from_data(hints[f.name], data[f.name], f"{where}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanError(f"plan field {where}.{f.name} is missing")
        try:
            return kind(**values)
        except (TypeError, ValueError) as error:
            raise PlanError(f"plan field {where} is inconsistent: {error}") from None
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        try:
            return kind(data)
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in kind)
            raise PlanError(
                f"plan field {where} is {_shown(data)}; expected one of {allowed}"
            ) from None
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"plan field {where} must be a list, got {type(data).__name__}")
        item_kind = typing.get_args(kind)[0]
        return tuple(_from_data(item_kind, item, f"{where}[{i}]") for i, item in enumerate(data))
    if origin is dict:
        if not isinstance(data, dict):
            raise PlanError(f"plan field {where} must be an object, got {type(data).__name__}")
        value_kind = typing.get_args(kind)[1]
        return {key: _from_data(value_kind, item, where + _key(key)) for key, item in data.items()}
    if kind is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise PlanError(f"plan field {where} must be a number, got {_shown(data)}")
        try:
            value = float(data)
        except OverflowError:  # an integer past 1e308
            value = math.inf
        if not math.isfinite(value):
            raise PlanError(
                f"plan field {where} is beyond the largest float (1.8e308): the file was edited; "
                "write it again"
            )
        return value
    if kind in (int, str, bool):
        if type(data) is not kind:
            raise PlanError(f"plan field {where} must be {kind.__name__}, got {_shown(data)}")
        return data
    raise PlanError(f"plan field {where}: unsupported type {kind}")
