"""Transcendental pointwise ops get measured factors: no zoo workload ran tanh, so GPT-2's and
BLOOM's GELU was priced at the copy bandwidth, 13x faster than it runs on a CPU core (op_factors.PointwiseOps)."""

import torch

from shardplan import get_hardware
from shardplan.calibration.op_factors import fit_op_factors, op_workloads, time_op_calls_s

TRANSCENDENTAL = {
    "tanh",
    "tanh_backward",
    "sigmoid",
    "sigmoid_backward",
    "silu",
    "silu_backward",
    "_softmax",
    "_softmax_backward_data",
}


def test_the_calibration_fits_a_factor_for_each_transcendental_op_of_a_layer():
    device = torch.device("cpu")
    calls = time_op_calls_s(op_workloads(device), device, rounds=1)
    profile = get_hardware("cpu-gloo")
    factors = fit_op_factors(profile, calls, kernel_overhead_s=1e-6)
    assert TRANSCENDENTAL <= set(factors)
    # a calibration on any CPU measures tanh well above the copy bandwidth's time: it is bound by its arithmetic
    assert factors["tanh"].at(1e-4) > 2
