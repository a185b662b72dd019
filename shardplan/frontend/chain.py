"""The chain of blocks: what the front end hands to the cost model and the solver.

Plain data, no torch: a block is a run of graph nodes owned by one module (a
transformer layer, the embedding, the head), with the totals the solver needs.
Bytes are per data-parallel replica batch given at capture (example inputs).
"""

import math
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

from shardplan.common.dtypes import dtype_name


@dataclass(frozen=True, kw_only=True, slots=True)
class OpKind:
    """Every call of one ATen op in a block's forward (or backward), summed: what the cost model
    prices one op at a time, each op name with the time factor a calibration measured for it."""

    name: str
    """The op's name without overload, as ATen spells it: "mm", "native_layer_norm", "gelu_backward"."""
    calls: int
    flops: int
    """0 for a memory-bound op (one without a FLOP formula)."""
    bytes: int
    """Read plus written: its tensors once each (passes/execution.py, moved_bytes)."""
    weight_bytes: int = 0
    """Of `bytes`, those of parameters and buffers: read whole by every micro-batch, while the
    rest (activations) splits over micro-batches."""
    masked_flops: int = 0
    """Of `flops`, those a causal mask hides: attention's products over the scores above the diagonal,
    which torch's FLOP formulas count as if computed. A kernel that skips masked blocks (FlashAttention-2)
    does not run them; a profile says which do (HardwareProfile.skips_masked_flops)."""
    head_dim_flops: int = 0
    """Of an attention op, each call's FLOPs times its head dim, summed: head_dim_flops / flops is the
    calls' head dim, FLOP-weighted, which a fused kernel's published rates are by (AttentionRate). 0 for
    any other op."""

    def __add__(self, other: "OpKind") -> "OpKind":
        """The calls of both, of this one's op name: every count summed (_OP_KIND_COUNTS)."""
        return OpKind(
            name=self.name,
            **{count: getattr(self, count) + getattr(other, count) for count in _OP_KIND_COUNTS},
        )


_OP_KIND_COUNTS = tuple(
    kind_field.name for kind_field in fields(OpKind) if kind_field.name != "name"
)
"""OpKind's fields that sum over calls: all but its name, read off the class so that none is left out."""


def merge_op_kinds(groups: Iterable[Iterable[OpKind]]) -> tuple[OpKind, ...]:
    """The op kinds of several nodes (or blocks) as one block's: summed by name, sorted by name."""
    totals: dict[str, OpKind] = {}
    for kinds in groups:
        for kind in kinds:
            totals[kind.name] = totals[kind.name] + kind if kind.name in totals else kind
    return tuple(totals[name] for name in sorted(totals))


@dataclass(frozen=True, kw_only=True, slots=True)
class TensorParallelFacts:
    """What of a block divides over the tp ranks, and the activations its tp ranks exchange.

    [Note: a block on a tp rank] (cost.on_rank reads these): over tp ranks, the sliced parameters and
    the sliced ops' FLOPs, bytes and outputs are 1/tp per rank and the rest stays whole (Megatron's
    column- then row-parallel pairs: the linears' weights and matmuls, and the attention between
    them, whose heads split). With sequence parallelism a layer between the pairs runs its norms,
    residual adds and dropout on 1/tp of the sequence, so every activation byte, FLOP and memory-bound
    op of the block divides and only its unsliced parameters stay whole (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", sec. 4.2.2: 34 sbh / t + 5 as²b / t),
    but for `gathered_saved_bytes`: the runtime gathers a pair's input along the sequence before its
    column-parallel linears, which keep that whole input for backward (Megatron keeps the shard and
    gathers it again in backward), and for one tensor of the hidden states a pair exchanges
    (`exchange_bytes`), whole while it is exchanged, so of the block's transients that much does not
    divide: a row-parallel linear's output is a whole-width partial sum until its reduce-scatter
    (forward), and a column-parallel linear's input gradient is whole until its reduce-scatter
    (backward) (benchmarks/probe_rank_peak.py); a row-parallel
    linear's output gradient, all-gathered whole before its matmuls, is held beside what the tp 1
    transient counts where that backward peaks (`gathered_bwd_peak_bytes`; benchmarks/probe_rank_peak.py).
    A vocab-parallel LM head whose loss runs on its vocabulary slices (`sharded_loss`) divides its
    logits and what its loss computes over them, saved or transient, forward and backward.

    Traffic: `all_reduces` all-reduces of `exchange_bytes` per replica batch without sequence
    parallelism (a pair: one in forward, one in backward; a vocab-parallel embedding: one in forward;
    the vocab-parallel head: one in backward); with it each becomes an all-gather and a
    reduce-scatter of the same bytes (which a ring moves in the same time as the all-reduce). A
    vocab-parallel head adds its `loss_exchanges`."""

    divides: int
    """tp must divide this for the block to slice (the gcd of its heads, kv heads, widths, vocabulary)."""
    sliced_numel: int
    """Parameters the tp ranks slice (the rest, norms and row-parallel biases, stay whole)."""
    fwd_kinds: tuple[OpKind, ...] = ()
    """Of the block's forward ops, the part that divides over tp (matmuls of sliced linears, attention)."""
    bwd_kinds: tuple[OpKind, ...] = ()
    sliced_fwd_flops: int = 0
    """Of fwd_flops, what divides (the sum of fwd_kinds' FLOPs where the block has kinds)."""
    sliced_bwd_flops: int = 0
    sliced_saved_bytes: int = 0
    """Of saved_bytes, the sliced ops' outputs (without sequence parallelism)."""
    gathered_saved_bytes: int = 0
    """Of saved_bytes, the inputs of the column-parallel linears: whole on every tp rank under
    sequence parallelism too (they are saved after its all-gather)."""
    sliced_bwd_transient_bytes: int = 0
    """Of the block's bwd_transient_bytes, what its sliced ops' backward makes at its peak (the gradients of
    the column-parallel features and of the sliced weights): 1/tp on a rank."""
    sliced_fwd_transient_bytes: int = 0
    """Of the block's fwd_transient_bytes (and of its recompute's), what its sliced ops make: 1/tp on a
    rank. An LM head's logits and its loss's tensors over them, where the loss runs on the vocabulary
    slices (`sharded_loss`); 0 elsewhere, where the transients scale as the saved bytes do."""
    gathered_bwd_peak_bytes: int = 0
    """Under sequence parallelism, what the op whose backward peaks holds whole beside its tp 1 allocations:
    a row-parallel linear's output gradient, all-gathered along the sequence before its matmuls (at tp 1 it
    was live before the op ran, the block's output gradient). 0 where another op peaks: there the whole-width
    tensor (`exchange_bytes`, a column-parallel input gradient) is one of the op's own allocations."""
    sliced_peak_grad_numel: int = 0
    """Of the block's bwd_peak_grad_numel, the sliced parameters' (1/tp on a rank)."""
    sequence_layer: bool = False
    """A layer between the pairs: with sequence parallelism all its activations divide."""
    sharded_loss: bool = False
    """A vocab-parallel LM head whose loss runs on its vocabulary slices (frontend/sharded_loss.py): its
    logits and the loss's tensors over them divide over tp (`sliced_*`); else its logits are gathered whole
    before the loss, which computes over them on every rank as at tp 1."""
    loss_exchanges: tuple[tuple[str, int], ...] = ()
    """(collective, full buffer bytes per replica batch) of each exchange between a vocab-parallel head and
    its loss, in forward (their backward moves nothing): the logits all-gathered whole, or under
    `sharded_loss` a float32 number per token twice (the ranks' log-sum-exps, all-gathered, priced as an
    all-reduce of one: the same ring traffic at tp 2, and latency-bound; the target logit, all-reduced)."""
    gathered_loss: "TensorParallelFacts | None" = None
    """Under `sharded_loss`, the same head's facts with its logits gathered whole before the loss: how a
    plan without loss_parallel runs it (solver/evaluate.py prices the plan's own)."""
    all_reduces: int = 0
    exchange_bytes: int = 0
    """The activation one exchange moves whole (the hidden states of the replica batch)."""
    sharded: tuple[tuple[str, str], ...] = ()
    """(module path, style) of what the tp ranks slice (plan.TENSOR_PARALLEL_STYLE)."""
    divisors: tuple[tuple[int, str], ...] = ()
    """(size, what it counts) behind `divides`, e.g. (4, "heads of h.0.attn.qkv"): what a refusal names."""

    def slices_at(self, degree: int) -> bool:
        return degree > 1 and self.divides % degree == 0

    def refusal(self, degree: int) -> str | None:
        """Why the block stays whole over `degree` tp ranks (None when it slices)."""
        if self.slices_at(degree) or degree == 1:
            return None
        return indivisible(self.divisors or ((self.divides, "sizes"),), degree, "this block")


def indivisible(divisors: Iterable[tuple[int, str]], degree: int, subject: str) -> str | None:
    """The sizes of `divisors` (size, what) that `degree` does not divide, as one line naming what would
    shard (`subject`); None if it divides them all."""
    divisors = tuple(divisors)
    missed = [(size, what) for size, what in divisors if size % degree]
    if not missed:
        return None
    sizes = ", ".join(f"{size} {what}" for size, what in missed)
    return f"{sizes} do not divide by tp={degree}: tp must divide {math.gcd(*(s for s, _ in divisors))} to shard {subject}"


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    """One candidate FSDP unit boundary segment of the captured graph."""

    index: int
    """Position in the chain, 0-based."""
    name: str
    """Owning module path, e.g. "transformer.h.3"; "" for ops at the model's root."""
    modules: tuple[str, ...]
    """Block-level module paths this block covers: its own, plus parameterless neighbours merged
    into it (a rotary embedding, a final norm that reads a tied weight). The model's root is not
    listed: its ops (a loss, a reshape) run wherever they fall."""
    param_names: tuple[str, ...]
    """Parameters first read in this block, as named by model.named_parameters()."""
    param_numel: int
    param_bytes: int
    """Bytes of those parameters in the dtype the model was captured with."""
    buffer_bytes: int
    fwd_flops: int
    """FLOPs of the forward, as torch.utils.flop_counter counts them."""
    bwd_flops: int
    """FLOPs of the backward (input and weight gradients), counted the same way."""
    saved_bytes: int
    """Activation bytes autograd keeps from this block's forward until its backward.

    A tensor saved by several blocks is counted in the first; parameters are not counted."""
    input_bytes: int
    """Bytes of the activations a checkpointed block keeps: what its modules' calls read from outside them
    (an earlier block's output), and what its ops outside its modules (at the model's root) save, as the
    runtime checkpoints each module's forward on its own; in a chain built by hand, what it reads from
    earlier blocks.

    A tensor several blocks keep (an encoder's output, a position bias) is counted in the first."""
    output_bytes: int
    """Bytes of the activations later blocks read from this block."""
    fwd_transient_bytes: int
    """Peak bytes allocated during this block's forward beyond what was live when it began."""
    recompute_transient_bytes: int | None = None
    """Of the forward, the peak of its modules' own ops, which a checkpointed block's recompute re-runs (the
    runtime checkpoints modules): below fwd_transient_bytes where ops at the model's root peak after them
    (a loss's float logits and log-softmax after the head). None in a chain built by hand: the whole forward."""
    bwd_transient_bytes: int
    """Peak bytes allocated during this block's backward beyond what was live when it began
    (parameter gradients excluded but those the op at the peak makes: the rest are bwd_peak_grad_numel)."""
    bwd_peaks: tuple[tuple[int, int], ...] = ()
    """(parameter gradients, other bytes) the backward holds above its start at the moments it may peak: its
    peak (bwd_transient_bytes in all), where it holds the most gradients, where it holds the most of the rest.
    The gradients (a linear's weight gradient, an embedding's whole table) do not grow with the batch nor
    split over micro-batches, the rest does, so at another batch another moment may peak (a head's loss
    backward, before its weight gradient is made). Empty in a chain built by hand: its transient grows whole."""
    first_node: str
    last_node: str
    fwd_memory_bytes: int = 0
    """Bytes read and written by the forward's memory-bound ops (all but matmul-like ones)."""
    bwd_memory_bytes: int = 0
    fwd_ops: int = 0
    """Kernels the forward runs (views not counted): each pays a fixed launch / dispatch cost."""
    bwd_ops: int = 0
    fwd_dispatches: int = 0
    """Ops the forward dispatches, views included (metadata queries not): each passes through every
    dispatch mode around it (selective checkpointing's, in forward and in recompute)."""
    selective_bytes: int = 0
    """Output bytes of the block's matmul-like ops (plan.SELECTIVE_SAVED_OPS): what selective
    checkpointing keeps besides the block's input."""
    bwd_peak_grad_numel: int = 0
    """Parameters whose gradients the block's backward made before the op where it peaks: beside its
    transient there, held until its unit's backward ends ([Note: gradients in backward] in cost.py). 0 in
    a chain built by hand."""
    selective_saved_bytes: int = 0
    """Of saved_bytes, those selective checkpointing keeps anyway (the block's inputs and matmul-like
    outputs that autograd saves): the rest is recomputed. A kept output autograd does not save (a
    head's logits, which the loss's log-softmax reads) is held besides saved_bytes."""
    selective_dropped_bytes: int = 0
    """Of selective_bytes, the outputs autograd does not save that the block's recompute re-reads and
    drops before its backward (a Llama layer's query, key and output projections'): kept until then, not
    at its backward's peak. 0 in a chain built by hand."""
    alternate_bytes: int = 0
    """Of selective_bytes, what SELECTIVE_ALTERNATE keeps: attention's outputs and every second matmul's of
    each module call (plan.Checkpoint.SELECTIVE_ALTERNATE)."""
    alternate_saved_bytes: int = 0
    """selective_saved_bytes under SELECTIVE_ALTERNATE: of saved_bytes, its inputs and the outputs it keeps."""
    alternate_dropped_bytes: int = 0
    """selective_dropped_bytes under SELECTIVE_ALTERNATE: of alternate_bytes, those its recompute drops."""
    alternate_recompute_kinds: tuple[OpKind, ...] = ()
    """The matmuls SELECTIVE keeps and SELECTIVE_ALTERNATE re-runs (of fwd_kinds), by name: what its
    recompute runs beyond SELECTIVE's. Empty in a chain built by hand."""
    fwd_kinds: tuple[OpKind, ...] = ()
    """The forward's ops by name; they add up to fwd_flops, fwd_ops and (the FLOP-less ones)
    fwd_memory_bytes. Empty in a chain built by hand: the cost model then prices the totals."""
    bwd_kinds: tuple[OpKind, ...] = ()
    """The backward's ops by name, likewise."""
    tensor_parallel: TensorParallelFacts | None = None
    """What divides over tp ranks; None: the block stays whole on every tp rank."""
    attention_kv_bytes: int = 0
    """Bytes of the keys and values the block's scaled_dot_product_attention reads: what context
    parallelism gathers over the cp ranks ([Note: context parallelism] in plan.py). 0 in a chain
    built by hand."""
    expert_param_numel: int = 0
    """Of param_numel, the routed experts' (3-D parameters named as plan.ROUTED_EXPERT_PARAMETERS):
    what expert parallelism splits over the ep ranks ([Note: expert parallelism] in plan.py). 0 in a
    chain built by hand."""
    routed_experts: int = 0
    """Experts each of the block's routed-expert modules holds (the expert dim of its parameters): the ep
    degrees that split them evenly. 0 in a chain built by hand."""
    routed_elements: int = 0
    """Elements of the hidden states one forward sends to the block's routed experts (tokens · top-k ·
    hidden): what expert parallelism's all-to-all dispatches, and combines back. 0 in a chain built
    by hand."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockChain:
    """The captured model reduced to a chain of blocks, in execution order."""

    blocks: tuple[Block, ...]
    fingerprint: str
    """Hash of the captured graph's structure and parameter shapes: a plan for another model fails."""
    signature: str = ""
    """The model's structural signature (signature.py): what parallelize checks without a capture;
    empty in a chain built by hand, whose plans are checked by the fingerprint."""
    param_dtype: str
    """dtype of the parameters (the master weights), e.g. "float32"."""
    compute_dtype: str = ""
    """dtype the analysis computed in, which every activation, transient and op byte is priced in: mixed
    precision's param_dtype (passes.analyze's compute_dtype); "": the parameters' own."""
    inputs: tuple["InputSpec", ...]
    input_bytes: int
    """Bytes of the example inputs (one replica's batch)."""
    returned_bytes: int = 0
    """Bytes of the model's outputs that autograd does not save (e.g. a Hugging Face model's
    logits beside its loss): held by the caller from the end of forward through backward."""
    skip_edges: tuple[tuple[int, int], ...] = ()
    """(i, j), j > i + 1: block j reads an activation block i made (a skip connection), which a stage
    cut between them must send on."""
    tied_edges: tuple[tuple[int, int], ...] = ()
    """(i, j): block j reads a parameter block i holds (tied weights): a stage cut between them would
    need the parameter on two stages."""
    frozen_params: tuple[str, ...] = ()
    """Parameters with requires_grad=False: a unit starts wherever blocks turn frozen or trainable."""
    module_classes: dict[str, str] = field(default_factory=dict)
    """Module path → class name for every block's modules: constraints match either."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form facts for reports (node count, capture method, seconds spent)."""

    @property
    def computes_in(self) -> str:
        """The dtype the chain's activations were priced in."""
        return self.compute_dtype or dtype_name(self.param_dtype)

    @property
    def param_numel(self) -> int:
        return sum(b.param_numel for b in self.blocks)

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks)

    @property
    def fwd_flops(self) -> int:
        return sum(b.fwd_flops for b in self.blocks)

    @property
    def bwd_flops(self) -> int:
        return sum(b.bwd_flops for b in self.blocks)

    @property
    def saved_bytes(self) -> int:
        return sum(b.saved_bytes for b in self.blocks)


@dataclass(frozen=True, kw_only=True, slots=True)
class InputSpec:
    """Shape and dtype of one example input, so each rank can capture again on fake data."""

    name: str
    """Positional index as a string ("0", "1") or the keyword name."""
    shape: tuple[int, ...]
    dtype: str
