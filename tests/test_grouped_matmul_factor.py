"""A grouped matmul, which no op workload of the calibration runs, takes mm's factor (issue 22)."""
import pytest

from shardplan import get_hardware
from shardplan.op_factors import fit_op_factors

MIB = 2**20


def test_grouped_matmuls_take_the_factor_mm_measured_in_a_step():
    profile = get_hardware("cpu-gloo")
    flops = 2 * 512 * 512 * 512
    roofline_s = profile.compute_time_s(flops, 3 * MIB) - profile.op_overhead_s
    calls = [("mm", flops, 3 * MIB, 1.2 * roofline_s)]  # mm ran at 1.2x its roofline in the step
    factors = fit_op_factors(profile, calls, kernel_overhead_s=0.0)
    for name in ("_grouped_mm", "grouped_mm_fallback", "grouped_mm_fallback_backward"):
        assert factors[name] == factors["mm"]
    assert factors["mm"].at(roofline_s) == pytest.approx(1.2)
