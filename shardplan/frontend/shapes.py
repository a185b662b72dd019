"""One analysis for every sequence length: chains analyzed at three lengths, fitted, evaluated at any.

[Note: a chain as a function of the sequence length]
Everything a block's chain records grows with the sequence length S as a polynomial of degree at
most 2: a token's activations, kernels and FLOPs are linear in S, and attention's scores (their
bytes in an eager softmax, their FLOPs in every kernel) are quadratic; parameters, their gradients
and the ops that read only weights do not grow at all. So three analyses at S1 < S2 < S3 determine
every number of the chain at any S, exactly, by the quadratic through the three (Lagrange's form).
The batch needs no fit: the cost model already scales what grows with the replica batch and keeps
what does not (Block.bwd_peaks).

What the three chains must share is their structure: the same blocks, op kinds and strings. Where
it differs (a model that takes another branch at some length) `SequenceFit.of` refuses, and the way
out is to analyze at the length itself.
"""

from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

from shardplan.errors import ShardplanError
from shardplan.frontend.chain import BlockChain, InputSpec


def sequence_length(inputs: Sequence[InputSpec]) -> int:
    """The sequence length of a plan's or a chain's inputs: dim 1 of the first input of token ids (an
    integer tensor of two dims or more, [batch, sequence]); 0 where none is (features, images), whose
    dim 1 is no sequence."""
    return next(
        (
            spec.shape[1]
            for spec in inputs
            if len(spec.shape) >= 2 and spec.dtype.startswith(("int", "uint"))
        ),
        0,
    )


def inputs_at(inputs: Sequence[InputSpec], batch: int, length: int) -> tuple[InputSpec, ...]:
    """`inputs` with dim 0 `batch` long and every later dim that was the sequence `length` long."""
    planned = sequence_length(inputs)
    return tuple(
        replace(
            spec,
            shape=tuple(
                batch if dim == 0 else length if dim and size == planned else size
                for dim, size in enumerate(spec.shape)
            ),
        )
        for spec in inputs
    )


MIN_FITTED_LENGTH = 8
"""The shortest sequence a plan is fitted over lengths from: its quarter is still 2 tokens."""


def fit_lengths(length: int) -> tuple[int, int, int]:
    """The three lengths a fit analyzes for a plan made at `length`: itself and its half and quarter
    (small, so the analyses are cheap; the fit is exact beyond them, see the Note above)."""
    if length < MIN_FITTED_LENGTH:
        raise ShardplanError(
            f"a sequence of {length} is too short to fit the chain over lengths: plan at "
            f"{MIN_FITTED_LENGTH} or more"
        )
    return (length // 4, length // 2, length)


@dataclass(frozen=True, slots=True)
class SequenceFit:
    """The chain as a function of the sequence length (see [Note: a chain as a function of the
    sequence length])."""

    lengths: tuple[int, int, int]
    chains: tuple[BlockChain, BlockChain, BlockChain]

    @classmethod
    def of(cls, lengths: Sequence[int], chains: Sequence[BlockChain]) -> "SequenceFit":
        if len(lengths) != 3 or len(set(lengths)) != 3 or len(chains) != 3:
            raise ShardplanError(
                f"a sequence fit takes three chains at three distinct lengths, got {list(lengths)}"
            )
        order = sorted(range(3), key=lambda i: lengths[i])
        fit = cls(tuple(lengths[i] for i in order), tuple(chains[i] for i in order))  # type: ignore[arg-type]
        fit.chain_at(fit.lengths[0])  # the structures must agree: refuse now, not when priced
        return fit

    def chain_at(self, length: int) -> BlockChain:
        """The chain the model would analyze to at sequence length `length` (its batch as analyzed)."""
        if length < 1:
            raise ShardplanError(f"sequence length {length} holds no token: give 1 or more")
        weights = _lagrange_weights(self.lengths, length)
        planned = self.chains[-1]
        # The fingerprint names the graph at its own shapes, and `extra` holds the analysis's own
        # timings: neither is a function of the length. The inputs' sequence dims are (linear).
        return replace(
            _combine([replace(c, fingerprint="", extra={}) for c in self.chains], weights, "chain"),
            fingerprint=planned.fingerprint,
            extra=planned.extra,
        )


def _lagrange_weights(points: Sequence[int], at: int) -> tuple[float, ...]:
    """w_i with p(at) = Σ w_i p(points_i) for every polynomial p of degree < len(points)."""
    weights = []
    for i, xi in enumerate(points):
        w = 1.0
        for j, xj in enumerate(points):
            if j != i:
                w *= (at - xj) / (xi - xj)
        weights.append(w)
    return tuple(weights)


def _combine(values: Sequence[Any], weights: Sequence[float], path: str) -> Any:
    """The weighted sum of three like structures, leaf by leaf: numbers combined (ints rounded),
    everything else required equal."""
    first = values[0]
    if isinstance(first, bool) or first is None or isinstance(first, str):
        if any(v != first for v in values[1:]):
            raise _structure_differs(path, values)
        return first
    if isinstance(first, (int, float)):
        total = sum(w * v for w, v in zip(weights, values))
        return round(total) if isinstance(first, int) else total
    if is_dataclass(first) and not isinstance(first, type):
        changed = {
            f.name: _combine([getattr(v, f.name) for v in values], weights, f"{path}.{f.name}")
            for f in fields(first)
        }
        return replace(first, **changed)
    if isinstance(first, tuple):
        if any(len(v) != len(first) for v in values[1:]):
            raise _structure_differs(path, values)
        return tuple(
            _combine([v[i] for v in values], weights, f"{path}[{i}]") for i in range(len(first))
        )
    if isinstance(first, dict):
        if any(v.keys() != first.keys() for v in values[1:]):
            raise _structure_differs(path, values)
        return {k: _combine([v[k] for v in values], weights, f"{path}.{k}") for k in first}
    raise TypeError(f"{path}: cannot fit a {type(first).__name__} over sequence lengths")


def _structure_differs(path: str, values: Sequence[Any]) -> ShardplanError:
    shown = [str(v)[:60] for v in values]
    return ShardplanError(
        f"the model's chain changes structure with the sequence length at {path} ({shown}): "
        "its cost is no polynomial of the length; analyze it at the length you train"
    )
