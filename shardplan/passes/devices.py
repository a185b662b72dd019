"""Point a graph captured on the meta device at the CPU, for the fake-tensor execution pass.

A model built on the meta device bakes `device=meta` into its graph (arange,
device moves, export's metadata asserts). The execution pass runs fake CPU
tensors, so that ops pick their CPU kernels; this pass rewrites those devices.
"""
import torch
import torch.fx
import torch.utils._pytree as pytree

_META = torch.device("meta")
_CPU = torch.device("cpu")


def retarget_meta_to_cpu_pass(gm: torch.fx.GraphModule) -> None:
    """Replace every meta device constant in node arguments (subgraphs included) with cpu."""
    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = pytree.tree_map(_retarget, node.args)
            node.kwargs = pytree.tree_map(_retarget, node.kwargs)
        module.recompile()


def _retarget(value):
    if isinstance(value, torch.device) and value == _META:
        return _CPU
    if isinstance(value, str) and value == "meta":
        return "cpu"
    return value
