"""Tensor parallelism on an eager model: Megatron-style slices held as plain tensors.

`apply_tensor_parallel(model, layout, group)` slices, on each rank of a tp group, the linears of a
TensorParallelLayout's pairs (passes/tensor_parallel.py) and puts two collectives around each pair:

- f before its column-parallel linears: identity in forward; in backward, the sum over the ranks
  of the input's gradient (each rank's gradient comes from its own slice of the features);
- g after its row-parallel linears: in forward, the sum over the ranks of their partial products
  (each from its own slice of the input features); identity in backward.

With `layout.sequence_parallel` (Megatron's sequence parallelism, nanotron's REDUCE_SCATTER mode),
the activations between the pairs are sharded along the sequence (dim 1: [batch, seq, ...]), so
the norms, residual sums and dropout of each layer run on 1/tp of the tokens:

- the sequence enters sharded at the first layer (forward: this rank's slice; backward: all-gather)
  and is gathered after the last one (forward: all-gather; backward: this rank's slice), so the
  embeddings before and the head and loss after run whole, as without sequence parallelism;
- f becomes an all-gather along the sequence at the pair module's input (reduce-scatter in
  backward): the module (attention, MLP) runs on the whole sequence, shaping its tensors as usual;
- g becomes a reduce-scatter along the sequence (all-gather in backward).
The sequence length must divide by tp; see [Note: whole parameters under sequence parallelism].

With `layout.vocab`, the token embedding holds vocab / tp rows (a rank looks up the ids in its
rows, zeros the others, and g sums the ranks' lookups) and the LM head is column-parallel over the
vocabulary. With `layout.sharded_loss` the head returns this rank's slice of the logits, which the
loss reads as they are ([Note: loss on sharded logits] in vocab_parallel_loss.py: the caller installs
that loss); otherwise its logits are gathered whole before the model's own loss, which every rank
computes over the full logits.

Parameters stay plain tensors, not DTensors, so shardplan's flat-buffer units flatten them like
any other: a unit over a sharded module holds this rank's slices (`ParameterSlice` says which part
of the full parameter that is).

[Note: exchanges in captured graphs] Every collective above is one custom op,
shardplan::tensor_parallel_exchange (a collective in forward, another in backward, along a dim,
over a process group named by its name), not an autograd.Function: torch.export would trace
through a Function's forward and lose its backward, while a custom op stays one node of the graph,
with its autograd. So a capture of the sliced model (a pipeline stage's graph: [Note: tensor
parallel stages] in pipelined.py) runs the same exchanges as the eager model. A custom op returns
no view of its input: f's forward copies it, and g's forward sums a copy of the partial products
(g's backward, the identity, passes the gradient on uncopied).

The model's code runs unchanged, but it must not bake the full widths in: a rank's attention holds
heads / tp heads, so it must reshape with the sizes of its tensors (`view(batch, seq, -1, head_dim)`,
`reshape(batch, seq, -1)`), as the zoo GPT and Hugging Face's LLaMA do.

[Note: whole parameters under tensor parallelism] Without sequence parallelism, every tp rank holds
the same activations outside the pairs: a pair's input is whole on every rank, and its output is
g's sum, which an all-reduce computes once and hands to every rank. So the parameters left whole
(norms, embeddings, the head, the row-parallel linears' biases, added after g) see the same inputs
on every rank, and in backward the same output gradients: g passes the same gradient to every rank,
and f hands every rank the same summed input gradient. Their gradients are equal on every tp rank
and need no reduction over tp; the data-parallel reduction runs over the ranks with the same tp
index. (Dropout inside a pair would need per-rank random streams; the models here use none.)

[Note: whole parameters under sequence parallelism] Inside the sequence-parallel layers a whole
parameter (a norm's weight and bias, a row-parallel linear's bias, added after the reduce-scatter)
sees only this rank's tokens, so its gradient is this rank's part of the sum over the sequence:
`sequence_parallel_parameters(model, layout)` names them, and `sum_sequence_parallel_gradients`
adds their gradients over the tp group, after backward and before the optimizer (and before any
data-parallel reduction or gradient clipping; the order with the dp average does not matter, both
are sums). backend="shardplan" sums the same parameters on its units' flat gradients instead
(unit.py, [Note: units on the mesh]). The
sliced parameters need nothing: their pair gathered the whole sequence before using them. The
parameters outside the layers (embeddings, final norm, head) see the whole sequence on every rank:
equal gradients, as without sequence parallelism. (Dropout on the sharded sequence needs a random
stream per tp rank, as Megatron forks it; the models here use none.)
"""

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardplan.errors import PlanError, RuntimeMismatchError
from shardplan.frontend.passes.tensor_parallel import (
    Style,
    TensorParallelLayout,
    VocabCandidate,
    VocabKind,
)
from shardplan.frontend.sharded_loss import sharded_loss_refusal
from shardplan.plan import Plan, ShardedModule
from shardplan.runtime.collectives import (
    Group,
    all_gather,
    all_gather_along,
    all_reduce_sum,
    group_name,
    group_named,
    group_world,
    reduce_scatter_sum_along,
    wait,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterSlice:
    """The part of a full parameter one tp rank holds: to gather it back, and for checkpoints."""

    full_shape: tuple[int, ...]
    dim: int
    """The sliced dim: 0 for a colwise weight or bias (output features), 1 for a rowwise weight."""
    chunks: int
    """A fused projection's chunks (qkv: 3): the rank holds its part of each, in chunk order."""
    index: int
    """This rank's tp index."""
    degree: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of `full` (a view)."""
        return (
            full.unflatten(self.dim, (self.chunks, self.degree, -1))
            .select(self.dim + 1, self.index)
            .flatten(self.dim, self.dim + 1)
        )

    def assemble(self, slices: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every rank's slice, in tp-index order."""
        pieces = [piece.unflatten(self.dim, (self.chunks, -1)) for piece in slices]
        return torch.stack(pieces, dim=self.dim + 1).flatten(self.dim, self.dim + 2)

    def boxes(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """(offsets, sizes) in the full parameter of each piece this rank holds, in its local order:
        the chunks a checkpoint records for this rank (one piece, or one per fused chunk)."""
        width = self.full_shape[self.dim] // (self.chunks * self.degree)
        sizes = tuple(width if d == self.dim else size for d, size in enumerate(self.full_shape))
        return tuple(
            (
                tuple(
                    (chunk * self.degree + self.index) * width if d == self.dim else 0
                    for d in range(len(self.full_shape))
                ),
                sizes,
            )
            for chunk in range(self.chunks)
        )

    def runs(self) -> tuple[tuple[int, int, int], ...]:
        """(start in this rank's slice flattened, start in the full parameter flattened, numel) of each
        contiguous run of the slice: one per fused chunk and per index of the dims before the sliced one
        (a row-parallel weight's slice is one run per row)."""
        size = self.full_shape[self.dim]
        width = size // (self.chunks * self.degree)
        inner = math.prod(self.full_shape[self.dim + 1 :])
        return tuple(
            (
                (outer * self.chunks + chunk) * width * inner,
                (outer * size + (chunk * self.degree + self.index) * width) * inner,
                width * inner,
            )
            for outer in range(math.prod(self.full_shape[: self.dim]))
            for chunk in range(self.chunks)
        )

    def of_rank(self, index: int) -> "ParameterSlice":
        """The slice tp rank `index` holds."""
        return dataclasses.replace(self, index=index)

    def gather(self, local: torch.Tensor, group: Group) -> torch.Tensor:
        """The full parameter from this rank's `local` slice and its peers' in `group` (a collective)."""
        gathered = wait(all_gather(local.contiguous().flatten(), async_op=False, group=group))
        return self.assemble(gathered.view(self.degree, *local.shape).unbind(0))


def apply_tensor_parallel(
    model: nn.Module, layout: TensorParallelLayout, group: Group
) -> dict[str, ParameterSlice]:
    """Slice `model`'s pairs (and, with `layout.vocab`, its embedding and head) in place for this rank
    of `group`, put the collectives around them, and return the slice of every parameter this rank
    now holds a part of (the others stay whole). With `layout.sequence_parallel`, the norms' and row
    biases' gradients are partial sums: backend="shardplan" sums them over tp on its flat gradients
    (unit.py); a caller training the bare model calls `sum_sequence_parallel_gradients` after each backward.

    Every rank must hold the same full parameters before the call (same seed or same checkpoint)."""
    index, degree = group_world(group)
    if degree != layout.degree:
        raise RuntimeMismatchError(
            f"the layout shards over tp={layout.degree} ranks, the tp group has {degree}: "
            f"make the layout for tp={degree}, or the group of {layout.degree} ranks"
        )
    slices: dict[str, ParameterSlice] = {}
    for pair in layout.pairs:
        pair_input = _PairInput(group)
        if layout.sequence_parallel:
            model.get_submodule(pair.name).register_forward_pre_hook(
                functools.partial(_gather_pair_input, group), with_kwargs=True
            )
            combine = functools.partial(_reduce_scatter_sequence, group=group)
        else:
            combine = functools.partial(_reduce_partial_products, pair_input)
        for linear in pair.linears:
            module = _linear(model, linear.module)
            if linear.style is Style.COLWISE:
                slices |= _slice_parameters(
                    module, linear.module, ("weight", "bias"), 0, linear.chunks, index, degree
                )
                module.out_features //= degree
                if not layout.sequence_parallel:
                    module.register_forward_pre_hook(pair_input.enter)
            else:
                slices |= _slice_parameters(module, linear.module, ("weight",), 1, 1, index, degree)
                module.in_features //= degree
                # nn.Linear adds its bias before g would sum it over the ranks: this forward adds it after
                module.forward = functools.partial(_row_parallel_forward, module, combine)  # type: ignore[method-assign]
    for candidate in layout.vocab:
        slices |= _shard_vocabulary(model, candidate, group, not layout.sharded_loss)
    if layout.sequence_parallel:
        _shard_sequence_between(model, layout, group)
    return slices


def sequence_parallel_parameters(model: nn.Module, layout: TensorParallelLayout) -> tuple[str, ...]:
    """The whole parameters that see only this rank's tokens under sequence parallelism, whose
    gradients must be summed over tp (see [Note: whole parameters under sequence parallelism])."""
    if not layout.sequence_parallel:
        return ()
    sliced = {
        f"{linear.module}.{name}"
        for pair in layout.pairs
        for linear in pair.linears
        for name in (("weight", "bias") if linear.style is Style.COLWISE else ("weight",))
    }
    return tuple(
        f"{layer}.{name}"
        for layer in layout.sequence_layers
        for name, _ in model.get_submodule(layer).named_parameters()
        if f"{layer}.{name}" not in sliced
    )


def sum_sequence_parallel_gradients(model: nn.Module, names: Sequence[str], group: Group) -> None:
    """Add up over `group` the gradients of `names` (from `sequence_parallel_parameters`), in place."""
    parameters = dict(model.named_parameters())
    for name in names:
        grad = parameters[name].grad
        if grad is not None:
            all_reduce_sum(grad, group)


def gather_full_parameters(
    model: nn.Module, slices: dict[str, ParameterSlice], group: Group
) -> dict[str, torch.Tensor]:
    """Every parameter of `model`, whole, by name, on every rank of `group` (sliced ones gathered)."""
    return {
        name: slices[name].gather(parameter.detach(), group)
        if name in slices
        else parameter.detach()
        for name, parameter in model.named_parameters()
    }


def sharded_modules(layout: TensorParallelLayout) -> tuple[ShardedModule, ...]:
    """What `layout` slices, as a plan lists it (Plan.tensor_parallel.sharded)."""
    return tuple(
        ShardedModule(path=path, style=style) for path, style in layout.styles.items()
    ) + tuple(
        ShardedModule(path=candidate.module, style=f"vocab_{candidate.kind.value}")
        for candidate in layout.vocab
    )


def plan_layout(model: nn.Module, plan: Plan) -> TensorParallelLayout:
    """The layout `plan` was made with, found again in `model`'s captured graph at the plan's tp degree and
    options; refused when the graph is not the plan's, or slices other modules than the plan lists."""
    from shardplan.frontend.passes.tensor_parallel import find_tensor_parallel_pairs
    from shardplan.runtime.model_check import check_graph, plan_graph

    options = plan.tensor_parallel
    if not plan.inputs:
        raise PlanError(
            f"the plan shards over tp={plan.mesh.tp} ranks but records no inputs to find the "
            "tensor-parallel layout with: make it with shardplan.compile, or manual_plan(..., "
            "example_inputs=...)"
        )
    graph = plan_graph(model, plan)
    check_graph(
        model, plan, graph
    )  # the capture the layout needs checks the plan's graph too (parallelize skips it)
    layout = find_tensor_parallel_pairs(graph).layout(
        plan.mesh.tp,
        sequence_parallel=options.sequence_parallel,
        vocab_parallel=options.vocab_parallel,
        sharded_loss=options.loss_parallel,
    )
    refusal = (
        sharded_loss_refusal(model, layout.head) if layout.head and layout.sharded_loss else None
    )
    if refusal is not None:
        raise PlanError(
            f"the plan computes the loss on the head's vocabulary slices (loss_parallel), but {refusal}: "
            "re-plan for this model (its logits are then gathered whole before its loss)"
        )
    found, listed = set(sharded_modules(layout)), set(options.sharded)
    kept_whole = {kept.module: kept.reason for kept in (*layout.rejected, *layout.deferred)}
    for path in sorted(
        module.path for module in listed - found
    ):  # the plan's degree, not its model, may be why
        reason = next(
            (
                why
                for module, why in kept_whole.items()
                if path == module or path.startswith(module + ".")
            ),
            None,
        )
        if reason is not None and f"tp={plan.mesh.tp}" in reason:
            raise PlanError(
                f"the plan slices {path!r} over tp={plan.mesh.tp}, but {reason}: re-plan with a tp that "
                "divides them (shardplan.compile picks one)"
            )
    if found != listed:
        differ = sorted(module.path for module in found ^ listed)
        raise PlanError(
            f"the plan slices other modules over tp than this model offers ({len(differ)} differ, "
            f"first: {differ[0]!r}): it was made for another model or shardplan version; re-plan "
            "with shardplan.compile for this model"
        )
    return layout


def _linear(model: nn.Module, path: str) -> nn.Linear:
    module = model.get_submodule(path)
    if not isinstance(module, nn.Linear):
        raise PlanError(
            f"tensor-parallel layout slices {path!r} as a linear, but it is a "
            f"{type(module).__name__}: make the layout from this model"
        )
    return module


def _slice_parameters(
    module: nn.Module,
    path: str,
    names: tuple[str, ...],
    dim: int,
    chunks: int,
    index: int,
    degree: int,
) -> dict[str, ParameterSlice]:
    found = {}
    for name in names:
        full = getattr(module, name)
        if full is None:
            continue
        if full.shape[dim] % (chunks * degree):
            raise PlanError(
                f"{path}.{name} has {full.shape[dim]} features along dim {dim}, not divisible into "
                f"{chunks} chunk(s) × tp={degree}: make the layout from this model"
            )
        cut = ParameterSlice(
            full_shape=tuple(full.shape), dim=dim, chunks=chunks, index=index, degree=degree
        )
        setattr(
            module,
            name,
            nn.Parameter(cut.take(full.detach()).clone(), requires_grad=full.requires_grad),
        )
        found[f"{path}.{name}"] = cut
    return found


class _PairInput:
    """A pair's input entered through f once, however many column-parallel linears read it (q, k
    and v), so backward sums its gradient over the ranks once, as a fused qkv would."""

    def __init__(self, group: Group):
        self.group = group
        self.entered: tuple[torch.Tensor, torch.Tensor] | None = None
        """(input, f(input)) since the pair's first column-parallel linear ran; until its row-parallel one."""

    def enter(self, module: nn.Module, args: tuple) -> tuple:
        x = args[0]
        if self.entered is None or self.entered[0] is not x:
            self.entered = (x, exchange(x, "copy", "sum", 0, self.group))
        return (self.entered[1], *args[1:])

    def leave(self) -> None:
        self.entered = None


def _row_parallel_forward(module: nn.Linear, combine, x: torch.Tensor) -> torch.Tensor:
    total = combine(F.linear(x, module.weight))
    return total if module.bias is None else total + module.bias


def _reduce_partial_products(pair_input: _PairInput, partial: torch.Tensor) -> torch.Tensor:
    """g: the pair's output whole on every rank."""
    pair_input.leave()
    return exchange(partial, "sum", "copy", 0, pair_input.group)


_SEQUENCE = 1
"""The sequence dim of the activations between layers: [batch, seq, hidden]."""


def _reduce_scatter_sequence(partial: torch.Tensor, group: Group) -> torch.Tensor:
    """g under sequence parallelism: the sum over the ranks, this rank's tokens kept."""
    return exchange(partial, "scatter", "gather", _SEQUENCE, group)


def _gather_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """f under sequence parallelism: the whole sequence from every rank's tokens; its gradient summed
    over the ranks and cut back to this rank's tokens."""
    return exchange(x, "gather", "scatter", _SEQUENCE, group)


def gather_sequence_along(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim` in rank order; its gradient summed over the ranks and
    cut back to this rank's part (context parallelism's keys and values)."""
    return exchange(x, "gather", "scatter", dim, group)


def _gather_pair_input(
    group: Group, module: nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple, dict]:
    return map_pair_input(args, kwargs, functools.partial(_gather_sequence, group=group))


def map_pair_input(args: tuple, kwargs: dict, change) -> tuple[tuple, dict]:
    """A module's arguments (a pair's, a layer's) with its input (the first tensor argument,
    positional, else by keyword, as LLaMA's decoder layer calls its attention) replaced by `change(input)`."""
    if args and isinstance(args[0], torch.Tensor):
        return (change(args[0]), *args[1:]), kwargs
    name = next(key for key, value in kwargs.items() if isinstance(value, torch.Tensor))
    return args, {**kwargs, name: change(kwargs[name])}


def _shard_sequence_between(model: nn.Module, layout: TensorParallelLayout, group: Group) -> None:
    """The sequence enters sharded at the first layer and leaves gathered after the last; every layer
    of their container must be one of them (a layer between them sees the sharded sequence)."""
    layers = layout.sequence_layers
    container = layers[0].rpartition(".")[0]
    children = tuple(
        f"{container}.{name}" if container else name
        for name, _ in model.get_submodule(container).named_children()
    )
    if children != layers:
        missing = [child for child in children if child not in layers]
        raise PlanError(
            f"sequence parallelism runs the layers {layers[0]}..{layers[-1]} on a shard of the "
            f"sequence, but {container or 'the model'} also holds {missing} (whole layers, or modules "
            "of another kind): make the layout with sequence_parallel=False"
        )
    _, degree = group_world(group)

    def shard(x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[_SEQUENCE] % degree:
            raise RuntimeMismatchError(
                f"sequence parallelism shards the sequence (dim {_SEQUENCE} of {tuple(x.shape)}) over tp={degree} "
                f"ranks, which does not divide {x.shape[_SEQUENCE] if x.dim() > 1 else 'it'}: feed sequences "
                f"of a multiple of {degree} tokens (pad them), or make the layout with sequence_parallel=False"
            )
        return exchange(x, "local", "gather", _SEQUENCE, group)

    def leave(module: nn.Module, args: tuple, output):
        y = output if isinstance(output, torch.Tensor) else output[0]
        whole = exchange(y, "gather", "local", _SEQUENCE, group)
        return whole if isinstance(output, torch.Tensor) else (whole, *output[1:])

    model.get_submodule(layers[0]).register_forward_pre_hook(
        lambda _, args, kwargs: map_pair_input(args, kwargs, shard), with_kwargs=True
    )
    model.get_submodule(layers[-1]).register_forward_hook(leave)


def _shard_vocabulary(
    model: nn.Module, candidate: VocabCandidate, group: Group, gather: bool
) -> dict[str, ParameterSlice]:
    """Slice `candidate` over the vocabulary; a head's logits are gathered whole when `gather`."""
    index, degree = group_world(group)
    module = model.get_submodule(candidate.module)
    if candidate.kind is VocabKind.HEAD:
        head = _linear(model, candidate.module)
        slices = _slice_parameters(head, candidate.module, ("weight", "bias"), 0, 1, index, degree)
        head.out_features //= degree
        head.forward = functools.partial(_vocab_parallel_head, head, group, gather)  # type: ignore[method-assign]
        return slices
    if not isinstance(module, nn.Embedding) or module.max_norm is not None:
        raise PlanError(
            f"the layout shards {candidate.module!r} as a token embedding, but it is not a plain "
            "nn.Embedding (no max_norm): make the layout without vocab_parallel"
        )
    slices = _slice_parameters(module, candidate.module, ("weight",), 0, 1, index, degree)
    module.num_embeddings //= degree
    module.forward = functools.partial(  # type: ignore[method-assign]
        _vocab_parallel_lookup, module, index * module.num_embeddings, group
    )
    return slices


def _vocab_parallel_lookup(
    module: nn.Embedding, first: int, group: Group, ids: torch.Tensor
) -> torch.Tensor:
    """The rows of the ids this rank holds, zeros for the others, summed over the ranks (g)."""
    local = ids - first
    elsewhere = (local < 0) | (local >= module.num_embeddings)
    padding = module.padding_idx
    padding = (
        padding - first
        if padding is not None and 0 <= padding - first < module.num_embeddings
        else None
    )
    rows = F.embedding(
        local.masked_fill(elsewhere, 0),
        module.weight,
        padding,
        None,
        2.0,
        module.scale_grad_by_freq,
        module.sparse,
    )
    return exchange(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), "sum", "copy", 0, group)


def _vocab_parallel_head(
    module: nn.Linear, group: Group, gather: bool, x: torch.Tensor
) -> torch.Tensor:
    """Column-parallel logits over this rank's vocabulary, gathered whole for the model's loss when
    `gather`: in backward every rank holds the same gradient of the whole logits (the loss ran on every
    rank) and keeps its own columns."""
    logits = F.linear(exchange(x, "copy", "sum", 0, group), module.weight, module.bias)
    return exchange(logits, "gather", "local", -1, group) if gather else logits


def exchange(x: torch.Tensor, forward: str, backward: str, dim: int, group: Group) -> torch.Tensor:
    """The collective `forward` (one of _COLLECTIVES) in forward, `backward` in backward, over the tp
    `group` (see [Note: exchanges in captured graphs])."""
    return torch.ops.shardplan.tensor_parallel_exchange(
        x, forward, backward, dim, group_name(group)
    )


def _copy(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _sum(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    return all_reduce_sum(_copy(x, dim, group), group)


def _local_part(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    index, degree = group_world(group)
    return _copy(x.chunk(degree, dim)[index], dim, group)


_COLLECTIVES = {
    "copy": _copy,
    "sum": _sum,
    "gather": all_gather_along,
    "scatter": reduce_scatter_sum_along,
    "local": _local_part,
}
"""Each exchange's collective by name, (tensor, dim, group) → a new tensor: f is copy / sum, g sum /
copy, the sequence and vocabulary exchanges gather, scatter and local (this rank's part) along `dim`.
(Looked up when called, so a test may count the all-reduces through this module's all_reduce_sum.)"""

_WIDTH = {
    "gather": lambda size, degree: size * degree,
    "scatter": lambda size, degree: size // degree,
    "local": lambda size, degree: size // degree,
}
"""How each collective changes the size of `dim` over `degree` ranks (the others keep it)."""


@torch.library.custom_op("shardplan::tensor_parallel_exchange", mutates_args=())
def _exchange_op(
    x: torch.Tensor, forward: str, backward: str, dim: int, group: str
) -> torch.Tensor:
    return _COLLECTIVES[forward](x, dim, group_named(group))


@_exchange_op.register_fake
def _exchange_shape(
    x: torch.Tensor, forward: str, backward: str, dim: int, group: str
) -> torch.Tensor:
    shape = list(x.shape)
    if forward in _WIDTH:
        shape[dim] = _WIDTH[forward](shape[dim], group_world(group_named(group)).size)
    return x.new_empty(shape)


def _remember_exchange(ctx, inputs: tuple, output: torch.Tensor) -> None:
    _, ctx.forward, ctx.backward, ctx.dim, ctx.group = inputs


def _exchange_backward(ctx, grad: torch.Tensor):
    # g's backward is the identity: the gradient itself, no copy (autograd may pass one tensor on)
    back = (
        grad
        if ctx.backward == "copy"
        else _exchange_op(grad, ctx.backward, ctx.forward, ctx.dim, ctx.group)
    )
    return back, None, None, None, None


_exchange_op.register_autograd(_exchange_backward, setup_context=_remember_exchange)


def full_parameter(parameter: torch.Tensor, chunks: int, degree: int) -> torch.Tensor:
    """A parameter whole (a collective for a DTensor): a fused projection of `chunks` chunks sliced over
    `degree` tp ranks is put back from its rank-by-rank order (see fsdp2._ChunkedColwiseParallel)."""
    whole = (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach()
    if chunks == 1:
        return whole
    cut = ParameterSlice(
        full_shape=tuple(whole.shape), dim=0, chunks=chunks, index=0, degree=degree
    )
    return cut.assemble(whole.chunk(degree, dim=0))
