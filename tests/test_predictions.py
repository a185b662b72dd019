"""The cost model against the runtime on this machine: every plan kind's predicted peak memory and
step time beside what training with it measures (shardplan.accuracy), on the built-in cpu-gloo profile."""
import pytest

from shardplan import get_hardware
from shardplan.accuracy import KINDS, accuracy_table, measure_accuracy

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def test_every_plan_kind_is_predicted_within_tolerance(capsys):
    rows = measure_accuracy(get_hardware("cpu-gloo"), world_size=2, rounds=3, progress=False)
    with capsys.disabled():  # the table either way: a pass shows the margins, a failure the culprit
        from rich.console import Console
        Console(width=120).print(accuracy_table(rows, "predicted vs measured, demo GPT, 2 gloo ranks (cpu-gloo)"))
    assert len(rows) == len(KINDS)
    misses = [miss for row in rows for miss in row.misses()]
    assert not misses, misses
