"""Elastic training under torchrun: on every (re)start, plan for the world there is and resume the last checkpoint.

[Note: elastic restarts] `torchrun --nnodes=MIN:MAX` (c10d rendezvous) restarts every worker when
one fails or a node joins, with as many nodes as came to the new rendezvous. Each start of `train`:

1. joins the process group torchrun's rendezvous formed: its world size may differ from the last start's;
2. re-plans on rank 0 for this world (analysis of the model at this world's batch per rank, then
   the solver) and gives every rank the plan;
3. parallelizes and loads the newest finished checkpoint `<directory>/step_<n>` (written on any plan
   and world size; the one before it if that one fails its checks), with the sampler, the step
   counter, the RNG and the lr scheduler as extra state ([Note: extra state] in checkpoint.py);
4. logs the old and the new plan, the predicted step time of each, the global batch, the steps lost
   (those the last start finished after its last checkpoint, from `progress.json`) and where the
   time since the last step went, from the process's start on;
5. trains to `steps`, saving a checkpoint every `checkpoint_every` steps, at the end, and when any
   rank got SIGTERM (the ranks agree on it before each step, one 1-element all-reduce), then returns.

A rank that dies makes the others fail at their next collective (gloo sees the closed connection;
otherwise at the process-group timeout; rank 0 logs the failed step), and torchrun restarts the
survivors. A save cut short leaves `step_<n>.partial`, never a `step_<n>` ([Note: atomic save] in
checkpoint.py), so what a restart loads is always finished and checked against its manifest.

The global batch: with `global_batch_size`, every step reads that many samples at every world size,
each rank global / world of them (the solver then picks the micro-batches that fit); with
`replica_batch_size`, each rank reads that many and the global batch scales with the world, which
the log says. Either way the samples follow one stream ([Note: sample stream] in sampler.py), so a
world change neither repeats nor skips a sample. The plans are data-parallel (pp = tp = 1): a
pipeline or tensor-parallel mesh splits the world's batch over fewer replicas, which would need
an analysis at each candidate replica batch; not done yet.
"""
import datetime
import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import default_collate

from ..errors import CheckpointError, PlanError, ShardplanError
from ..files import parse_json, read_text
from ..plan import Plan
from ..sampler import ResumableSampler
from . import collectives, parallelize
from .checkpoint import METADATA_FILE, read_metadata
from .checkpoint import _on_rank_zero as on_rank_zero  # rank 0 acts, every rank gets its result or its error

CHECKPOINT_NAME = re.compile(r"step_(\d{8})")
KEPT_CHECKPOINTS = 2
"""The newest and the one before: a newest that fails its checks at a load leaves one to resume from."""
PROGRESS_FILE = "progress.json"
EVENTS_FILE = "events.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticOptions:
    """What `train` is asked for besides the model, the data and the optimizer."""

    directory: str | os.PathLike
    """Where checkpoints (`step_<n>`), `progress.json` and `events.jsonl` (one JSON object a line) go."""
    steps: int
    """Optimizer steps to train in all, over every restart."""
    global_batch_size: int | None = None
    """Samples per step, the same at every world size (each rank reads global / world); or None."""
    replica_batch_size: int | None = None
    """With global_batch_size None: samples per rank per step; the global batch is this × the world size."""
    checkpoint_every: int = 100
    """Steps between checkpoints: at most this many steps are lost when a rank dies."""
    seed: int = 0
    """Of the model's initialization and the sample order."""
    clip_grad_norm: float | None = None
    timeout_s: float = 300.0
    """Process-group timeout: how long survivors wait in a collective of a rank that died silently."""
    plan_options: Mapping[str, Any] = field(default_factory=dict)
    """solve()'s PlanOptions (hardware, memory_budget, mixed_precision, ...); see [Note: elastic restarts]
    for the mesh."""
    backend: str = "shardplan"

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.replica_batch_size is None):
            raise ShardplanError("give exactly one of global_batch_size (kept at every world size) and "
                                 "replica_batch_size (per rank: the global batch scales with the world)")
        for name in ("steps", "checkpoint_every", "global_batch_size", "replica_batch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ShardplanError(f"{name} must be a whole number from 1, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """What one start of `train` did (the same on every rank)."""

    step: int
    """Steps done in all when it returned."""
    losses: tuple[float, ...]
    """This start's losses, one per step it ran."""
    stopped: bool
    """Whether SIGTERM stopped it before `steps` (after a checkpoint)."""
    plan: Plan


def train(model_factory: Callable[[], nn.Module], dataset, options: ElasticOptions, *,
          optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
          scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
          log: Callable[[str], None] = print) -> Outcome:
    """Train `model_factory()` on `dataset` to `options.steps`, resuming and re-planning on each (re)start.

    Call on every rank under torchrun (see [Note: elastic restarts]). `dataset[i]` is a tensor, a
    tuple or a dict of tensors; a batch of them (stacked) is passed to `program.step` as one
    positional argument, as positional arguments or as keywords. The model returns its loss.
    `optimizer_factory(parameters)` defaults to AdamW(lr=1e-3); `log` hears rank 0's lines.

    >>> outcome = train(lambda: zoo.gpt().model, tokens,                        # doctest: +SKIP
    ...                 ElasticOptions(directory="run", steps=1000, global_batch_size=64))
    """
    started, started_at = time.perf_counter(), time.time()
    _make_directory(Path(options.directory))
    owns_group = _join(options.timeout_s)
    timings = {**_startup(started_at), "rendezvous_s": time.perf_counter() - started}
    world = collectives.world()
    journal = _Journal(Path(options.directory), log if world.rank == 0 else None)
    global_batch, replica_batch = batch_sizes(options, world.size)
    torch.manual_seed(options.seed)  # the same initialization on every rank, at every start
    model = model_factory()
    plan = on_rank_zero(lambda: plan_for_world(model, _example_call(dataset, replica_batch), world.size,
                                               options.plan_options, timings))
    program = _timed(timings, "parallelize_s", lambda: parallelize(model, plan, backend=options.backend))
    optimizer = (optimizer_factory or _adamw)(program.parameters())
    state = _TrainingState(ResumableSampler(len(dataset), seed=options.seed),
                           scheduler_factory(optimizer) if scheduler_factory else None)
    resumed = _timed(timings, "load_s", lambda: _resume(program, optimizer, state, Path(options.directory), journal))
    journal.started(plan, resumed, world.size, global_batch, replica_batch, timings, started_at)
    stop = _Termination()
    losses: list[float] = []
    try:
        while state.step < options.steps and not stop.agreed():
            first_sample = state.sampler.consumed
            losses.append(_train_step(program, optimizer, state, dataset, global_batch, options.clip_grad_norm))
            journal.stepped(state.step, losses[-1], world.size, first_sample, global_batch, started)
            if state.step % options.checkpoint_every == 0 or state.step == options.steps:
                _save(program, optimizer, state, Path(options.directory), journal)
        stopped = state.step < options.steps
        if stopped and state.step % options.checkpoint_every:  # SIGTERM: keep what was trained
            _save(program, optimizer, state, Path(options.directory), journal)
    except Exception as error:  # most often a rank died: when this one saw it starts the restart's timeline
        journal.failed(state.step + 1, error)
        raise
    finally:
        stop.restore()
    outcome = Outcome(step=state.step, losses=tuple(losses), stopped=stopped, plan=plan)
    if owns_group:
        del program, optimizer, state, model
        collectives.shutdown()  # see [Note: shutdown] in collectives.py
    return outcome


def _train_step(program, optimizer: torch.optim.Optimizer, state: "_TrainingState", dataset, global_batch: int,
                clip_grad_norm: float | None) -> float:
    """One optimizer step on this rank's share of the stream's next global batch; its loss."""
    mesh = program.plan.mesh
    mine = ResumableSampler.replica_slice(state.sampler.take(global_batch),
                                          mesh.replica_of(collectives.world().rank), mesh.dp)
    args, kwargs = as_call(default_collate([dataset[index] for index in mine]))
    loss = float(program.step(*args, **kwargs))
    if clip_grad_norm is not None:
        program.clip_grad_norm_(clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if state.scheduler is not None:
        state.scheduler.step()
    state.step += 1
    return loss


def batch_sizes(options: ElasticOptions, world_size: int) -> tuple[int, int]:
    """(samples a step over every rank, samples a step on one rank) at `world_size`."""
    if options.replica_batch_size is not None:  # then global_batch_size is None (ElasticOptions checks)
        return options.replica_batch_size * world_size, options.replica_batch_size
    assert options.global_batch_size is not None  # for mypy: ElasticOptions requires one of the two
    if options.global_batch_size % world_size:
        raise ShardplanError(f"the global batch of {options.global_batch_size} samples does not split over "
                             f"{world_size} ranks: give a global batch every world size the job may run at "
                             "divides (e.g. 12 for 1-4 ranks), or replica_batch_size to scale it with the world")
    return options.global_batch_size, options.global_batch_size // world_size


def plan_for_world(model: nn.Module, example: tuple[tuple, dict], world_size: int,
                   plan_options: Mapping[str, Any], timings: dict[str, float]) -> Plan:
    """The fastest data-parallel plan for `world_size` ranks, each stepping `example`'s batch; the
    seconds its analysis and its solve took go into `timings`."""
    from ..compile import solve
    from ..passes import analyze

    args, kwargs = example
    chain = _timed(timings, "analyze_s", lambda: analyze(model, args, kwargs))
    # see [Note: elastic restarts]: each rank's batch is the world's share, so dp = world
    return _timed(timings, "solve_s", lambda: solve(chain, world_size, model_name=type(model).__name__,
                                                     **{**plan_options, "allow_pipeline": False,
                                                        "max_tensor_parallel": 1}))


def as_call(batch) -> tuple[tuple, dict]:
    """(args, kwargs) of `program.step` for a collated batch: a tensor, a tuple / list, or a dict of them."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    raise ShardplanError(f"a batch of the dataset's samples is a {type(batch).__name__}: make dataset[i] a "
                         "tensor, a tuple or a dict of tensors")


def latest_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """The finished checkpoints in `directory`, newest first: `step_<n>` (or its `.old` after a crash
    mid-swap, which checkpoint.read_metadata falls back to); `.partial` ones are unfinished."""
    found = {}
    for path in directory.glob("step_*") if directory.is_dir() else ():
        match = CHECKPOINT_NAME.fullmatch(path.name.removesuffix(".old"))
        if match and (path.name.endswith(".old") or (path / METADATA_FILE).is_file()):
            found[int(match.group(1))] = directory / match.group(0)
    return sorted(found.items(), reverse=True)


class _TrainingState:
    """What a checkpoint keeps besides the model and the optimizer, as its extra state."""

    def __init__(self, sampler: ResumableSampler, scheduler):
        self.step = 0
        self.sampler = sampler
        self.scheduler = scheduler

    def extras(self) -> dict[str, Any]:
        extras = {"sampler": self.sampler, "progress": self}
        return extras if self.scheduler is None else {**extras, "scheduler": self.scheduler}

    def state_dict(self) -> dict[str, Any]:
        # rank 0's generator: after a world change no rank's stream continues as it would have anyway
        return {"step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"])


@dataclass(frozen=True, kw_only=True, slots=True)
class _Resumed:
    step: int
    plan: Plan | None
    """The plan that wrote the checkpoint; None where this version cannot read it (a plan an older version
    saved past the schema's bounds): only the log reads it, as every start plans afresh."""
    world_size: int


def _resume(program, optimizer, state: _TrainingState, directory: Path, journal: "_Journal") -> _Resumed | None:
    """Load the newest checkpoint that passes its checks (all or nothing on every rank); None when there is
    none. Raises when there are some and none loads: starting afresh would soon remove them."""
    found = on_rank_zero(lambda: latest_checkpoints(directory))
    for step, path in found:
        try:
            program.load(path, optimizer, extra=state.extras())
        except CheckpointError as error:  # raised on every rank alike, nothing applied
            journal.note(f"checkpoint {path} not loaded ({error}); trying the one before")
            continue
        _, metadata = on_rank_zero(lambda: read_metadata(path))
        return _Resumed(step=step, plan=_saved_plan(metadata, path, journal), world_size=metadata["world_size"])
    if found:
        raise CheckpointError(f"none of the {len(found)} checkpoint(s) in {directory} loads (the log says why for "
                              "each): mend or move them, or train in another directory")
    return None


def _saved_plan(metadata: dict, path: Path, journal: "_Journal") -> Plan | None:
    """The plan a loaded checkpoint records, or None with a note where it cannot be read: the state it holds
    loaded (checked by parameter name and shape, whatever the plan), so refusing would only make every
    restart fail on a record the log alone reads."""
    try:
        return Plan.from_json(json.dumps(metadata["plan"]))
    except PlanError as error:
        journal.note(f"checkpoint {path} loaded, but the plan it records cannot be read ({error}); the log "
                     "compares no plans")
        return None


def _save(program, optimizer, state: _TrainingState, directory: Path, journal: "_Journal") -> None:
    started = time.perf_counter()
    program.save(directory / f"step_{state.step:08d}", optimizer, extra=state.extras())
    on_rank_zero(lambda: _remove_old_checkpoints(directory))
    journal.saved(state.step, time.perf_counter() - started)


def _remove_old_checkpoints(directory: Path) -> None:
    import shutil

    for _, path in latest_checkpoints(directory)[KEPT_CHECKPOINTS:]:
        shutil.rmtree(path, ignore_errors=True)


def _make_directory(directory: Path) -> None:
    """Make the run's directory, or say why it cannot be (before the rendezvous, not at the first log line)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        cause = "it is a file" if isinstance(error, FileExistsError) else error.strerror or str(error)
        raise ShardplanError(f"cannot keep the run in {directory}: {cause}; give a folder this process may "
                             "write (made if missing)") from None


def _join(timeout_s: float) -> bool:
    """Join the process group torchrun's rendezvous set up; whether this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ShardplanError("no process group and no torchrun environment (RANK, MASTER_ADDR): launch with "
                             "torchrun --nnodes=MIN:MAX ... (README, 'Elastic training'), or call "
                             "torch.distributed.init_process_group first")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _startup(started_at: float) -> dict[str, float]:
    """{"startup_s": seconds from this process's start to `started_at`} (Python, imports, the CLI), read from
    /proc/self/stat on Linux; {} elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, AttributeError, IndexError, ValueError):  # no /proc, or no CLOCK_BOOTTIME
        return {}
    return {"startup_s": max(0.0, age_s - (time.time() - started_at))}


def _example_call(dataset, replica_batch: int) -> tuple[tuple, dict]:
    """A batch shaped as every step's on one rank, for the analysis (sample 0 repeated: shapes matter)."""
    return as_call(default_collate([dataset[0]] * replica_batch))


def _adamw(parameters: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-3)


def _timed(timings: dict[str, float], name: str, action: Callable[[], Any]) -> Any:
    started = time.perf_counter()
    result = action()
    timings[name] = time.perf_counter() - started
    return result


class _Termination:
    """SIGTERM (what torchrun sends its workers when it is stopped) asks for a checkpoint and a clean exit."""

    def __init__(self):
        self.asked = False
        self._previous = signal.signal(signal.SIGTERM, self._ask)

    def _ask(self, signum, frame) -> None:
        self.asked = True

    def agreed(self) -> bool:
        """Whether any rank was asked (a collective: ranks get the signal at different steps)."""
        flag = torch.tensor([float(self.asked)], device=collectives.default_device())
        return bool(collectives.all_reduce_max(flag).item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class _Journal:
    """Rank 0's record: a line for a person (`log`), a JSON object in events.jsonl, progress.json."""

    def __init__(self, directory: Path, log: Callable[[str], None] | None):
        self.directory = directory
        self.log = log
        self.last_progress = self._last_progress() if log is not None else None
        """What the last start had done when it stopped (its last finished step), read before this start writes."""
        self.first_step = True

    def _last_progress(self) -> dict[str, Any] | None:
        """progress.json, or None where there is none or it cannot be read (a crash mid-write; it only feeds the
        log's steps lost and time since the last step, so a bad one is noted, never fatal)."""
        file = self.directory / PROGRESS_FILE
        if not file.is_file():
            return None
        try:
            progress = parse_json(read_text(file, "progress file"), f"progress file {file}")
        except ShardplanError as error:
            self.note(f"{error}; the log counts no steps lost")
            return None
        if not (isinstance(progress, dict) and type(progress.get("step")) is int  # as stepped() writes them
                and type(progress.get("global_batch", 0)) is int and type(progress.get("time")) is float):
            self.note(f"progress file {file} holds no step, time and global batch: it was damaged; the log counts "
                      "no steps lost")
            return None
        return progress

    def note(self, text: str) -> None:
        self._emit(text, {"event": "note", "text": text})

    def started(self, plan: Plan, resumed: _Resumed | None, world_size: int, global_batch: int, replica_batch: int,
                timings: dict[str, float], started_at: float) -> None:
        if self.log is None:
            return
        predicted_ms = plan.predicted.step_time_s * 1e3
        fields: dict[str, Any] = {"event": "start", "started_at": started_at, "world_size": world_size,
                                  "global_batch": global_batch, "replica_batch": replica_batch,
                                  "mesh": plan.mesh.describe(),
                                  "micro_batches": plan.schedule.num_micro_batches,
                                  "predicted_step_s": plan.predicted.step_time_s,
                                  **{name: round(value, 3) for name, value in timings.items()}}
        startup = f"start-up {timings['startup_s']:.1f} s, " if "startup_s" in timings else ""
        lines = [f"world of {world_size} ranks: planned {plan.mesh.describe()}, "
                 f"{plan.schedule.num_micro_batches} micro-batch(es), predicted step {predicted_ms:.1f} ms "
                 f"({startup}rendezvous {timings['rendezvous_s']:.1f} s, analysis {timings['analyze_s']:.1f} s, solve "
                 f"{timings['solve_s']:.1f} s, parallelize "
                 f"{timings['parallelize_s']:.1f} s, load {timings['load_s']:.1f} s)"]
        if resumed is None:
            lines.append(f"no checkpoint in {self.directory}: training from step 0")
        else:
            lost = max(0, (self.last_progress or {}).get("step", resumed.step) - resumed.step)
            fields.update(resumed_step=resumed.step, old_world_size=resumed.world_size, steps_lost=lost)
            old_plan, changes = "its plan unreadable", []
            if resumed.plan is not None:
                fields.update(old_mesh=resumed.plan.mesh.describe(),
                              old_predicted_step_s=resumed.plan.predicted.step_time_s)
                old_plan = (f"{resumed.plan.mesh.describe()}, predicted step "
                            f"{resumed.plan.predicted.step_time_s * 1e3:.1f} ms")
                changes = self._plan_changes(resumed.plan, plan)
            lines += [f"resumed step {resumed.step} (saved on {resumed.world_size} ranks, {old_plan}); "
                      f"{lost} step(s) lost", *changes]
            old_global = (self.last_progress or {}).get("global_batch")
            if old_global is not None and old_global != global_batch:
                lines.append(f"global batch scaled from {old_global} to {global_batch} samples a step "
                             f"({replica_batch} per rank x {world_size} ranks); the learning rate is as it was")
        self._emit("\n".join(lines), fields)

    @staticmethod
    def _plan_changes(old: Plan, new: Plan) -> list[str]:
        from ..report import plan_changes

        changes = plan_changes(old, new)
        return ["plan changes (as shardplan diff):"] + [f"  {change}" for change in changes] if changes else \
            ["plan unchanged"]

    def stepped(self, step: int, loss: float, world_size: int, first_sample: int, global_batch: int,
                started: float) -> None:
        if self.log is None:
            return
        now = time.time()
        fields = {"event": "step", "step": step, "loss": loss, "world_size": world_size,
                  "first_sample": first_sample, "global_batch": global_batch}
        text = f"step {step}: loss {loss:.4f}"
        if self.first_step:
            since_start = time.perf_counter() - started
            fields["since_start_s"] = round(since_start, 3)
            text += f" (first on this plan, {since_start:.1f} s after this start"
            if self.last_progress is not None:
                fields["since_last_step_s"] = round(now - self.last_progress["time"], 3)
                text += f", {fields['since_last_step_s']:.1f} s after the last start's last step"
            text += ")"
            self.first_step = False
        self._emit(text, fields)
        progress = {"step": step, "time": now, "world_size": world_size, "global_batch": global_batch}
        temporary = self.directory / (PROGRESS_FILE + ".tmp")
        temporary.write_text(json.dumps(progress))
        os.replace(temporary, self.directory / PROGRESS_FILE)

    def failed(self, step: int, error: Exception) -> None:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        self._emit(f"step {step} failed: {cause}", {"event": "failed", "step": step, "error": cause})

    def saved(self, step: int, seconds: float) -> None:
        self._emit(f"checkpoint at step {step} ({seconds:.1f} s)", {"event": "checkpoint", "step": step,
                                                                   "seconds": round(seconds, 3)})

    def _emit(self, text: str, fields: dict[str, Any]) -> None:
        if self.log is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / EVENTS_FILE, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **fields}) + "\n")
        self.log(text)
