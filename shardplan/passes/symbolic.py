"""Costs as formulas of the dynamic dims (batch, sequence length), so a plan can be inverted.

The model is captured once with its marked dims dynamic (torch.export gives a
graph valid for every size in range), then the execution pass runs that one
graph at a grid of sizes: three values per dim. Every cost of a block is a
polynomial of degree at most two in each dim (activations and FLOPs grow
linearly with batch, attention quadratically with sequence), so the grid
determines it exactly; sympy solves for the coefficients in rationals. One more
size, off the grid, checks each formula; a cost that is not such a polynomial
(a peak that switches between ops) is marked inexact and measured at the asked
size instead.

>>> from shardplan import zoo
>>> entry = zoo.gpt()
>>> dims = {"0": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}
>>> formulas = analyze_dynamic(entry.model, entry.args, entry.kwargs, dims)
>>> formulas.at(batch=8, seq=32).saved_bytes == 2 * formulas.at(batch=4, seq=32).saved_bytes
True
"""
import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

import sympy
import torch

from ..capture import capture
from ..chain import Block, BlockChain, InputSpec, OpKind
from ..errors import ShardplanError
from . import PassInputs, input_specs, meta_inputs, run_passes
from .blocks import build_chain

BLOCK_COSTS = ("fwd_flops", "bwd_flops", "saved_bytes", "input_bytes", "output_bytes",
               "fwd_transient_bytes", "bwd_transient_bytes", "fwd_memory_bytes", "bwd_memory_bytes", "selective_bytes",
               "fwd_ops", "bwd_ops")
KIND_COSTS = ("flops", "bytes", "weight_bytes")
"""Of every op kind (chain.OpKind) of a block's forward and backward; its calls do not change with size."""
CHAIN_COSTS = ("returned_bytes", "input_bytes")


@dataclass(frozen=True, kw_only=True)
class SymbolicChain:
    """A BlockChain whose costs are sympy formulas of the dynamic dims."""

    chain: BlockChain
    """The chain at the example inputs' sizes."""
    symbols: dict[str, sympy.Symbol]
    """Dim label ("batch", "seq") → its symbol in the formulas."""
    ranges: dict[str, tuple[int, int]]
    """Dim label → (smallest, largest) size the captured graph accepts."""
    formulas: dict[str, sympy.Expr]
    """"blocks[3].saved_bytes", "blocks[3].bwd_kinds[2].flops" or "returned_bytes" → its formula."""
    inexact: frozenset[str]
    """Formulas that failed the off-grid check, and "blocks[i].fwd_kinds" (or bwd) where other ops
    run at other sizes: `at` measures these instead."""
    measure: Callable[[dict[str, int]], BlockChain] = field(repr=False, compare=False)

    def at(self, **sizes: int) -> BlockChain:
        """The chain at these sizes (dims not given keep their example size)."""
        sizes = {**self.example_sizes, **sizes}
        for label, size in sizes.items():
            low, high = self.ranges[label]
            if not low <= size <= high:
                raise ShardplanError(f"{label}={size} is outside the range the model accepts, [{low}, {high}]")
        measured = self.measure(sizes) if self.inexact else self.chain  # read at inexact keys alone
        values: dict[str, Any] = {key: self._value(key, sizes, measured) for key in self.formulas}

        def kinds_at(block, phase: str) -> tuple[OpKind, ...]:
            if f"blocks[{block.index}].{phase}" in self.inexact:  # other ops run at other sizes
                return getattr(measured.blocks[block.index], phase)
            return tuple(dataclasses.replace(kind, **{name: values[f"blocks[{block.index}].{phase}[{k}].{name}"]
                                                      for name in KIND_COSTS})
                         for k, kind in enumerate(getattr(block, phase)))
        blocks = tuple(dataclasses.replace(block, **{name: values[f"blocks[{block.index}].{name}"]
                                                     for name in BLOCK_COSTS},
                                           fwd_kinds=kinds_at(block, "fwd_kinds"),
                                           bwd_kinds=kinds_at(block, "bwd_kinds"))
                       for block in self.chain.blocks)
        return dataclasses.replace(self.chain, blocks=blocks, inputs=self._inputs_at(sizes),
                                   **{name: values[name] for name in CHAIN_COSTS})

    def largest(self, label: str, fits: Callable[[BlockChain], bool], **fixed: int) -> int | None:
        """The largest size of `label` whose chain `fits` (assumed monotone), or None if none does."""
        low, high = self.ranges[label]
        if not fits(self.at(**{**fixed, label: low})):
            return None
        step = 1
        while low + step <= high and fits(self.at(**{**fixed, label: low + step})):
            low, step = low + step, step * 2
        high = min(high, low + step - 1)
        while low < high:
            middle = (low + high + 1) // 2
            if fits(self.at(**{**fixed, label: middle})):
                low = middle
            else:
                high = middle - 1
        return low

    @property
    def example_sizes(self) -> dict[str, int]:
        return _sizes_of(self.chain.inputs, self.chain.dynamic_dims)

    def _value(self, key: str, sizes: dict[str, int], measured: BlockChain) -> int:
        if key in self.inexact:
            return _read(measured, key)
        return int(self.formulas[key].subs({self.symbols[label]: size for label, size in sizes.items()}))

    def _inputs_at(self, sizes: dict[str, int]) -> tuple[InputSpec, ...]:
        return _inputs_at(self.chain.inputs, self.chain.dynamic_dims, sizes)


def analyze_dynamic(model: torch.nn.Module, example_inputs: tuple, example_kwargs: dict | None,
                    dynamic_dims: dict[str, dict[int, str]]) -> SymbolicChain:
    """Analyze `model` with the dims in `dynamic_dims` ({input: {dim: label}}) kept symbolic."""
    example_kwargs = dict(example_kwargs or {})
    captured = capture(model, example_inputs, example_kwargs, dynamic_dims)
    run_passes(captured.gm, last="retarget_device")
    dims = {(name, dim): label for name, spec in dynamic_dims.items() for dim, label in spec.items()}
    specs = input_specs(example_inputs, example_kwargs, dynamic_dims)
    ranges = _label_ranges(captured.dim_ranges, dims)
    extra = {"capture": captured.method, "model": type(model).__name__}

    def measure(sizes: dict[str, int]) -> BlockChain:
        inputs = _inputs_at(specs, dims, sizes)
        args, kwargs = meta_inputs(inputs)
        run_passes(captured.gm, first="execution", last="execution", inputs=PassInputs(args=args, kwargs=kwargs))
        return build_chain(captured.gm, inputs, extra, dims)

    example = _sizes_of(specs, dims)
    labels = sorted(example)
    grids = {label: _sample_sizes(example[label], *ranges[label]) for label in labels}
    points = [dict(zip(labels, values)) for values in itertools.product(*(grids[l][:3] for l in labels))]
    chains = [measure(point) for point in points]
    symbols = {label: sympy.Symbol(label, positive=True, integer=True) for label in labels}
    check_point = {label: grids[label][3] for label in labels}
    check = measure(check_point)
    varying = {f"blocks[{block.index}].{phase}" for block in chains[0].blocks for phase in ("fwd_kinds", "bwd_kinds")
               if len({_op_names(getattr(c.blocks[block.index], phase)) for c in chains + [check]}) > 1}
    keys = [key for block in chains[0].blocks for key in _block_keys(block)
            if key.rpartition("[")[0] not in varying] + list(CHAIN_COSTS)
    formulas = _interpolate(points, [[_read(chain, key) for key in keys] for chain in chains], symbols, keys)
    at_check = {symbols[label]: size for label, size in check_point.items()}
    inexact = varying | {key for key in keys if int(formulas[key].subs(at_check)) != _read(check, key)}
    return SymbolicChain(chain=measure(example), symbols=symbols, ranges=ranges, formulas=formulas,
                         inexact=frozenset(inexact), measure=measure)


def _interpolate(points, values, symbols, keys) -> dict[str, sympy.Expr]:
    """Exact tensor-product interpolation: monomials x^0..x^2 of every dim, one per grid point."""
    labels = sorted(symbols)
    exponents = list(itertools.product(range(3), repeat=len(labels)))
    basis = sympy.Matrix([[sympy.prod(sympy.Integer(point[l]) ** e for l, e in zip(labels, powers))
                           for powers in exponents] for point in points])
    coefficients = basis.LUsolve(sympy.Matrix(values))
    monomials = [sympy.prod(symbols[l] ** e for l, e in zip(labels, powers)) for powers in exponents]
    return {key: sympy.expand(sum(coefficients[row, column] * monomial for row, monomial in enumerate(monomials)))
            for column, key in enumerate(keys)}


def _sample_sizes(example: int, low: int, high: int) -> list[int]:
    """Four distinct sizes in [low, high] near the example: three for the grid, one to check."""
    candidates = [example, example // 2, (3 * example) // 4, example // 4, example + 1, example + 2, example + 3]
    sizes = list(dict.fromkeys(s for s in candidates if low <= s <= high and s >= 2))
    if len(sizes) < 4:
        raise ShardplanError(f"a dynamic dim of size {example} allows sizes [{low}, {high}]: too few to fit "
                             "formulas; give a larger example or leave the dim static")
    return sizes[:4]


def _label_ranges(dim_ranges: dict, dims: dict) -> dict[str, tuple[int, int]]:
    ranges: dict[str, tuple[int, int]] = {}
    for key, label in dims.items():
        low, high = dim_ranges.get(key, (2, 2**31 - 1))
        known = ranges.get(label, (low, high))
        ranges[label] = (max(low, known[0]), min(high, known[1]))
    return ranges


def _sizes_of(specs, dims) -> dict[str, int]:
    return {label: spec.shape[dim] for spec in specs for (name, dim), label in dims.items() if name == spec.name}


def _inputs_at(specs, dims, sizes) -> tuple[InputSpec, ...]:
    def shape(spec):
        return tuple(sizes.get(dims.get((spec.name, dim)), size) for dim, size in enumerate(spec.shape))
    return tuple(dataclasses.replace(spec, shape=shape(spec)) for spec in specs)


def _block_keys(block: Block) -> list[str]:
    """The keys of a block's costs: "blocks[3].saved_bytes", "blocks[3].bwd_kinds[2].flops"."""
    keys = [f"blocks[{block.index}].{name}" for name in BLOCK_COSTS]
    for phase in ("fwd_kinds", "bwd_kinds"):
        keys += [f"blocks[{block.index}].{phase}[{k}].{name}"
                 for k in range(len(getattr(block, phase))) for name in KIND_COSTS]
    return keys


def _op_names(kinds: tuple[OpKind, ...]) -> tuple[tuple[str, int], ...]:
    return tuple((kind.name, kind.calls) for kind in kinds)


def _read(chain: BlockChain, key: str) -> int:
    """The value at `key` (see _block_keys), or a chain-level cost by name."""
    value: Any = chain
    for part in key.split("."):
        name, _, index = part.partition("[")
        value = getattr(value, name)
        if index:
            value = value[int(index.rstrip("]"))]
    return value
