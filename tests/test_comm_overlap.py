"""How much communication a unit's backward hides: one communication stream runs the collectives in
the order issued, so the previous unit's prefetched gather gets only the compute that the next unit's
reduction (issued first) leaves."""

import dataclasses

import pytest

from shardplan.costmodel.cost import UnitCost, pair_exposed_s
from shardplan.costmodel.hardware import get_hardware

MS = 1e-3


def unit(
    *,
    gather_s: float = 0.0,
    reduce_s: float = 0.0,
    window_s: float = 6 * MS,
    reduce_per_step: bool = False,
    contention: float = 0.0,
) -> UnitCost:
    """A unit with `window_s` of backward compute whose collectives take the times given."""
    return UnitCost(
        state_bytes=0,
        activation_bytes=0,
        gathered_bytes=0,
        gathered_fwd_bytes=0,
        gathered_bwd_bytes=0,
        kept_gathered_bytes=0,
        grad_assembly_bytes=0,
        reducing_bytes=0,
        fwd_working=(0, 0),
        bwd_working=(0, 0),
        compute_fwd_s=window_s / 2,
        compute_bwd_s=window_s,
        recompute_s=0.0,
        gather_fwd_s=0.0,
        gather_bwd_s=gather_s,
        reduce_s=reduce_s,
        reduce_per_step=reduce_per_step,
        post_step_gather_s=0.0,
        offload_s=0.0,
        optimizer_s=0.0,
        runtime_step_s=0.0,
        tensor_parallel_s=0.0,
        prefetch=True,
        hide_fwd_s=window_s / 2,
        hide_bwd_s=window_s,
        contention=contention,
    )


def test_a_backward_hides_the_gather_only_in_what_the_reduction_before_it_leaves():
    # FULL_SHARD layers: 3 ms gathers and 4 ms reduce-scatters per micro-batch beside 6 ms of backward
    prev, layer = unit(gather_s=3 * MS, reduce_s=4 * MS), unit(gather_s=3 * MS, reduce_s=4 * MS)
    exposed = pair_exposed_s(prev, layer)
    # the layer's reduction hides under prev's backward (first on the stream there): nothing left over;
    # prev's gather has 6 - 4 ms of the layer's backward (its successor's reduction, its size, goes first)
    assert exposed.per_micro_batch_s == pytest.approx(3 * MS - 2 * MS)
    # communication 7 ms a window against 6 ms of compute: 1 ms shows, not 0 (each with the whole window)
    assert layer.free_bwd_s == pytest.approx(2 * MS)


def test_a_reduction_once_a_step_leaves_every_micro_batch_its_whole_window():
    prev, layer = unit(gather_s=3 * MS), unit(reduce_s=4 * MS, reduce_per_step=True)
    assert layer.free_bwd_s == layer.hide_bwd_s
    assert pair_exposed_s(prev, layer).per_micro_batch_s == 0.0
    busy = dataclasses.replace(
        layer, reduce_s=9 * MS, reduce_per_step=False
    )  # more than its whole window
    assert busy.free_bwd_s == 0.0
    # prev's gather shows whole; of the reduction, what prev's 6 ms of backward do not hide
    assert pair_exposed_s(prev, busy).per_micro_batch_s == pytest.approx(3 * MS + 3 * MS)


def test_a_collective_beside_the_compute_takes_its_share_of_the_compute():
    """While a collective runs, the compute beside it runs at 1 - share of its rate (NCCL's SMs and memory
    traffic): a window of w seconds of compute beside c seconds of collectives takes max(c, w + share x c)."""
    share = get_hardware("h100-80g").collective_compute_share
    assert share == pytest.approx(
        1 - 1 / 1.189, abs=1e-3
    )  # compute 18.9% slower beside a collective
    # a 4 ms reduction beside 6 ms of backward: it fits, yet the compute loses share x 4 ms
    prev, layer = unit(reduce_s=4 * MS, contention=share), unit(reduce_s=4 * MS, contention=share)
    assert pair_exposed_s(prev, layer).per_micro_batch_s == pytest.approx(share * 4 * MS)
    # one that outlasts the slowed compute shows as before: 9 ms against 6 ms
    assert pair_exposed_s(
        prev, unit(reduce_s=9 * MS, contention=share)
    ).per_micro_batch_s == pytest.approx(3 * MS)
    # the reduction, then the gather on the same stream: the gather has what the slowed compute has left
    prev, layer = unit(gather_s=1 * MS, contention=share), unit(reduce_s=4 * MS, contention=share)
    assert layer.free_bwd_s == pytest.approx(6 * MS - (1 - share) * 4 * MS)
    assert pair_exposed_s(prev, layer).per_micro_batch_s == pytest.approx(share * 5 * MS)
    # a gather not prefetched runs alone, the compute waiting: its own time, no share
    waiting = dataclasses.replace(layer, prefetch=False)
    assert pair_exposed_s(prev, waiting).per_micro_batch_s == pytest.approx(1 * MS + share * 4 * MS)
