"""An elastic run's folder ([Note: run folder] in runtime/elastic.py): its files are never written through a link
nor waited on as a FIFO, one job at a time holds it, its checkpoints carry the run's identity, and every number a
start reads from a flag or a checkpoint is checked."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from parity import spawn_world
from test_cli import _refused

from shardplan.errors import CheckpointError, ShardplanError
from shardplan.models import zoo
from shardplan.runtime import elastic
from shardplan.runtime.elastic import ElasticOptions
from shardplan.runtime.sampler import ResumableSampler

# files in the run folder


def test_the_run_files_are_written_anew_never_through_a_link(tmp_path):
    """A link named progress.json.tmp made rank 0 overwrite the link's target with its progress."""
    mine = tmp_path / "mine.txt"
    mine.write_text("a user's file")
    (tmp_path / (elastic.PROGRESS_FILE + ".tmp")).symlink_to(mine)
    (tmp_path / elastic.PROGRESS_FILE).symlink_to(mine)
    journal = elastic._Journal(tmp_path, [].append)
    journal.stepped(1, 2.0, 1, 0, 4, 0.0)
    assert mine.read_text() == "a user's file"
    progress = tmp_path / elastic.PROGRESS_FILE
    assert not progress.is_symlink() and json.loads(progress.read_text())["step"] == 1
    (tmp_path / elastic.EVENTS_FILE).unlink()
    (tmp_path / elastic.EVENTS_FILE).symlink_to(mine)
    with pytest.raises(
        ShardplanError,
        match=r"cannot write the run's events file .*events.jsonl': it is a symbolic "
        "link; remove it, or write elsewhere",
    ):
        journal.note("appended through the link before")
    assert mine.read_text() == "a user's file"


@pytest.mark.timeout(60)  # a FIFO's open once waited for a writer, or a reader, for ever
def test_a_fifo_in_the_run_folder_is_refused_or_passed_by_never_waited_on(tmp_path):
    os.mkfifo(tmp_path / elastic.PROGRESS_FILE)
    lines: list[str] = []
    journal = elastic._Journal(tmp_path, lines.append)
    assert (
        journal.last_progress is None
        and "is a named pipe, not a regular file shardplan wrote" in lines[0]
    )
    os.unlink(tmp_path / elastic.PROGRESS_FILE)
    os.mkfifo(tmp_path / (elastic.PROGRESS_FILE + ".tmp"))
    journal.stepped(
        1, 2.0, 1, 0, 4, 0.0
    )  # the progress is written beside it, under a name of its own
    assert json.loads((tmp_path / elastic.PROGRESS_FILE).read_text())["step"] == 1
    os.unlink(tmp_path / elastic.EVENTS_FILE)
    os.mkfifo(tmp_path / elastic.EVENTS_FILE)
    with pytest.raises(ShardplanError, match="events.jsonl': it is a named pipe; remove it"):
        journal.note("waited for a reader before")


def test_the_run_folder_is_held_by_one_job_and_keeps_its_run_id(tmp_path):
    first: list[elastic._RunLock] = []
    run = elastic._claim_run_folder(tmp_path, first)
    second: list[elastic._RunLock] = []
    with pytest.raises(
        ShardplanError,
        match=rf"another job is training in {tmp_path} \(process {os.getpid()} on "
        r".* holds run.lock\): wait for it to end, or give this job another",
    ):
        elastic._claim_run_folder(tmp_path, second)
    assert not second
    first[0].release()
    assert elastic._claim_run_folder(tmp_path, second) == run  # the id made at the first start
    second[0].release()


# numbers read from flags and checkpoints


def _checkpoint(folder: Path, name: str, run: str | None) -> Path:
    """A finished checkpoint's folder as latest_checkpoints finds it, its progress naming `run` (None: no
    readable progress)."""
    path = folder / name
    path.mkdir()
    (path / elastic.METADATA_FILE).write_text("{}")
    if run is not None:
        torch.save({"step": 0, "run": run}, path / "extra.progress.pt")
    return path


def test_damaged_run_settings_are_replaced_only_where_no_checkpoint_was_trained_with_them(tmp_path):
    options = ElasticOptions(
        directory=tmp_path, steps=2, global_batch_size=4, settings={"model": "gpt", "seed": 0}
    )
    settings = tmp_path / elastic.SETTINGS_FILE
    settings.write_text('{"model": "gpt", "se')
    assert elastic._record_settings(tmp_path, options) == []
    assert json.loads(settings.read_text()) == {"model": "gpt", "seed": 0}
    _checkpoint(tmp_path, "step_00000002", "mine")
    settings.write_text("[]")
    with pytest.raises(
        ShardplanError, match="it holds no object; run settings .* restore the file"
    ):
        elastic._record_settings(tmp_path, options)
    assert settings.read_text() == "[]"


def test_a_save_removes_only_this_runs_older_checkpoints_past_the_one_before_it(tmp_path):
    """The run saved 350 after 300 and 250, beside another run's later checkpoints copied in (a start passes
    them over) and an older one of unreadable progress: 250 goes, with a crashed swap's leftover of 200; the
    two newest of this run, the other run's and the unreadable one stay."""
    for step, run in ((200, "mine"), (250, "mine"), (300, "mine"), (350, "mine")):
        _checkpoint(tmp_path, f"step_{step:08d}", run)
    (tmp_path / "step_00000200").rename(tmp_path / "step_00000200.old")
    for step in (950, 1000):
        _checkpoint(tmp_path, f"step_{step:08d}", "theirs")
    _checkpoint(tmp_path, "step_00000100", None)
    elastic.remove_old_checkpoints(tmp_path, 350, "mine")
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "step_00000100",
        "step_00000300",
        "step_00000350",
        "step_00000950",
        "step_00001000",
    ]


@pytest.mark.parametrize(
    "field, value, message",
    [
        (
            "clip_grad_norm",
            -1.0,
            "the gradient clip (--clip) is -1.0",
        ),  # trained by gradient ascent
        (
            "clip_grad_norm",
            float("nan"),
            "the gradient clip (--clip) is nan",
        ),  # made every parameter NaN
        ("timeout_s", 0.0, "the process-group timeout (--timeout) is 0.0 s"),
        ("timeout_s", float("nan"), "the process-group timeout (--timeout) is nan s"),
        ("seed", -1, "seed must be a whole number from 0"),
        ("steps", 2**60, "steps must be a whole number from 1 to 1099511627776"),
    ],
)
def test_elastic_options_hold_only_numbers_a_run_can_use(field, value, message):
    with pytest.raises(ShardplanError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ElasticOptions(directory="run", **{"steps": 2, "global_batch_size": 4, field: value})


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr", "nan"], "--lr nan: give a finite number, above 0"),
        (["--lr", "-1"], "--lr -1.0: give a finite number, above 0"),
        (["--weight-decay", "inf"], "--weight-decay inf: give a finite number, 0 or more"),
        (["--clip", "-1"], "the gradient clip (--clip) is -1.0"),
        (["--timeout", "0"], "the process-group timeout (--timeout) is 0.0 s"),
    ],
)
def test_train_refuses_a_number_flag_it_cannot_use_before_it_loads_anything(
    flags, message, tmp_path, capsys
):
    argv = [
        "train",
        "gpt",
        "no_such_module:data",
        "--directory",
        str(tmp_path / "run"),
        "--steps",
        "2",
        "--global-batch",
        "4",
        *flags,
    ]
    assert message in _refused(
        argv, capsys
    )  # not "cannot load the data": refused before it is imported


@pytest.mark.parametrize(
    "data, message",
    [
        (
            5,
            r"the data is a int, which has no len\(\): make the data factory return a dataset",
        ),  # once a SIGABRT
        ([], "the dataset has 0 samples: give a dataset with at least one"),  # once IndexError: 0
    ],
)
def test_data_that_is_no_dataset_or_holds_no_sample_is_refused_before_the_rendezvous(
    data, message, tmp_path
):
    with pytest.raises(ShardplanError, match=message):
        elastic.train(
            lambda: None, data, ElasticOptions(directory=tmp_path, steps=1, global_batch_size=1)
        )


def test_a_forged_or_foreign_progress_state_is_a_checkpoint_error_that_changes_nothing():
    """A CheckpointError, so that a start tries the checkpoint before it (an uncaught RuntimeError never did)."""
    saved = elastic._TrainingState(ResumableSampler(10), None, run="a" * 32)
    saved.step = 4
    good = saved.state_dict()
    for bad, message in (
        ({**good, "step": -5}, "its progress holds step -5"),
        ({**good, "step": True}, "its progress holds step True"),
        ({**good, "rng": good["rng"][:100]}, "a random generator state of shape (100,)"),
        ({**good, "run": "b" * 32}, "it was saved by another run (bbbb"),
    ):
        state = elastic._TrainingState(ResumableSampler(10), None, run="a" * 32)
        rng = torch.get_rng_state()
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
            state.load_state_dict(bad)
        assert state.step == 0 and torch.equal(torch.get_rng_state(), rng)
    adopting = elastic._TrainingState(
        ResumableSampler(10), None, run="c" * 32, adopt_checkpoint=True
    )
    adopting.load_state_dict(good)
    older = {
        key: value for key, value in good.items() if key != "run"
    }  # saved before runs had an id
    elastic._TrainingState(ResumableSampler(10), None, run="c" * 32).load_state_dict(older)
    assert adopting.step == 4


# whole starts, on one gloo rank


class _FailingHeldOut(torch.utils.data.Dataset):
    """`data` whose held-out samples (from index `first`) fail to load, as an evaluation may fail."""

    def __init__(self, data, first: int):
        self.data, self.first = data, first

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        if index >= self.first:
            raise RuntimeError(f"held-out sample {index} failed")
        return self.data[index]


def run_folder_job(rank: int, world: int, folder: str) -> dict:
    import elastic_data

    from shardplan.cli.model_spec import load_model
    from shardplan.runtime import manual_plan, parallelize

    root, data, found = Path(folder), elastic_data.tokens(), {}

    def start(run: str, steps: int, lr: float = 1e-3, **options) -> tuple[int, list[str], float]:
        lines: list[str] = []
        built: list[torch.optim.Optimizer] = []

        def optimizer(parameters):
            built.append(torch.optim.AdamW(parameters, lr=lr))
            return built[-1]

        outcome = elastic.train(
            lambda: load_model("gpt").model,
            data,
            ElasticOptions(
                directory=root / run,
                steps=steps,
                global_batch_size=4,
                plan_options={"hardware": "cpu-gloo"},
                checkpoint_every=1,
                **options,
            ),
            optimizer_factory=optimizer,
            log=lines.append,
        )
        return outcome.step, lines, built[-1].param_groups[0]["lr"]

    start("a", 2)
    found["changed_lr"] = start("a", 3, lr=1e-2)
    held_out = len(data) - 4
    failing = _FailingHeldOut(data, held_out)
    try:
        elastic.train(
            lambda: load_model("gpt").model,
            failing,
            ElasticOptions(
                directory=root / "e",
                steps=4,
                global_batch_size=4,
                plan_options={"hardware": "cpu-gloo"},
                checkpoint_every=2,
                eval_every=2,
                eval_samples=4,
            ),
        )
        found["failed_evaluation"] = "trained"
    except RuntimeError as error:
        found["failed_evaluation"] = str(error)
    found["saved_before_evaluating"] = sorted(path.name for path in (root / "e").glob("step_*"))
    start("b", 2, lr=0.5)
    shutil.copytree(
        root / "b" / "step_00000002", root / "a" / "step_00000009"
    )  # swapped in, and newer
    found["foreign"] = start("a", 4)
    found["adopted"] = start("a", 10, adopt_checkpoint=True)
    lock = elastic._RunLock(root / "a")  # as another job's rank 0 holds it
    try:
        start("a", 12)
        found["second_job"] = "trained"
    except ShardplanError as error:
        found["second_job"] = str(error)
    lock.release()

    torch.manual_seed(0)
    entry = zoo.gpt()
    program = parallelize(
        entry.model, manual_plan(entry.model, zoo.gpt_units(zoo.GPTConfig().n_layer), dp=world)
    )
    found["clips"] = []
    for max_norm in (-1.0, float("nan")):
        try:
            program.clip_grad_norm_(max_norm)
            found["clips"].append("clipped")
        except ShardplanError as error:
            found["clips"].append(str(error))
    mine = root / "notes.txt"
    mine.write_text("a user's notes")
    (root / "model.pt").symlink_to(mine)
    program.export_full_state_dict(root / "model.pt")
    found["export"] = (
        mine.read_text(),
        (root / "model.pt").is_symlink(),
        sorted(torch.load(root / "model.pt", weights_only=True))
        == sorted(entry.model.state_dict()),
    )
    try:
        program.export_full_state_dict(root / "missing" / "model.pt")
        found["export_missing"] = "written"
    except CheckpointError as error:
        found["export_missing"] = str(error)
    return found


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict:
    return spawn_world(1, run_folder_job, (str(tmp_path_factory.mktemp("runs")),))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_changed_learning_rate_on_resume_is_applied_and_logged(starts):
    step, lines, lr = starts["changed_lr"]
    assert step == 3 and lr == 1e-2  # the checkpoint's 1e-3 trained on before, unsaid
    assert any(
        "the optimizer's lr 0.001 -> 0.01 at this start: training on with the new values" in line
        for line in lines
    ), lines


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_failed_evaluation_leaves_its_steps_checkpoint(starts):
    assert starts["failed_evaluation"].startswith("held-out sample ")
    assert starts["saved_before_evaluating"] == ["step_00000002"]


def too_few_held_out_job(rank: int, world: int, folder: str) -> str:
    import elastic_data

    from shardplan.cli.model_spec import load_model

    try:
        elastic.train(
            lambda: load_model("gpt").model,
            elastic_data.tokens(),
            ElasticOptions(
                directory=Path(folder) / "run",
                steps=4,
                global_batch_size=4,
                plan_options={"hardware": "cpu-gloo"},
                eval_every=2,
                eval_samples=1,
            ),
        )
        return "trained"
    except ShardplanError as error:
        return str(error)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_held_out_samples_fewer_than_the_ranks_are_refused_before_any_step(tmp_path):
    """Found at the first evaluation instead, every restart would train to it and fail again."""
    refused = spawn_world(2, too_few_held_out_job, (str(tmp_path),))
    assert refused.startswith("1 held-out sample(s) do not split over this world's 2 data-parallel")
    assert not list((tmp_path / "run").glob("step_*"))


def test_another_runs_checkpoint_is_passed_over_unless_adopted(starts):
    step, lines, _ = starts["foreign"]
    assert any(
        "step_00000009 not loaded (it was saved by another run (" in line
        and "--adopt-checkpoint" in line
        for line in lines
    ), lines
    assert any(line.startswith("resumed step 3 ") for line in "\n".join(lines).splitlines()), lines
    assert step == 4
    step, lines, _ = starts["adopted"]
    assert any(line.startswith("resumed step 9 ") for line in "\n".join(lines).splitlines()), lines
    assert step == 10


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_second_job_on_a_held_run_folder_stops_at_once(starts):
    assert starts["second_job"].startswith("another job is training in ")
    assert "give this job another --directory" in starts["second_job"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_negative_or_nan_clip_is_refused_by_the_program(starts):
    assert all(
        clip.startswith("clip_grad_norm_(max_norm=") and "a finite number, 0 or more" in clip
        for clip in starts["clips"]
    ), starts["clips"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_export_replaces_a_link_rather_than_writing_through_it_and_names_a_missing_folder(
    starts,
):
    assert starts["export"] == ("a user's notes", False, True)
    assert (
        starts["export_missing"].startswith("cannot write ")
        and "create the folder or write elsewhere" in starts["export_missing"]
    )


def test_the_restart_log_says_each_unit_change_once(tmp_path):
    from dataclasses import replace

    from shardplan.plan import ShardStrategy
    from shardplan.runtime.manual import manual_plan

    model = zoo.gpt().model
    old = manual_plan(model, zoo.gpt_units(zoo.GPTConfig().n_layer), dp=2)
    new = replace(
        old,
        units=(replace(old.units[0], strategy=ShardStrategy.REPLICATE), *old.units[1:]),
    )
    lines = elastic._Journal._plan_changes(old, new)
    assert lines[0] == "plan changes (as shardplan diff):"
    assert len(lines) == 2 and lines[1].startswith(f"  unit {old.units[0].name}: "), lines
