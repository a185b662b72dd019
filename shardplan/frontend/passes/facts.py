"""The one metadata namespace passes write: node.meta["shardplan"], a frozen NodeFacts.

Frozen because torch.fx copies `meta` shallowly: a pass replaces the facts with
`dataclasses.replace`, it never mutates them in place.
"""

import dataclasses
from dataclasses import dataclass

import torch.fx

from shardplan.frontend.chain import OpKind

KEY = "shardplan"


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeFacts:
    module_path: str = ""
    """Deepest module whose forward produced this node ("" for the model's root)."""
    param_names: tuple[str, ...] = ()
    """Parameters (and buffers) this node reads directly."""
    out_bytes: int = 0
    """Bytes of the storages this node's outputs newly allocate (0 for views)."""
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_memory_bytes: int = 0
    """Bytes read and written by the node's memory-bound ops (those without counted FLOPs)."""
    bwd_memory_bytes: int = 0
    selective_calls: tuple["SelectiveCall", ...] = ()
    """The calls of the ops selective checkpointing keeps (plan.SELECTIVE_SAVED_OPS), in the order run:
    SELECTIVE_ALTERNATE keeps every second matmul of a module's call by that order."""
    fwd_ops: int = 0
    """Ops (kernels) the node runs, views not counted."""
    bwd_ops: int = 0
    fwd_dispatches: int = 0
    """Ops the node's forward dispatches, views included (metadata queries not)."""
    fwd_kinds: tuple[OpKind, ...] = ()
    """The forward's kernels by op name (the totals above, broken down)."""
    bwd_kinds: tuple[OpKind, ...] = ()
    outputs: tuple[tuple[int, int], ...] = ()
    """(storage id, bytes) of this node's outputs (views share their base's id)."""
    saved: tuple[tuple[int, int], ...] = ()
    """(storage id, bytes) of activations autograd saved while running this node."""
    fwd_live_before_bytes: int = 0
    """Activation bytes live (allocated by earlier ops, not yet freed) when this node began."""
    fwd_peak_live_bytes: int = 0
    """Most activation bytes live while this node ran."""
    bwd_order: int = -1
    """Position of this node's backward in the backward pass (-1: it has none)."""
    bwd_live_before_bytes: int = 0
    bwd_peak_live_bytes: int = 0
    bwd_moments: tuple[tuple[int, int], ...] = ()
    """(parameter gradients, other bytes) this node's backward held above bwd_live_before_bytes at the moments
    it may peak at another batch (execution.peak_moments): its peak, its most gradients, its most else."""
    bwd_param_grads: tuple[str, ...] = ()
    """Parameters whose gradients were accumulated while this node's backward ran (the analysis then
    drops them), as named by get_attr targets."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SelectiveCall:
    """One call of an op of plan.SELECTIVE_SAVED_OPS."""

    kind: OpKind
    """The call's op, FLOPs and bytes, as the node's fwd_kinds count it: what re-running it costs."""
    bytes: int
    """Bytes of its outputs' storages."""
    storages: tuple[int, ...]
    """Ids of those storages that outlive the node's ops (a node's output, a saved tensor); the rest
    (the scores a node's math attention makes inside it) are its own."""


def facts(node: torch.fx.Node) -> NodeFacts:
    return node.meta.get(KEY) or NodeFacts()


def update_facts(node: torch.fx.Node, **changes) -> None:
    node.meta[KEY] = dataclasses.replace(facts(node), **changes)


def is_compute(node: torch.fx.Node) -> bool:
    """An op of the model (not an input, output, attribute, or export's input-guard check)."""
    if node.op == "call_module" and str(node.target).startswith("_guards"):
        return False
    return node.op in ("call_function", "call_method", "call_module")


def within_module(path: str, module: str) -> bool:
    """Whether a module path is `module` or one of its submodules' ("h.1" is not within "h.10")."""
    return path == module or path.startswith(module + ".")
