"""The plan's pipeline schedules as torch.distributed.pipelining's classes, over any number of micro-batches.

Imported only when a pipelined program starts (pipelined.schedule_class): torch's pipelining package takes
about a second to import.

[Note: 1F1B over fewer micro-batches than stages] A plan may name 1F1B with m < pp micro-batches
(Schedule.runs_as): stage s warms up with min(m, pp - s) forwards, so the stages with pp - s >= m run every
forward, then every backward (fill-drain), the later ones alternate, and stage s holds min(m, pp - s)
micro-batches' activations (Schedule.in_flight, which the solver prices). torch's Schedule1F1B computes
exactly that warm-up, but its __init__ refuses m < pp since pytorch/pytorch#144702, only to guard
against a hang at m = 1 (pytorch/torchtitan#775; "it should not be a restriction", its author says there).
The likely cause: at m = 1 stage 0's first point-to-point op is a send fused with a receive (the
warm-up's last send waits for the first backward's receive), and under NCCL the first batch_isend_irecv
of a group needs every rank of it. So m = 1 runs ScheduleGPipe, whose order is then 1F1B's on every
stage (one forward, one backward), with the sends and receives each on their own; 2 <= m < pp runs
Schedule1F1B's own steps without the refusal (stage 0 warms up with m >= 2 forwards: its first op is a
plain send); m >= pp runs Schedule1F1B itself. Tested with gloo (tests/test_pipeline.py), not NCCL.
"""

from collections.abc import Callable
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.pipelining._backward import stage_backward_input
from torch.distributed.pipelining.schedules import PipelineScheduleSingle


class FewerMicroBatches1F1B(Schedule1F1B):
    """Schedule1F1B over 2 <= m < pp micro-batches (see [Note: 1F1B over fewer micro-batches than stages])."""

    def __init__(self, stage, n_microbatches: int, **options):
        # Schedule1F1B.__init__ is its parent's plus the refusal of m < pp (pytorch/pytorch#144702)
        PipelineScheduleSingle.__init__(self, stage, n_microbatches, **options)


def one_f_one_b(stage, n_microbatches: int, **options) -> PipelineScheduleSingle:
    """A 1F1B schedule of `stage` over any number of micro-batches, made as torch's schedule classes are
    (see [Note: 1F1B over fewer micro-batches than stages])."""
    if n_microbatches == 1:
        return ScheduleGPipe(stage, n_microbatches, **options)
    if n_microbatches < stage.num_stages:
        return FewerMicroBatches1F1B(stage, n_microbatches, **options)
    return Schedule1F1B(stage, n_microbatches, **options)


class FlatUnitStage(PipelineStage):
    """A PipelineStage whose backward splits, for the zero-bubble schedule, over flat units (backend
    "shardplan").

    [Note: the split backward of flat units] ScheduleInterleavedZeroBubble runs each backward as an input
    gradient (B), sent on at once, and a weight gradient (W), deferred. torch's PipelineStage finds what W
    needs from the stage module's parameters: the autograd nodes where each parameter's path joins the
    inputs' (stage_backward_input keeps their gradients in B and retains the graph), and W asks autograd for
    the parameters' gradients from there. A stage of flat units reads its parameters as views of each
    unit's gathered buffer (scheduler._GatherFlat), so its weights are the units' shards, and W runs
    through _GatherFlat's backward, which hands the buffer's gradient to the scheduler (reduced, added into
    the shard's .grad) and returns none to autograd: W asks for the shards' gradients allowing them unused,
    and keeps nothing it returns. Stage 0, whose inputs take no gradient, runs its whole backward as W
    (torch's own rule)."""

    def __init__(self, *args: Any, shards: tuple[torch.nn.Parameter, ...], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.shards = shards

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward=False):
        if backward_type == "input":
            return stage_backward_input(
                bwd_kwargs["stage_output"],
                bwd_kwargs["output_grads"],
                bwd_kwargs["input_values"],
                iter(self.shards),
            )
        if backward_type == "weight":
            _weight_gradients(bwd_kwargs["param_groups"])
            return (), None
        return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


def _weight_gradients(param_groups: list[dict[str, Any]]) -> None:
    """W of the split backward (see [Note: the split backward of flat units]): each group's kept gradients
    run from its intermediate nodes to its shards, each intermediate's once (a prehook hands it the kept
    gradient, as torch's stage_backward_weight does, so no path through a later intermediate adds again)."""
    for group in param_groups:
        intermediates, kept = group.pop("intermediates"), group.pop("grads")
        edges, gradients = [], []
        for grads, node in zip(kept, intermediates, strict=True):
            for index, grad in enumerate(grads):
                if grad is not None:
                    edges.append(GradientEdge(node, index))
                    gradients.append(grad)
        handles = [
            node.register_prehook(lambda _, grads=grads: grads)
            for grads, node in zip(kept, intermediates)
        ]
        try:
            if edges:
                torch.autograd.grad(
                    edges,
                    [GradientEdge(shard, 0) for shard in group["params"]],
                    grad_outputs=gradients,
                    allow_unused=True,
                )
        finally:
            for handle in handles:
                handle.remove()


SCHEDULES: dict[str, Callable[..., Any]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
"""What makes each pipeline schedule a plan names, from (stage, n_microbatches, loss_fn=, scale_grads=); the
last two take the list of a rank's stages (plan.MULTI_STAGE_SCHEDULES)."""
