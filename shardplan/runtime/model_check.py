"""Whether a plan is for this model, checked on every rank before anything is sharded.

[Note: start-up check] A plan records two facts of the model it was made for: the structural
signature (module classes, parameter and buffer names, shapes, dtypes, requires_grad;
signature.py) and the fingerprint of its captured graph (passes/blocks.py). The signature is read
in milliseconds; the fingerprint needs a torch.export capture of the model on every rank, seconds
on a small model and more on a deep one. So `parallelize` checks the signature, and the graph
only where it is captured anyway: with tp > 1 the layout is found in the graph of the plan's
input shapes (tensor_parallel.plan_layout), which is the graph the fingerprint hashes. A
pipeline's stages are cut from another capture (one micro-batch, the compute dtype), which does
not hash as the plan's graph. A plan without a signature (format 2, or from a chain built by
hand) and a caller who asks (`verify_graph=True`: the same parameters, another forward) get the
capture.
"""

import torch.fx
import torch.nn as nn

from shardplan.errors import PlanError
from shardplan.frontend.signature import SIGNATURE_VERSION, model_signature
from shardplan.plan import Plan


def check_model(model: nn.Module, plan: Plan, *, verify_graph: bool = False) -> None:
    """Refuse a plan made for another model (see [Note: start-up check])."""
    signed = plan.signature.startswith(SIGNATURE_VERSION + "-")
    if signed:
        found = model_signature(model)
        if found != plan.signature:
            raise PlanError(
                f"this plan was made for another model: its structural signature is {plan.signature}, "
                f"this {type(model).__name__}'s is {found} (module classes, or parameter and buffer "
                "names, shapes, dtypes or requires_grad differ): re-plan with shardplan.compile(model, "
                "...) for this model"
            )
    if plan.inputs and plan.mesh.tp == 1 and (verify_graph or not signed):
        check_graph(model, plan, plan_graph(model, plan))


def plan_graph(model: nn.Module, plan: Plan) -> torch.fx.GraphModule:
    """`model` captured at the plan's input shapes, with owners and no execution facts: the graph the
    plan's fingerprint hashes and its tensor-parallel layout is found in."""
    from shardplan.frontend.passes import meta_inputs, structural_graph

    return structural_graph(model, *meta_inputs(plan.inputs))


def check_graph(model: nn.Module, plan: Plan, graph: torch.fx.GraphModule) -> None:
    """Refuse the plan unless `graph` (plan_graph of `model`) hashes as the plan's fingerprint."""
    from shardplan.frontend.passes.blocks import fingerprint

    found = fingerprint(graph)
    if not plan.fingerprint.startswith(found.partition("-")[0] + "-"):
        raise PlanError(
            f"this plan's graph fingerprint {plan.fingerprint} was computed by another version of "
            "shardplan, which hashed graphs otherwise: re-plan with this version "
            "(shardplan plan ..., or shardplan.compile)"
        )
    if found != plan.fingerprint:
        raise PlanError(
            f"this plan was made for another model: its graph fingerprint is {plan.fingerprint}, "
            f"this {type(model).__name__} captures as {found} (with inputs "
            f"{', '.join(f'{i.name}{list(i.shape)}' for i in plan.inputs)}): re-plan with "
            "shardplan.compile(model, ...) for this model"
        )
