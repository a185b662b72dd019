"""Elastic training: the sample stream, extra state in checkpoints, and a torchrun elastic job that grows
and shrinks (tests/elastic_job.py runs it: one-rank nodes, each a torchrun agent).

The job starts 2 nodes and adds 2 (torchrun stops the workers with SIGTERM, which checkpoints, and
restarts them on a world of 4, re-planned); once the 4 have stepped past a checkpoint, it kills one
with SIGKILL (the others fail at their next collective, torchrun restarts them on a world of 3,
re-planned, from the last checkpoint). Every step's loss, replayed steps included, equals an
uninterrupted one-process run's on the same samples to 1e-5.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
from elastic_job import PACE_S, Job, reference_losses, restart_breakdown
from parity import spawn_world

from shardplan.errors import CheckpointError, ShardplanError
from shardplan.models import zoo
from shardplan.runtime import checkpoint, elastic, manual_plan, parallelize
from shardplan.runtime.elastic import ElasticOptions, batch_sizes, latest_checkpoints
from shardplan.runtime.sampler import ResumableSampler

TOLERANCE = 1e-5


# the sample stream


def stream(sampler: ResumableSampler, steps: list[tuple[int, int]]) -> list[int]:
    """Every replica's samples of `steps`, (global batch, replicas) each, in stream order."""
    read = []
    for global_batch, replicas in steps:
        indices = sampler.take(global_batch)
        read += [
            i
            for replica in range(replicas)
            for i in ResumableSampler.replica_slice(indices, replica, replicas)
        ]
    return read


def test_every_sample_is_read_once_an_epoch_across_world_and_batch_changes():
    first = ResumableSampler(10, seed=3)
    read = stream(first, [(4, 4), (4, 4), (4, 2)])
    resumed = ResumableSampler(10, seed=3)  # a restart: a fresh sampler given the saved state
    resumed.load_state_dict(first.state_dict())
    read += stream(resumed, [(2, 1), (6, 3), (2, 2)])
    assert len(read) == 22 and resumed.epoch == 2
    assert sorted(read[:10]) == sorted(read[10:20]) == list(range(10))
    assert read[:10] != read[10:20]  # each epoch its own order
    assert read == stream(
        ResumableSampler(10, seed=3), [(22, 1)]
    )  # the same stream as one uninterrupted run


def test_sampler_state_of_another_dataset_or_seed_is_refused():
    saved = ResumableSampler(10, seed=3).state_dict()
    for other in (ResumableSampler(11, seed=3), ResumableSampler(10, seed=4)):
        with pytest.raises(ShardplanError, match="same dataset, seed"):
            other.load_state_dict(saved)
    with pytest.raises(ShardplanError, match="divisible by 3"):
        ResumableSampler.replica_slice([1, 2, 3, 4], 0, 3)


# what a start decides before it trains


def test_the_global_batch_is_kept_or_scaled_as_asked():
    kept = ElasticOptions(directory="run", steps=10, global_batch_size=12)
    assert [batch_sizes(kept, world) for world in (1, 2, 3, 4)] == [
        (12, 12),
        (12, 6),
        (12, 4),
        (12, 3),
    ]
    with pytest.raises(ShardplanError, match="does not split over 5 ranks"):
        batch_sizes(kept, 5)
    scaled = ElasticOptions(directory="run", steps=10, replica_batch_size=3)
    assert [batch_sizes(scaled, world) for world in (1, 5)] == [(3, 3), (15, 3)]
    with pytest.raises(ShardplanError, match="exactly one of"):
        ElasticOptions(directory="run", steps=10, global_batch_size=12, replica_batch_size=3)


def test_only_finished_checkpoints_are_resumed_newest_first(tmp_path):
    for name in (
        "step_00000004",
        "step_00000012",
        "step_00000016.partial",
        "step_00000008.old",
        "notes",
    ):
        (tmp_path / name).mkdir()
    for name in ("step_00000004", "step_00000012"):
        (tmp_path / name / checkpoint.METADATA_FILE).touch()
    (tmp_path / "step_00000020").mkdir()  # no shardplan.json: a save never finished there
    assert latest_checkpoints(tmp_path) == [
        (12, tmp_path / "step_00000012"),
        (8, tmp_path / "step_00000008"),
        (4, tmp_path / "step_00000004"),
    ]


@pytest.mark.parametrize(
    "damaged, cause",
    [
        ('{"step": 4, "ti', "is not valid JSON"),  # a crash mid-write
        ("[4]", "holds no step, time and global batch"),
        ('{"step": 4, "world_size": 1}', "holds no step, time and global batch"),
    ],
)
def test_a_damaged_progress_file_is_noted_and_counts_no_steps_lost(tmp_path, damaged, cause):
    """It only feeds the log: every restart must not die on it while the checkpoints are fine."""
    (tmp_path / elastic.PROGRESS_FILE).write_text(damaged)
    lines: list[str] = []
    journal = elastic._Journal(tmp_path, lines.append)
    assert journal.last_progress is None
    assert (
        len(lines) == 1 and cause in lines[0] and lines[0].endswith("the log counts no steps lost")
    )
    journal.stepped(
        5, 1.0, 1, 32, 8, 0.0
    )  # the first step after a start reads the last start's progress
    assert json.loads((tmp_path / elastic.PROGRESS_FILE).read_text())["step"] == 5


def test_a_run_directory_that_cannot_be_made_is_refused_before_the_rendezvous(tmp_path):
    (tmp_path / "afile").write_text("notes")
    for directory, cause in (
        (tmp_path / "afile", "it is a file"),
        (tmp_path / "afile" / "run", "Not a directory"),
    ):
        with pytest.raises(
            ShardplanError, match=f"cannot keep the run in {directory}: {cause}; give a folder"
        ):
            elastic.train(
                lambda: None, [], ElasticOptions(directory=directory, steps=1, global_batch_size=1)
            )
    assert (tmp_path / "afile").read_text() == "notes"


# extra state in checkpoints


class Counter:
    """A stateful object, as an lr scheduler or a data loader is; `fail` makes its load raise."""

    def __init__(self, value: int = 0, fail: bool = False):
        self.value, self.fail = value, fail

    def state_dict(self) -> dict:
        return {"value": self.value, "history": [self.value, torch.arange(3)]}

    def load_state_dict(self, state: dict) -> None:
        if self.fail:
            raise ValueError("refused")
        self.value = state["value"]


class Unsafe(Counter):
    def state_dict(self) -> dict:
        return {"value": Counter(1)}  # an object torch.load(weights_only=True) will not build


class Unpicklable(Counter):
    def state_dict(self) -> dict:
        return {"value": lambda: 1}  # torch.save cannot pickle it


class Unready(Counter):
    def state_dict(self) -> dict:
        raise ValueError("no state before the first step")


def extras_run(rank: int, world: int, directory: str) -> dict:
    """Save with extra state, load it back, and every refusal; rank 0's record of what happened."""
    torch.manual_seed(0)
    model = zoo.gpt().model
    program = parallelize(
        model, manual_plan(model, zoo.gpt_units(zoo.GPTConfig().n_layer), dp=world)
    )
    path = Path(directory) / "ckpt"
    sampler = ResumableSampler(20, seed=1)
    sampler.take(12)
    program.save(path, extra={"sampler": sampler, "counter": Counter(7)})
    record = {"metadata": checkpoint.read_metadata(path)[1]}
    loaded_sampler, loaded_counter = ResumableSampler(20, seed=1), Counter()
    program.load(path, extra={"sampler": loaded_sampler, "counter": loaded_counter})
    record["loaded"] = (loaded_sampler.consumed, loaded_counter.value)
    before = [parameter.detach().clone() for parameter in program.parameters()]
    with torch.no_grad():
        for parameter in program.parameters():
            parameter.add_(1.0)
    changed = [parameter.detach().clone() for parameter in program.parameters()]

    def refusal(action) -> str:
        try:
            action()
        except CheckpointError as error:
            return f"CheckpointError: {error}"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return "none"

    record["missing"] = refusal(lambda: program.load(path, extra={"scheduler": Counter()}))
    record["unsafe"] = refusal(
        lambda: program.save(Path(directory) / "unsafe", extra={"bad": Unsafe()})
    )
    record["unsafe_written"] = (Path(directory) / "unsafe").exists() or (
        Path(directory) / "unsafe.partial"
    ).exists()
    record["unpicklable"] = refusal(
        lambda: program.save(Path(directory) / "unsafe", extra={"bad": Unpicklable()})
    )
    record["unready"] = refusal(
        lambda: program.save(Path(directory) / "unsafe", extra={"bad": Unready()})
    )
    record["unsafe_written"] |= (Path(directory) / "unsafe").exists() or (
        Path(directory) / "unsafe.partial"
    ).exists()
    record["failing_load"] = refusal(
        lambda: program.load(path, extra={"counter": Counter(fail=True)})
    )
    record["kept_after_failing_load"] = all(
        torch.equal(a, b) for a, b in zip(program.parameters(), changed)
    )
    if rank == 0:
        (path / "extra.counter.pt").write_bytes(b"not the saved bytes")
    torch.distributed.barrier()
    record["tampered"] = refusal(lambda: program.load(path, extra={"counter": Counter()}))
    program.save(Path(directory) / "plain")
    record["plain_metadata"] = checkpoint.read_metadata(Path(directory) / "plain")[1]
    record.update(resumes(program, Path(directory) / "run"))
    record["add_changed"] = not any(torch.equal(a, b) for a, b in zip(before, changed))
    return record


def resumes(program, run: Path) -> dict:
    """Which checkpoint an elastic start resumes when the newest, then every one, fails its checks."""
    state = elastic._TrainingState(ResumableSampler(20, seed=1), None)
    for step in (2, 4):
        state.step = step
        program.save(run / f"step_{step:08d}", extra=state.extras())
    lines: list[str] = []
    journal = elastic._Journal(run, lines.append if torch.distributed.get_rank() == 0 else None)

    def tamper(step: int) -> None:
        if torch.distributed.get_rank() == 0:
            (run / f"step_{step:08d}" / "extra.progress.pt").write_bytes(b"damaged")
        torch.distributed.barrier()

    tamper(4)
    record = {"fallback_step": elastic._resume(program, None, state, run, journal).step}
    if (
        torch.distributed.get_rank() == 0
    ):  # as an older version saved it: a plan past the schema's bounds
        file = run / "step_00000002" / checkpoint.METADATA_FILE
        metadata = json.loads(file.read_text())
        metadata["plan"]["reasoning"]["budget_bytes"] = 2**51
        file.write_text(json.dumps(metadata))
    torch.distributed.barrier()
    resumed = elastic._resume(program, None, state, run, journal)
    journal.started(
        program.plan,
        resumed,
        2,
        8,
        4,
        dict.fromkeys(("rendezvous_s", "analyze_s", "solve_s", "parallelize_s", "load_s"), 0.0),
        0.0,
    )
    record["unreadable_plan"] = (resumed.step, resumed.plan, lines[-2:])
    tamper(2)
    try:
        elastic._resume(program, None, state, run, journal)
        record["none_loads"] = "none"
    except CheckpointError as error:
        record["none_loads"] = str(error)
    return record


@pytest.fixture(scope="module")
def extras(tmp_path_factory) -> dict:
    return spawn_world(2, extras_run, (str(tmp_path_factory.mktemp("extras")),))


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_extra_state_round_trips_and_is_listed_in_the_manifest(extras):
    assert extras["loaded"] == (12, 7)
    metadata = extras["metadata"]
    assert metadata["extra"] == ["counter", "sampler"]
    assert {"extra.counter.pt", "extra.sampler.pt"} <= set(metadata["files"])
    assert "extra" not in extras["plain_metadata"]  # a checkpoint without extras is as before
    assert extras["add_changed"]  # so the failing load below had something to undo


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_extra_state_refusals_name_the_cause_and_change_nothing(extras):
    assert "holds no extra state 'scheduler'" in extras["missing"]
    assert (
        extras["unsafe"].startswith("CheckpointError: extra state 'bad'")
        and not extras["unsafe_written"]
    )
    assert (
        extras["unpicklable"].startswith(
            "CheckpointError: extra state 'bad' (Unpicklable.state_dict()) holds "
            "what a checkpoint cannot store"
        )
        and "pickle" in extras["unpicklable"]
    )
    assert extras["unready"] == (
        "CheckpointError: extra state 'bad': Unready.state_dict() failed (ValueError: no "
        "state before the first step): mend it, or save without it"
    )
    assert extras["failing_load"] == "ValueError: refused" and extras["kept_after_failing_load"]
    assert (
        extras["tampered"].startswith("CheckpointError: checkpoint file")
        and "extra.counter.pt" in extras["tampered"]
    )


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_start_passes_over_a_damaged_newest_checkpoint_and_refuses_when_none_loads(extras):
    assert extras["fallback_step"] == 2
    step, plan, (note, started) = extras[
        "unreadable_plan"
    ]  # the state loads; the log says what it lacks
    assert step == 2 and plan is None
    assert (
        "step_00000002 loaded, but the plan it records cannot be read (plan field "
        "plan.reasoning.budget_bytes"
    ) in note
    assert "resumed step 2 (saved on 2 ranks, its plan unreadable); 0 step(s) lost" in started
    assert extras["none_loads"].startswith("none of the 2 checkpoint(s)")


# a torchrun elastic job: 2 ranks gain two, then the 4 lose one

GLOBAL_BATCH, STEPS, CHECKPOINT_EVERY = 12, 30, 4
"""12 samples a step split over 2, 4 and 3 ranks; enough steps that a paced job is mid-way while a test acts."""


@pytest.fixture(scope="module")
def expected_losses() -> list[float]:
    return reference_losses(STEPS, GLOBAL_BATCH)


def job(tmp_path: Path) -> Job:
    return Job(
        tmp_path,
        nnodes="2:4",
        steps=STEPS,
        checkpoint_every=CHECKPOINT_EVERY,
        global_batch=GLOBAL_BATCH,
    )


@pytest.fixture(scope="module")
def grown_then_shrunk(tmp_path_factory) -> dict:
    """One job (one torchrun start-up for both changes): 2 nodes, joined by 2 more mid-run, then one of
    the 4 killed with SIGKILL once they have stepped past a checkpoint of their own; run to the end.
    Its events, starts, logs and the time of the kill."""
    if not sys.platform.startswith("linux"):
        pytest.skip("finds torchrun's workers in /proc")
    with job(tmp_path_factory.mktemp("elastic")) as running:
        running.start(2)
        running.wait_for(
            lambda: running.progress()["world_size"] == 2 and running.progress()["step"] >= 2,
            "steps on 2 ranks",
        )
        running.pace(
            0.5
        )  # 3 s a step on 2 ranks: the job is mid-way when the new nodes join, however slowly they start
        running.start(2)
        running.wait_for(lambda: running.progress()["world_size"] == 4, "a step on 4 ranks")
        running.pace(PACE_S)
        running.wait_for(
            lambda: running.running_past_a_checkpoint(4), "steps on 4 ranks past a checkpoint"
        )
        killed = running.kill_a_rank()
        running.finish()
    return {
        "events": running.events(),
        "starts": running.starts(),
        "logs": running.logs_text(),
        "killed": killed,
    }


def assert_one_stream_with_the_losses_of_one_process(
    found: list[dict], expected: list[float]
) -> None:
    """Every step, replayed ones included, reads the next samples of one stream (none twice, none skipped, at
    every world size) and has the loss of an uninterrupted one-process run to TOLERANCE."""
    steps = [event for event in found if event["event"] == "step"]
    assert steps[-1]["step"] == STEPS
    assert all(event["first_sample"] == (event["step"] - 1) * GLOBAL_BATCH for event in steps)
    errors = [abs(event["loss"] - expected[event["step"] - 1]) for event in steps]
    assert max(errors) <= TOLERANCE, max(errors)


@pytest.mark.distributed
@pytest.mark.timeout(
    600
)  # its phases wait up to START_TIMEOUT_S each: a loaded machine starts processes slowly
def test_a_4_rank_torchrun_job_loses_a_rank_to_sigkill_and_trains_on_3_replanned(
    grown_then_shrunk, expected_losses
):
    found, begun = grown_then_shrunk["events"], grown_then_shrunk["starts"]
    assert [start["world_size"] for start in begun][-2:] == [4, 3], begun
    shrunk = begun[-1]
    assert shrunk["mesh"] == "pp=1 dp_shard=3" and shrunk["old_mesh"] == "pp=1 dp_shard=4"
    # from the last periodic checkpoint on 4 ranks, the steps after it lost and replayed
    last_before_kill = max(
        event["step"] for event in found[: found.index(shrunk)] if event["event"] == "step"
    )
    assert shrunk["old_world_size"] == 4 and shrunk["resumed_step"] % CHECKPOINT_EVERY == 0
    assert shrunk["steps_lost"] == last_before_kill - shrunk["resumed_step"]
    failures = [event for event in found if event["event"] == "failed"]
    assert (
        failures and failures[-1]["step"] == last_before_kill + 1
    )  # rank 0 saw its next step fail
    breakdown = restart_breakdown(found, grown_then_shrunk["logs"], grown_then_shrunk["killed"])
    parts = sum(seconds for name, seconds in breakdown.items() if name != "total_s")
    assert min(breakdown.values()) >= 0 and abs(parts - breakdown["total_s"]) < 0.5, breakdown
    assert_one_stream_with_the_losses_of_one_process(found, expected_losses)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_2_rank_torchrun_job_grows_to_4_replanned_losing_no_step(
    grown_then_shrunk, expected_losses
):
    found = grown_then_shrunk["events"]
    begun = grown_then_shrunk["starts"][:-1]  # the last: the shrink after the kill
    sizes = [start["world_size"] for start in begun]
    assert sizes[0] == 2 and sizes[-1] == 4 and sizes == sorted(sizes), begun
    assert (
        begun[-1]["mesh"] == "pp=1 dp_shard=4" and begun[-1]["replica_batch"] == GLOBAL_BATCH // 4
    )
    # torchrun's SIGTERM made the workers checkpoint their last step at each grow, so nothing was lost
    assert all(start["steps_lost"] == 0 and start["resumed_step"] > 0 for start in begun[1:])
    assert {
        "startup_s",
        "analyze_s",
        "solve_s",
        "load_s",
        "old_predicted_step_s",
        "predicted_step_s",
    } <= set(begun[-1])
    assert_one_stream_with_the_losses_of_one_process(found, expected_losses)
