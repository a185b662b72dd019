"""Selective checkpointing's dispatch modes in the step time: the analysis counts the ops a
block's forward dispatches, the calibration measures what the modes add to each, the cost model adds
that to a selective block's recompute ([Note: selective checkpointing's modes] in calibrate.py)."""

import dataclasses

import pytest
import torch

from shardplan import get_hardware
from shardplan.calibration.calibrate import (
    _OpCount,
    fit_profile,
    selective_op_overhead_s,
    selective_op_probes,
)
from shardplan.costmodel.cost import CostContext, unit_cost
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Decision, ShardStrategy


def test_the_analysis_counts_the_ops_an_eager_forward_dispatches_views_included():
    entry = zoo.hf_llama(n_layer=1, batch=1, seq=16)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    layer = next(block for block in chain.blocks if block.name == "model.layers.0")
    inputs = {}
    handle = entry.model.model.layers[0].register_forward_pre_hook(
        lambda module, args, kwargs: inputs.setdefault("call", (args, kwargs)), with_kwargs=True
    )
    entry.model(*entry.args, **entry.kwargs)
    handle.remove()
    count = _OpCount()
    with count:
        entry.model.model.layers[0](*inputs["call"][0], **inputs["call"][1])
    assert (
        layer.fwd_dispatches > 1.4 * layer.fwd_ops
    )  # views (q, k, v reshapes and transposes) are dispatches too
    assert layer.fwd_dispatches == pytest.approx(count.dispatches, rel=0.1)


def test_a_selective_block_pays_the_modes_on_every_op_its_forward_dispatches():
    entry = zoo.hf_llama(n_layer=1, batch=1, seq=16)
    layer = next(
        block
        for block in analyze(entry.model, entry.args, entry.kwargs).blocks
        if block.name == "model.layers.0"
    )
    free = dataclasses.replace(get_hardware("cpu-gloo"), selective_op_overhead_s=0.0)
    modes = dataclasses.replace(free, selective_op_overhead_s=40e-6)

    def recompute_s(hardware, checkpoint):
        decision = Decision(strategy=ShardStrategy.REPLICATE, checkpoint=checkpoint)
        return unit_cost((layer,), decision, CostContext(hardware=hardware, dp=2)).recompute_s

    assert recompute_s(modes, Checkpoint.SELECTIVE) - recompute_s(
        free, Checkpoint.SELECTIVE
    ) == pytest.approx(layer.fwd_dispatches * 40e-6)
    assert recompute_s(modes, Checkpoint.FULL) == recompute_s(
        free, Checkpoint.FULL
    )  # no dispatch mode there


def test_the_figure_is_the_modes_time_over_the_ops_less_the_re_run_ops():
    from shardplan.calibration.calibrate import _selective_probe_ops

    dispatches, rerun = _selective_probe_ops()
    seconds = {
        "selective": 1e-3 + dispatches * 30e-6 + rerun * 2e-6,
        "selective plain": 1e-3,
        "bare op": 2e-6,
    }
    assert selective_op_overhead_s(seconds) == pytest.approx(30e-6)
    from test_calibrate import hand_made_measurements

    measured = dataclasses.replace(hand_made_measurements(), selective_op_overhead_s=30e-6)
    assert fit_profile(measured).selective_op_overhead_s == 30e-6


def test_the_selective_probe_passes_every_op_of_the_layers_forward_through_the_modes_again():
    """What the figure divides its extra time by: the ops one forward of the probe's layer dispatches, each
    dispatched again by the selective probe's recompute (counted, not timed: a busy machine stretches times)."""
    from shardplan.calibration.calibrate import _selective_probe_ops

    dispatched = {}
    for key, probe in selective_op_probes(torch.device("cpu")).items():
        probe.call()  # autograd's and the modes' first-call set-up is not the probe's
        count = _OpCount()
        with count:
            probe.call()
        dispatched[key] = count.dispatches
    forward_ops, _ = _selective_probe_ops()
    assert dispatched["selective"] - dispatched["selective plain"] >= forward_ops > 0, dispatched
