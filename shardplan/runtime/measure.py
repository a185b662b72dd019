"""Measure a training step on this rank: peak tensor memory and step time.

This is how predictions are checked on CPU, where allocator statistics do not
exist: MemTracker sees every tensor torch allocates (shards, optimizer states,
gathered buffers, activations, temporaries).
"""

import time
from typing import Callable

import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

from shardplan.runtime import collectives


class _TotalsOnly(MemTracker):
    """MemTracker's totals without its per-module hooks.

    Those hooks register gradient hooks on every module's parameters, which must
    be leaf tensors; the sharded runtime presents views of the gathered buffer in
    those slots. The totals do not depend on them: every tensor an op allocates is
    counted in dispatch, and what exists before is registered by track_external.
    """

    def _pre_fw_hook(self, module, inputs) -> None:
        pass

    def _post_fw_hook(self, module, inputs, outputs) -> None:
        pass

    def _pre_bw_hook(self, module, args) -> None:
        pass

    def _post_bw_hook(self, module, args) -> None:
        pass


def forward_activation_bytes(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Activation bytes live on this process right after an eager forward of `model`:
    what autograd saved for backward plus the outputs the caller holds."""
    tracker = MemTracker()
    tracker.track_external(model, *args, *kwargs.values())
    with tracker:
        output = model(*args, **kwargs)
        snapshot = tracker.get_tracker_snapshot("current")
    del output
    return sum(
        size
        for by_kind in snapshot.values()
        for kind, size in by_kind.items()
        if kind is _MemRefType.ACT
    )


def peak_step_bytes(train_step: Callable[[], None], *existing) -> int:
    """Peak live tensor bytes on this rank during `train_step()`.

    `existing`: modules, optimizers and tensors that live before the step (shards,
    optimizer states), so they are counted too.
    """
    tracker = _TotalsOnly()
    tracker.track_external(*existing)
    with tracker:
        train_step()
    # meta-device entries are the runtime's placeholders: shapes without memory
    return sum(
        snapshot["Total"]
        for device, snapshot in tracker.get_tracker_snapshot("peak").items()
        if torch.device(device).type != "meta"
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timer reads the host's clock)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time_s(train_step: Callable[[], None], steps: int) -> float:
    """Seconds per `train_step()` over `steps` calls, of the slowest rank (a collective)."""
    collectives.all_reduce_max(torch.zeros(()))  # start together
    start = time.perf_counter()
    for _ in range(steps):
        train_step()
    return float(collectives.all_reduce_max(torch.tensor(time.perf_counter() - start))) / steps
