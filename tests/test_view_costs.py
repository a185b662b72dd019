"""What T5's step held beside its priced kernels: views' dispatches, priced nothing, cost the host
about a one-element multiply's kernel each, forward and backward ([Note: views' fixed cost] in calibrate.py),
and attention with a learned bias runs `_safe_softmax` and bmm, which no op workload ran
(op_factors.BiasedAttention)."""

import dataclasses
import json

import pytest
import torch
from test_calibrate import hand_made_measurements

from shardplan import get_hardware
from shardplan.calibration.accuracy import shared_cores
from shardplan.calibration.calibrate import fit_profile, view_overhead_s, view_probes
from shardplan.calibration.op_factors import biased_attention, fit_op_factors, time_op_calls_s
from shardplan.costmodel.cost import CostContext, unit_cost, unpriced_dispatches
from shardplan.costmodel.hardware import HardwareProfile
from shardplan.errors import HardwareError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Decision, ShardStrategy


@pytest.fixture(scope="module")
def llama_layer():
    entry = zoo.hf_llama(n_layer=1, batch=1, seq=16)
    return next(
        block
        for block in analyze(entry.model, entry.args, entry.kwargs).blocks
        if block.name == "model.layers.0"
    )


def test_a_block_pays_each_view_in_forward_backward_and_every_recompute(llama_layer):
    views = unpriced_dispatches(llama_layer)
    kernels = sum(kind.calls for kind in llama_layer.fwd_kinds)
    assert 0.3 * kernels < views < llama_layer.fwd_dispatches  # q, k, v reshapes and transposes
    free = dataclasses.replace(get_hardware("cpu-gloo"), view_overhead_s=0.0)
    priced = dataclasses.replace(free, view_overhead_s=3e-6)

    def cost(hardware, checkpoint):
        decision = Decision(strategy=ShardStrategy.REPLICATE, checkpoint=checkpoint)
        return unit_cost((llama_layer,), decision, CostContext(hardware=hardware, dp=2))

    for checkpoint in Checkpoint:
        before, after = cost(free, checkpoint), cost(priced, checkpoint)
        assert after.compute_fwd_s - before.compute_fwd_s == pytest.approx(views * 3e-6)
        assert after.compute_bwd_s - before.compute_bwd_s == pytest.approx(
            views * 3e-6
        )  # the gradients' views
        rerun = (
            0 if checkpoint is Checkpoint.NONE else views * 3e-6
        )  # full and selective dispatch them again
        assert after.recompute_s - before.recompute_s == pytest.approx(rerun)


def test_the_figure_is_the_chains_time_over_its_dispatches_and_only_cpu_ranks_pay_it():
    seconds = {
        "views": 40e-6 + 64 * 2.5e-6,
        "views plain": 40e-6,
    }  # 32 transposes: one dispatch each way
    assert view_overhead_s(seconds) == pytest.approx(2.5e-6)
    measured = dataclasses.replace(hand_made_measurements(), view_overhead_s=2.5e-6)
    assert fit_profile(measured).view_overhead_s == 2.5e-6
    # on a GPU the host dispatches views while the device runs the kernels before them
    assert fit_profile(dataclasses.replace(measured, backend="nccl")).view_overhead_s == 0.0
    # ranks sharing cores see it longer, as every fixed cost
    shared = shared_cores(fit_profile(measured), ranks=4, cores=2)
    assert shared.view_overhead_s == pytest.approx(5e-6)


def test_profiles_of_earlier_calibrations_load_without_it_and_a_negative_one_is_refused():
    profile = dataclasses.replace(get_hardware("cpu-gloo"), view_overhead_s=2.5e-6)
    assert HardwareProfile.from_json(profile.to_json()) == profile
    data = json.loads(profile.to_json())
    data.pop("view_overhead_s")
    assert HardwareProfile.from_json(json.dumps(data)).view_overhead_s == 0.0
    data["view_overhead_s"] = -1e-6
    with pytest.raises(
        HardwareError, match="view_overhead_s is -1e-06, must be a finite number, 0 or more"
    ):
        HardwareProfile.from_json(json.dumps(data))


def test_the_views_probe_dispatches_the_views_the_figure_divides_by_and_nothing_else():
    """Counted, not timed (a busy machine stretches times): a view forward and its view backward for each of the
    chain's links, beside the same ops as its plain twin."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from shardplan.calibration.calibrate import _VIEW_PROBE_LENGTH

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names[str(func)] += 1
            return func(*args, **(kwargs or {}))

    dispatched = {}
    for key, probe in view_probes(torch.device("cpu")).items():
        probe.call()
        with Ops() as ops:
            probe.call()
        dispatched[key] = ops.names
    assert dispatched["views"] - dispatched["views plain"] == Counter(
        {"aten.t.default": 2 * _VIEW_PROBE_LENGTH}
    )
    assert dispatched["views plain"] - dispatched["views"] == Counter()


def test_the_calibration_prices_a_biased_attentions_safe_softmax_by_its_arithmetic():
    device = torch.device("cpu")
    calls = time_op_calls_s([biased_attention(device)], device, rounds=2)
    assert {"_safe_softmax", "bmm"} <= {name for name, *_ in calls}
    factors = fit_op_factors(get_hardware("cpu-gloo"), calls, kernel_overhead_s=1e-6)
    # bound by its exp, as a softmax: 9-10x its bytes' time on the project's CPU
    assert min(factor for _, factor in factors["_safe_softmax"].points) > 2.5
    assert "bmm" in factors
