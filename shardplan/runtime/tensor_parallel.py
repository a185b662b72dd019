"""Tensor parallelism on an eager model: Megatron-style slices held as plain tensors.

`apply_tensor_parallel(model, layout, group)` slices, on each rank of a tp group, the linears of a
TensorParallelLayout's pairs (passes/tensor_parallel.py) and puts two collectives around each pair:

- f before its column-parallel linears: identity in forward; in backward, the sum over the ranks
  of the input's gradient (each rank's gradient comes from its own slice of the features);
- g after its row-parallel linears: in forward, the sum over the ranks of their partial products
  (each from its own slice of the input features); identity in backward.

Parameters stay plain tensors, not DTensors, so shardplan's flat-buffer units flatten them like
any other: a unit over a sharded module holds this rank's slices (`ParameterSlice` says which part
of the full parameter that is). Sequence parallelism is not done: activations between the pairs
are whole on every tp rank (see [Note: whole parameters under tensor parallelism]).

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
"""
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import PlanError, RuntimeMismatchError
from ..passes.tensor_parallel import Style, TensorParallelLayout
from .collectives import Group, all_gather, all_reduce_sum, group_world, wait


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
        return (full.unflatten(self.dim, (self.chunks, self.degree, -1))
                .select(self.dim + 1, self.index).flatten(self.dim, self.dim + 1))

    def assemble(self, slices: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full parameter from every rank's slice, in tp-index order."""
        pieces = [piece.unflatten(self.dim, (self.chunks, -1)) for piece in slices]
        return torch.stack(pieces, dim=self.dim + 1).flatten(self.dim, self.dim + 2)

    def boxes(self) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
        """(offsets, sizes) in the full parameter of each piece this rank holds, in its local order:
        the chunks a checkpoint records for this rank (one piece, or one per fused chunk)."""
        width = self.full_shape[self.dim] // (self.chunks * self.degree)
        sizes = tuple(width if d == self.dim else size for d, size in enumerate(self.full_shape))
        return tuple((tuple((chunk * self.degree + self.index) * width if d == self.dim else 0
                            for d in range(len(self.full_shape))), sizes)
                     for chunk in range(self.chunks))


def apply_tensor_parallel(model: nn.Module, layout: TensorParallelLayout,
                          group: Group) -> dict[str, ParameterSlice]:
    """Slice `model`'s pairs in place for this rank of `group`, put f and g around them, and return
    the slice of every parameter this rank now holds a part of (the others stay whole).

    Every rank must hold the same full parameters before the call (same seed or same checkpoint)."""
    index, degree = group_world(group)
    if degree != layout.degree:
        raise RuntimeMismatchError(f"the layout shards over tp={layout.degree} ranks, the tp group has {degree}: "
                                   f"make the layout for tp={degree}, or the group of {layout.degree} ranks")
    slices = {}
    for pair in layout.pairs:
        pair_input = _PairInput(group)
        for linear in pair.linears:
            module = _linear(model, linear.module)
            if linear.style is Style.COLWISE:
                slices |= _slice_parameters(module, linear.module, ("weight", "bias"), 0, linear.chunks, index, degree)
                module.out_features //= degree
                module.register_forward_pre_hook(pair_input.enter)
            else:
                slices |= _slice_parameters(module, linear.module, ("weight",), 1, 1, index, degree)
                module.in_features //= degree
                # nn.Linear adds its bias before g would sum it over the ranks: this forward adds it after
                module.forward = functools.partial(_row_parallel_forward, module, pair_input)
    return slices


def gather_full_parameters(model: nn.Module, slices: dict[str, ParameterSlice],
                           group: Group) -> dict[str, torch.Tensor]:
    """Every parameter of `model`, whole, by name, on every rank of `group` (sliced ones gathered)."""
    full = {}
    for name, parameter in model.named_parameters():
        local = parameter.detach()
        if name in slices:
            gathered = wait(all_gather(local.contiguous().flatten(), async_op=False, group=group))
            local = slices[name].assemble(gathered.view(slices[name].degree, *local.shape).unbind(0))
        full[name] = local
    return full


def _linear(model: nn.Module, path: str) -> nn.Linear:
    module = model.get_submodule(path)
    if not isinstance(module, nn.Linear):
        raise PlanError(f"tensor-parallel layout slices {path!r} as a linear, but it is a "
                        f"{type(module).__name__}: make the layout from this model")
    return module


def _slice_parameters(module: nn.Module, path: str, names: tuple[str, ...], dim: int, chunks: int,
                      index: int, degree: int) -> dict[str, ParameterSlice]:
    found = {}
    for name in names:
        full = getattr(module, name)
        if full is None:
            continue
        if full.shape[dim] % (chunks * degree):
            raise PlanError(f"{path}.{name} has {full.shape[dim]} features along dim {dim}, not divisible into "
                            f"{chunks} chunk(s) × tp={degree}: make the layout from this model")
        cut = ParameterSlice(full_shape=tuple(full.shape), dim=dim, chunks=chunks, index=index, degree=degree)
        setattr(module, name, nn.Parameter(cut.take(full.detach()).clone(), requires_grad=full.requires_grad))
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
            self.entered = (x, _CopyToTensorParallel.apply(x, self.group))
        return (self.entered[1], *args[1:])

    def leave(self) -> None:
        self.entered = None


def _row_parallel_forward(module: nn.Linear, pair_input: _PairInput, x: torch.Tensor) -> torch.Tensor:
    pair_input.leave()
    total = _ReduceFromTensorParallel.apply(F.linear(x, module.weight), pair_input.group)
    return total if module.bias is None else total + module.bias


class _CopyToTensorParallel(torch.autograd.Function):
    """f: the whole input to every rank's column-parallel linears; its gradient summed over the ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a copy: autograd may hand the same gradient tensor to other consumers of the input
        return all_reduce_sum(grad.clone(memory_format=torch.contiguous_format), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: the row-parallel linear's partial products summed over the ranks; the gradient of the sum
    is already whole on every rank."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.mark_dirty(partial)  # summed in place: the linear's fresh output, which nothing else holds
        return all_reduce_sum(partial, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None
