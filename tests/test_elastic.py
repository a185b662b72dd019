"""Elastic training: the sample stream, extra state in checkpoints, and a torchrun elastic run that grows
and shrinks.

The torchrun test starts one node (one rank), adds a second (torchrun stops the worker with SIGTERM,
which checkpoints, and restarts both on a world of 2, re-planned), then kills the second node with
SIGKILL mid-run (the survivor fails at its next collective, torchrun restarts it on a world of 1,
re-planned, from the last checkpoint). Every step's loss, replayed steps included, equals an
uninterrupted one-process run's on the same samples to 1e-5.
"""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import default_collate

import elastic_data
from parity import spawn_world
from shardplan import zoo
from shardplan.errors import CheckpointError, ShardplanError
from shardplan.model_spec import load_model
from shardplan.runtime import checkpoint, manual_plan, parallelize
from shardplan.runtime import elastic
from shardplan.runtime.elastic import ElasticOptions, batch_sizes, latest_checkpoints
from shardplan.runtime.launch import free_port
from shardplan.sampler import ResumableSampler

TOLERANCE = 1e-5
ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
"""The CLI's AdamW with --eps 1e-6 (see parity.ADAMW on eps)."""


# the sample stream

def stream(sampler: ResumableSampler, steps: list[tuple[int, int]]) -> list[int]:
    """Every replica's samples of `steps`, (global batch, replicas) each, in stream order."""
    read = []
    for global_batch, replicas in steps:
        indices = sampler.take(global_batch)
        read += [i for replica in range(replicas) for i in ResumableSampler.replica_slice(indices, replica, replicas)]
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
    assert read == stream(ResumableSampler(10, seed=3), [(22, 1)])  # the same stream as one uninterrupted run


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
    assert [batch_sizes(kept, world) for world in (1, 2, 3, 4)] == [(12, 12), (12, 6), (12, 4), (12, 3)]
    with pytest.raises(ShardplanError, match="does not split over 5 ranks"):
        batch_sizes(kept, 5)
    scaled = ElasticOptions(directory="run", steps=10, replica_batch_size=3)
    assert [batch_sizes(scaled, world) for world in (1, 5)] == [(3, 3), (15, 3)]
    with pytest.raises(ShardplanError, match="exactly one of"):
        ElasticOptions(directory="run", steps=10, global_batch_size=12, replica_batch_size=3)


def test_only_finished_checkpoints_are_resumed_newest_first(tmp_path):
    for name in ("step_00000004", "step_00000012", "step_00000016.partial", "step_00000008.old", "notes"):
        (tmp_path / name).mkdir()
    for name in ("step_00000004", "step_00000012"):
        (tmp_path / name / checkpoint.METADATA_FILE).touch()
    (tmp_path / "step_00000020").mkdir()  # no shardplan.json: a save never finished there
    assert latest_checkpoints(tmp_path) == [(12, tmp_path / "step_00000012"), (8, tmp_path / "step_00000008"),
                                            (4, tmp_path / "step_00000004")]


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


def extras_run(rank: int, world: int, directory: str) -> dict:
    """Save with extra state, load it back, and every refusal; rank 0's record of what happened."""
    torch.manual_seed(0)
    model = zoo.gpt().model
    program = parallelize(model, manual_plan(model, zoo.gpt_units(zoo.GPTConfig().n_layer), dp=world))
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
    record["unsafe"] = refusal(lambda: program.save(Path(directory) / "unsafe", extra={"bad": Unsafe()}))
    record["unsafe_written"] = (Path(directory) / "unsafe").exists() or (Path(directory) / "unsafe.partial").exists()
    record["failing_load"] = refusal(lambda: program.load(path, extra={"counter": Counter(fail=True)}))
    record["kept_after_failing_load"] = all(torch.equal(a, b) for a, b in zip(program.parameters(), changed))
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
    journal = elastic._Journal(run, None)

    def tamper(step: int) -> None:
        if torch.distributed.get_rank() == 0:
            (run / f"step_{step:08d}" / "extra.progress.pt").write_bytes(b"damaged")
        torch.distributed.barrier()

    tamper(4)
    record = {"fallback_step": elastic._resume(program, None, state, run, journal).step}
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
    assert extras["unsafe"].startswith("CheckpointError: extra state 'bad'") and not extras["unsafe_written"]
    assert extras["failing_load"] == "ValueError: refused" and extras["kept_after_failing_load"]
    assert extras["tampered"].startswith("CheckpointError: checkpoint file") and "extra.counter.pt" in extras["tampered"]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_start_passes_over_a_damaged_newest_checkpoint_and_refuses_when_none_loads(extras):
    assert extras["fallback_step"] == 2
    assert extras["none_loads"].startswith("none of the 2 checkpoint(s)")


# a torchrun elastic run: 1 rank, then 2, then 1

GLOBAL_BATCH, STEPS, CHECKPOINT_EVERY = 4, 40, 5


def reference_losses(steps: int) -> list[float]:
    """One process, the whole global batch each step, the same samples, model and optimizer as `shardplan train`."""
    torch.manual_seed(0)
    model = load_model("gpt").model
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    data, sampler = elastic_data.tokens(), ResumableSampler(elastic_data.SAMPLES, seed=0)
    losses = []
    for _ in range(steps):
        loss = model(**default_collate([data[index] for index in sampler.take(GLOBAL_BATCH)]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def start_node(directory: Path, port: int, host: bool, log: Path) -> subprocess.Popen:
    """One torchrun agent of one rank, in a rendezvous of 1 to 2 nodes."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
               # a dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt (5 x 3 s)
               f"--rdzv-conf=is_host={int(host)},last_call_timeout=2,keep_alive_interval=1", "--max-restarts=3",
               "--monitor-interval=0.2",
               "-m", "shardplan.cli", "train", "gpt", "elastic_data:paced_tokens", "--directory", str(directory),
               "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--global-batch",
               str(GLOBAL_BATCH), "--hardware", "cpu-gloo", "--eps", str(ADAMW["eps"]), "--timeout", "60"]
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
           # torch 2.13's shared rendezvous store never gives a node joining a running job the master's
           # address (the README's 'Elastic training'): both agents wait 60 s and fail
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, env=env, cwd=log.parent, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def events(directory: Path) -> list[dict]:
    path = directory / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(condition, what: str, nodes: list[subprocess.Popen], timeout_s: float = 150.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline or any(node.poll() is not None for node in nodes):
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers run in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def kill_node(node: subprocess.Popen) -> None:
    """SIGKILL a node's agent and its workers, as a machine failing would."""
    workers = children(node.pid)
    os.killpg(node.pid, signal.SIGKILL)
    for worker in workers:
        try:
            os.kill(worker, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def starts(directory: Path) -> list[dict]:
    return [event for event in events(directory) if event["event"] == "start"]


def progress(directory: Path) -> dict:
    try:
        return json.loads((directory / "progress.json").read_text())
    except (OSError, ValueError):  # not written yet, or replaced under us
        return {"step": 0, "world_size": 0}


@pytest.mark.distributed
@pytest.mark.timeout(600)  # its phases wait up to 150 s each: a loaded machine starts processes slowly
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc")
def test_torchrun_elastic_run_grows_and_shrinks_replanning_with_the_losses_of_one_process(tmp_path):
    directory = tmp_path / "run"
    port = free_port()
    (tmp_path / elastic_data.SLOW).touch()  # slow steps until the kill: the run is mid-way when the test acts
    first = start_node(directory, port, host=True, log=tmp_path / "first.log")
    nodes = [first]
    try:
        wait_for(lambda: progress(directory)["step"] >= 2, "a first step on one rank", nodes)
        second = start_node(directory, port, host=False, log=tmp_path / "second.log")
        nodes.append(second)
        wait_for(lambda: progress(directory)["world_size"] == 2 and progress(directory)["step"]
                 > starts(directory)[-1].get("resumed_step", STEPS) + CHECKPOINT_EVERY, "steps on two ranks", nodes)
        kill_node(second)
        nodes.remove(second)
        (tmp_path / elastic_data.SLOW).unlink()
        assert first.wait(timeout=150) == 0, (tmp_path / "first.log").read_text()[-3000:]
    finally:
        for node in nodes:
            if node.poll() is None:
                kill_node(node)
    found = events(directory)
    begun = starts(directory)
    assert [start["world_size"] for start in begun] == [1, 2, 1], begun
    grown, shrunk = begun[1], begun[2]
    # the grow: torchrun's SIGTERM made the worker checkpoint its last step, so nothing was lost
    assert grown["old_world_size"] == 1 and grown["steps_lost"] == 0
    # the shrink: from the last periodic checkpoint on two ranks, the steps after it lost and replayed
    last_before_kill = max(event["step"] for event in found[:found.index(shrunk)] if event["event"] == "step")
    assert shrunk["old_world_size"] == 2 and shrunk["resumed_step"] % CHECKPOINT_EVERY == 0
    assert shrunk["resumed_step"] > grown["resumed_step"]
    assert shrunk["steps_lost"] == last_before_kill - shrunk["resumed_step"]
    assert {"analyze_s", "solve_s", "load_s", "old_predicted_step_s", "predicted_step_s"} <= set(shrunk)
    steps = [event for event in found if event["event"] == "step"]
    assert steps[-1]["step"] == STEPS
    # every step reads the next samples of one stream: none twice, none skipped, at every world size
    assert all(event["first_sample"] == (event["step"] - 1) * GLOBAL_BATCH for event in steps)
    expected = reference_losses(STEPS)
    errors = [abs(event["loss"] - expected[event["step"] - 1]) for event in steps]
    assert max(errors) <= TOLERANCE, max(errors)
