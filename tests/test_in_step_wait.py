"""The in-step wait of collectives is the mean of the calibration's fastest round ([Note: collectives in
a step] in calibrate.py): a round keeps the tail a step meets, the fastest round leaves out other work."""
import pytest

from shardplan.calibrate import _IN_STEP_TIMINGS, fastest_round_mean


def test_the_figure_is_the_calmest_rounds_mean_with_its_tail():
    calm = [1e-3] * (_IN_STEP_TIMINGS - 1) + [5e-3]  # a time slice inside the round stays in its mean
    busy = [4e-3] * _IN_STEP_TIMINGS  # other work on the machine through a whole round
    assert fastest_round_mean(busy + calm + busy) == pytest.approx((_IN_STEP_TIMINGS - 1 + 5) * 1e-3 / _IN_STEP_TIMINGS)
