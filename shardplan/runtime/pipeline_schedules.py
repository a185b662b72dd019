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

from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe
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


SCHEDULES: dict[str, Callable[..., PipelineScheduleSingle]] = {
    "gpipe": ScheduleGPipe,
    "1f1b": one_f_one_b,
}
"""What makes each pipeline schedule a plan names, from (stage, n_microbatches, loss_fn=, scale_grads=)."""
