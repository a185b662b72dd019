"""The explain pictures: what a reader learns from them, read off the figures drawn."""

import dataclasses
import os

import pytest

from shardplan.cli import report
from shardplan.compile import compile as compile_plan
from shardplan.errors import ShardplanError
from shardplan.models import zoo
from shardplan.plan import ShardStrategy


@pytest.fixture(scope="module")
def plan():
    entry = zoo.gpt()
    return compile_plan(
        entry.model,
        2,
        entry.args,
        entry.kwargs,
        hardware="cpu-gloo",
        allow_pipeline=False,
        max_unit_blocks=1,
    )


def _legends_and_hatches(plan, folder, monkeypatch) -> dict:
    """memory.png's legend labels, and the x centres of its hatched bars."""
    drawn = {}
    save = report._save

    def keep(figure, path):
        axis = figure.axes[0]
        drawn[path.rsplit("/", 1)[-1]] = (
            axis.get_legend_handles_labels()[1],
            sorted(
                patch.get_x() + patch.get_width() / 2
                for patch in axis.patches
                if patch.get_hatch() == "//"
            ),
        )
        return save(figure, path)

    monkeypatch.setattr(report, "_save", keep)
    report.draw(plan, str(folder))
    return drawn["memory.png"]


def test_the_memory_picture_hatches_an_offloaded_units_forward_and_backward(
    plan, tmp_path, monkeypatch
):
    assert len(plan.units) >= 3
    middle = plan.units[1]
    offloaded = dataclasses.replace(
        plan,
        units=tuple(
            dataclasses.replace(unit, strategy=ShardStrategy.FULL_SHARD, offload=True)
            if unit is middle
            else unit
            for unit in plan.units
        ),
    )
    labels, hatched = _legends_and_hatches(offloaded, tmp_path / "timeline", monkeypatch)
    assert (
        f"offloaded (1 of {len(plan.units)} units):\nparameter, gradient and optimizer\nshards in host memory"
        in labels
    )
    events = len(plan.stages[0].units)
    assert hatched == [
        1.0,
        2 * events - 2.0,
    ]  # its forward, second; its backward, second from the end

    no_timeline = dataclasses.replace(
        offloaded, predicted=dataclasses.replace(offloaded.predicted, units=())
    )
    labels, _ = _legends_and_hatches(no_timeline, tmp_path / "peak", monkeypatch)
    assert any(label.startswith("offloaded (1 of") for label in labels)


def test_a_plan_without_offload_draws_no_offload(plan, tmp_path, monkeypatch):
    labels, hatched = _legends_and_hatches(plan, tmp_path, monkeypatch)
    assert not hatched and not any("offloaded" in label for label in labels)


def test_a_picture_folder_that_cannot_be_written_is_refused_in_one_line(plan, tmp_path):
    (tmp_path / "afile").write_text("notes")
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o555)
    for folder, cause in (
        (tmp_path / "afile", "a file has that name"),
        (tmp_path / "afile" / "pictures", "Not a directory"),
        (read_only / "pictures", "Permission denied"),
    ):
        if cause == "Permission denied" and os.geteuid() == 0:
            continue  # root writes anywhere
        with pytest.raises(
            ShardplanError,
            match=f"cannot write pictures to '{folder}': {cause}; pass --pictures DIR",
        ):
            report.draw(plan, str(folder))
    assert (tmp_path / "afile").read_text() == "notes"
