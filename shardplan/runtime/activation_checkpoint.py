"""Activation checkpointing of a unit's modules, the same for both backends.

A module's instance `forward` is replaced by a checkpointed call of the
original (the module class and its parameter names are untouched, unlike
`checkpoint_wrapper`). Each module of a unit is checkpointed on its own: only
its inputs are kept, and it is recomputed in backward just before its
gradient is needed.
"""

import contextlib
import functools
from typing import Callable

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode, _push_mode
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _CachedTorchDispatchMode,
    _CachingTorchDispatchMode,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardplan.plan import ALTERNATED_OPS, SELECTIVE_SAVED_OPS, Checkpoint

_aten = torch.ops.aten


def _this_torchs(names: tuple[str, ...]) -> frozenset:
    return frozenset(getattr(_aten, name).default for name in names if hasattr(_aten, name))


SAVED_BY_SELECTIVE = _this_torchs(SELECTIVE_SAVED_OPS)
"""The ops of plan.SELECTIVE_SAVED_OPS this torch has."""
ALTERNATED = _this_torchs(ALTERNATED_OPS)
"""The ops of plan.ALTERNATED_OPS this torch has."""


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return (
        CheckpointPolicy.MUST_SAVE
        if op in SAVED_BY_SELECTIVE
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


def _selective_contexts():
    return create_selective_checkpoint_contexts(_selective_policy)


def _alternate_contexts():
    """SELECTIVE_ALTERNATE's policy for one call of a checkpointed region: SELECTIVE's, but of the
    matmuls (ALTERNATED) only the odd ones are kept, counted from 1 in this call. The recompute replays
    the forward's ops in its order, and counts them afresh, so it recomputes the same ones the forward
    did not keep (torchtitan's `_get_custom_policy`)."""
    counts = {False: 0, True: 0}  # by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ALTERNATED:
            counts[ctx.is_recompute] += 1
            if counts[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return _selective_policy(ctx, op, *args, **kwargs)

    return create_selective_checkpoint_contexts(policy)


_CONTEXTS = {
    Checkpoint.SELECTIVE: _selective_contexts,
    Checkpoint.SELECTIVE_ALTERNATE: _alternate_contexts,
}
"""Each selective mode's context_fn: called once for each call of a checkpointed region."""


def checkpointed(forward: Callable, kind: Checkpoint) -> Callable:
    """`forward` recomputed in backward as `kind` says (non-reentrant torch.utils.checkpoint)."""
    if kind is Checkpoint.NONE:
        return forward
    options: dict[str, object] = {"use_reentrant": False}
    if kind.selective:
        options["context_fn"] = _CONTEXTS[kind]

    @functools.wraps(forward)
    def run(*args, **kwargs):
        # kwargs bound first so a module keyword can never collide with checkpoint's own options
        return checkpoint(functools.partial(forward, **kwargs), *args, **options)

    return run


@contextlib.contextmanager
def outside_selective_checkpoint():
    """Run the enclosed ops unseen by selective checkpointing's dispatch modes (and only by those).

    SAC records every op of its region and expects the same ops again in recompute; the
    runtime's own ops there (gathering a unit) depend on prefetch timing, which differs between
    forward and recompute. Other modes (MemTracker, FlopCounterMode) still see them. The SAC
    modes are innermost inside a checkpointed region, so popping from the top finds them."""
    popped = []
    while isinstance(
        _get_current_dispatch_mode(), (_CachingTorchDispatchMode, _CachedTorchDispatchMode)
    ):
        popped.append(_pop_mode())
    try:
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)
