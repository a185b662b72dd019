"""Each op's own fixed cost: a router's sort, topk or histc took 20-37 us a call on a CPU rank where
the model priced the 3-4 us of a one-element multiply (op_factors, [Note: op fixed costs])."""

import dataclasses
import json

import pytest
import torch
from test_calibrate import MIB, hand_made_measurements

from shardplan import get_hardware
from shardplan.calibration.accuracy import shared_cores
from shardplan.calibration.calibrate import fit_profile
from shardplan.calibration.op_factors import fit_op_fixed_costs, routing_ops, time_op_calls_s
from shardplan.costmodel.hardware import HardwareProfile
from shardplan.errors import HardwareError

BARE_S = 2e-6  # what a timed call holds beside its work (hand_made_measurements' kernel_overhead_s)


def test_fit_takes_each_ops_small_calls_beyond_a_bare_call_and_its_roofline():
    profile = fit_profile(
        hand_made_measurements()
    )  # 20 GB/s, 5 us a kernel in a step, gelu 2.5x its roofline
    calls = [
        ("sort", 0, 2048, BARE_S + 2048 / 20e9 + 28e-6),  # 28 us beyond its roofline
        ("sort", 0, 4096, BARE_S + 4096 / 20e9 + 32e-6),  # and 32: their mean, 30 us
        ("gelu", 0, 1024, BARE_S + 2.5 * 1024 / 20e9 + 6e-6),  # its factor is the profile's
        (
            "gelu",
            0,
            4 * MIB,
            BARE_S + 2.5 * 4 * MIB / 20e9,
        ),  # long: a call of its factor, not its fixed cost
        ("add", 0, 64, BARE_S),  # a bare call: it keeps op_overhead_s
        ("mm", 2e6, 4096, 1e-4),  # a matmul's small calls: its rate's efficiency
        ("_unsafe_view", 0, 0, 5e-6),
    ]  # no bytes: no kernel the cost model prices
    fixed = fit_op_fixed_costs(profile, calls, BARE_S)
    assert fixed == {"sort": pytest.approx(5e-6 + 30e-6), "gelu": pytest.approx(5e-6 + 6e-6)}
    measured = dataclasses.replace(hand_made_measurements(), op_calls=tuple(calls))
    assert fit_profile(measured).op_fixed_costs_s == fixed
    # a GPU's clock synchronizes after each call, which a step does not: no fixed costs from it
    assert fit_profile(dataclasses.replace(measured, backend="nccl")).op_fixed_costs_s == {}


def test_an_ops_fixed_cost_replaces_the_kernels_for_each_call():
    profile = dataclasses.replace(get_hardware("cpu-gloo"), op_fixed_costs_s={"sort": 30e-6})
    roofline_s = 1e6 / profile.memory_bandwidth_bytes_per_s
    assert profile.compute_time_s(0, 1e6, calls=4, op="sort") == pytest.approx(
        4 * 30e-6 + roofline_s
    )
    assert profile.compute_time_s(0, 1e6, calls=4, op="topk") == pytest.approx(
        4 * profile.op_overhead_s + roofline_s
    )
    # ranks sharing cores see every fixed cost longer
    shared = shared_cores(profile, ranks=4, cores=2)
    assert shared.compute_time_s(0, 1e6, calls=4, op="sort") == pytest.approx(
        2 * (4 * 30e-6 + roofline_s)
    )


def test_profiles_carry_fixed_costs_and_reject_bad_ones():
    profile = dataclasses.replace(
        get_hardware("cpu-gloo"), op_fixed_costs_s={"sort": 3e-5, "topk": 2.4e-5}
    )
    assert HardwareProfile.from_json(profile.to_json()) == profile
    data = json.loads(profile.to_json())
    data.pop("op_fixed_costs_s")  # a profile of a calibration before them
    assert HardwareProfile.from_json(json.dumps(data)).op_fixed_costs_s == {}
    data["op_fixed_costs_s"] = {"sort": 0}
    with pytest.raises(
        HardwareError, match=r"op_fixed_costs_s\.sort is 0, must be a positive finite number"
    ):
        HardwareProfile.from_json(json.dumps(data))


def test_the_calibration_measures_a_routers_ops_above_a_kernels_fixed_cost():
    device = torch.device("cpu")
    profile = get_hardware("cpu-gloo")
    calls = time_op_calls_s([routing_ops(device)], device, rounds=2)
    assert {"_softmax", "topk", "sort", "histc", "index", "index_put", "scatter"} <= {
        name for name, *_ in calls
    }
    fixed = fit_op_fixed_costs(profile, calls, kernel_overhead_s=1e-6)
    # a sort and a topk take several one-element multiplies' time on any CPU (24-34 us against 3-4 here)
    assert min(fixed["sort"], fixed["topk"]) > 2 * profile.op_overhead_s
