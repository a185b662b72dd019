"""Which module owns each node and which parameters it reads."""

import torch
import torch.fx

from shardplan.frontend.passes.facts import is_compute, update_facts


def canonical_names(gm: torch.fx.GraphModule) -> dict[str, str]:
    """Every name of every parameter and buffer → the name model.named_parameters() gives it.

    Tied weights (GPT-2's lm_head.weight is transformer.wte.weight) have several
    names for one tensor; plans and blocks use the first, as PyTorch does.
    """
    first: dict[int, str] = {}
    names: dict[str, str] = {}
    for name, tensor in [
        *gm.named_parameters(remove_duplicate=False),
        *gm.named_buffers(remove_duplicate=False),
    ]:
        names[name] = first.setdefault(id(tensor), name)
    return names


def annotate_ownership_pass(gm: torch.fx.GraphModule) -> None:
    """Write module_path (from torch.export's nn_module_stack) and param_names on every node."""
    canonical = canonical_names(gm)
    for node in gm.graph.nodes:
        if is_compute(node):
            path = (
                _readable(node.target) if node.op == "call_module" else stack_path(node)
            )  # symbolic_trace's leaves
            params = tuple(
                canonical[arg.target]
                for arg in node.all_input_nodes
                if arg.op == "get_attr" and arg.target in canonical
            )
            update_facts(node, module_path=path, param_names=params)


def stack_path(node: torch.fx.Node) -> str:
    """The innermost module on the node's nn_module_stack (torch.export's), dotted; "" at the model's root."""
    stack = node.meta.get("nn_module_stack") or {}
    return _readable(next(reversed(stack.values()))[0]) if stack else ""


def _readable(path: str) -> str:
    """torch.export spells some paths like "L['self'].h[0]" in old versions; keep dotted names."""
    return path.replace("L['self'].", "").replace("[", ".").replace("]", "")
