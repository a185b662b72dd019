"""Point a graph captured on one device at another.

A model built on the meta device bakes `device=meta` into its graph (arange,
device moves, export's metadata asserts). The execution pass runs fake CPU
tensors, so that ops pick their CPU kernels; a pipeline stage runs its graph
on the rank's device. Both rewrite those device constants.
"""

import torch
import torch.fx
import torch.utils._pytree as pytree


def retarget_device_pass(
    gm: torch.fx.GraphModule,
    source: torch.device = torch.device("meta"),
    target: torch.device = torch.device("cpu"),
) -> None:
    """Replace every `source` device constant in node arguments (subgraphs included) with `target`."""
    if source == target:
        return

    def retarget(value):  # graphs spell a device as a torch.device or as its name
        if isinstance(value, torch.device) and value == source:
            return target
        return str(target) if isinstance(value, str) and value == str(source) else value

    for module in gm.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            node.args = pytree.tree_map(retarget, node.args)
            node.kwargs = pytree.tree_map(retarget, node.kwargs)
        module.recompile()
