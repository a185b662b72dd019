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
import errno
import json
import math
import os
import re
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeGuard

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import default_collate

from shardplan.common.files import (
    append_line,
    is_finite_number,
    parse_json,
    read_text,
    write_text_atomically,
)
from shardplan.errors import CheckpointError, PlanError, ShardplanError
from shardplan.plan import Plan
from shardplan.runtime import collectives, parallelize
from shardplan.runtime.checkpoint import (
    METADATA_FILE,
    read_metadata,
    read_saved_extra,
    remove_checkpoint,
)
from shardplan.runtime.checkpoint import (
    _on_rank_zero as on_rank_zero,  # rank 0 acts, every rank gets its result or its error
)
from shardplan.runtime.sampler import ResumableSampler

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
    adopt_checkpoint: bool = False
    """Resume a checkpoint another run saved (copied into this run's folder to continue it); without it such
    a checkpoint is passed over ([Note: run folder])."""
    lr_schedule: str = "constant"
    """How the learning rate follows the steps after the warmup: "constant", "linear" (down to 0 at
    `steps`) or "cosine" (half a cosine down to 0 at `steps`); see lr_factor."""
    warmup_steps: int = 0
    """Steps whose learning rate rises linearly to the optimizer's (step k of them at (k + 1) / warmup)."""
    eval_every: int | None = None
    """Steps between evaluations of the held-out samples (and one at the end); None: none."""
    eval_samples: int = 0
    """The dataset's last samples, held out of training for evaluation; 0 with eval_every None."""
    settings: Mapping[str, Any] = field(default_factory=dict)
    """What this start was asked (a command's flags, JSON values): recorded in the run folder's
    settings.json; a later start logs each that changed ([Note: changed settings])."""
    fixed_settings: tuple[str, ...] = ()
    """Keys of `settings` a start may not change once the run has a checkpoint (those that fix the
    model or the data order)."""

    def __post_init__(self) -> None:
        if (self.global_batch_size is None) == (self.replica_batch_size is None):
            raise ShardplanError(
                "give exactly one of global_batch_size (kept at every world size) and "
                "replica_batch_size (per rank: the global batch scales with the world)"
            )
        for name in ("steps", "checkpoint_every", "global_batch_size", "replica_batch_size"):
            value = getattr(self, name)
            if value is not None and (not _is_whole(value) or not 1 <= value <= MAX_COUNT):
                raise ShardplanError(
                    f"{name} must be a whole number from 1 to {MAX_COUNT}, got {value!r}"
                )
        if not _is_whole(self.seed) or not 0 <= self.seed < 2**63:
            raise ShardplanError(
                f"seed must be a whole number from 0 to 2^63 - 1 (torch's), got {self.seed!r}"
            )
        if self.clip_grad_norm is not None and not (
            is_finite_number(self.clip_grad_norm) and self.clip_grad_norm > 0
        ):
            raise ShardplanError(
                f"the gradient clip (--clip) is {self.clip_grad_norm!r}: give the largest global "
                "gradient norm to allow, a finite number above 0, or no clip"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ShardplanError(
                f"lr_schedule {self.lr_schedule!r} is unknown: use one of {', '.join(LR_SCHEDULES)}"
            )
        if not _is_whole(self.warmup_steps) or not 0 <= self.warmup_steps < self.steps:
            raise ShardplanError(
                f"warmup_steps (--warmup-steps) is {self.warmup_steps!r}: give a whole number of "
                f"steps from 0 to below steps ({self.steps})"
            )
        if self.eval_every is not None and (
            not _is_whole(self.eval_every) or not 1 <= self.eval_every <= MAX_COUNT
        ):
            raise ShardplanError(
                f"eval_every (--eval-every) is {self.eval_every!r}: give the steps between "
                "evaluations, a whole number from 1"
            )
        if not _is_whole(self.eval_samples) or not 0 <= self.eval_samples <= MAX_COUNT:
            raise ShardplanError(
                f"eval_samples (--eval-samples) is {self.eval_samples!r}: give a whole number of "
                "samples, 0 or more"
            )
        if (self.eval_every is None) != (self.eval_samples == 0):
            raise ShardplanError(
                "give eval_every and eval_samples together (--eval-every N holds out the data's "
                "last --eval-samples samples), or neither"
            )
        if not (is_finite_number(self.timeout_s) and 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise ShardplanError(
                f"the process-group timeout (--timeout) is {self.timeout_s!r} s: give the seconds "
                f"ranks wait on a silent one, above 0 and at most {MAX_TIMEOUT_S:.0f} (a week)"
            )


LR_SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, options: ElasticOptions) -> float:
    """The share of the optimizer's learning rate step `step` (from 0) takes: (step + 1) / warmup_steps
    in the warmup, then 1 (constant), falling linearly to 0 at options.steps (linear), or along half
    a cosine to 0 at options.steps (cosine). A function of the step alone, so a resumed run follows
    the schedule exactly, whatever world it resumes on.

    >>> lr_factor(0, ElasticOptions(directory="r", steps=10, global_batch_size=2, warmup_steps=4))
    0.25
    """
    if step < options.warmup_steps:
        return (step + 1) / options.warmup_steps
    if options.lr_schedule == "constant":
        return 1.0
    progress = (step - options.warmup_steps) / max(1, options.steps - options.warmup_steps)
    if options.lr_schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


MAX_COUNT = 2**40
"""The most steps, samples a step or steps between checkpoints asked for: far past any run, and what a
checkpoint's name (step_<n>) and a sampler's count hold exactly."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0


def _is_whole(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


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


def train(
    model_factory: Callable[[], nn.Module],
    dataset,
    options: ElasticOptions,
    *,
    optimizer_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    scheduler_factory: Callable[[torch.optim.Optimizer], Any] | None = None,
    log: Callable[[str], None] = print,
) -> Outcome:
    """Train `model_factory()` on `dataset` to `options.steps`, resuming and re-planning on each (re)start.

    Call on every rank under torchrun (see [Note: elastic restarts]). `dataset[i]` is a tensor, a
    tuple or a dict of tensors; a batch of them (stacked) is passed to `program.step` as one
    positional argument, as positional arguments or as keywords. The model returns its loss.
    `optimizer_factory(parameters)` defaults to AdamW(lr=1e-3); `log` hears rank 0's lines.

    >>> outcome = train(lambda: zoo.gpt().model, tokens,                        # doctest: +SKIP
    ...                 ElasticOptions(directory="run", steps=1000, global_batch_size=64))
    """
    started, started_at = time.perf_counter(), time.time()
    directory = Path(options.directory)
    _make_directory(directory)
    samples = _samples_in(dataset)  # refuses no dataset before the rendezvous
    if options.eval_samples and options.eval_samples >= samples:
        raise ShardplanError(
            f"eval_samples (--eval-samples) {options.eval_samples} leaves none of the dataset's "
            f"{samples} samples to train on: hold out fewer"
        )
    if scheduler_factory is not None and (
        options.lr_schedule != "constant" or options.warmup_steps
    ):
        raise ShardplanError(
            "both a scheduler_factory and lr_schedule / warmup_steps set the learning rate: give one"
        )
    sampler = ResumableSampler(samples - options.eval_samples, seed=options.seed)
    owns_group = _join(options.timeout_s)
    timings = {**_startup(started_at), "rendezvous_s": time.perf_counter() - started}
    lock: list[_RunLock] = []  # rank 0's, held until this start returns or fails
    try:
        run = on_rank_zero(lambda: _claim_run_folder(directory, lock))
        changed = on_rank_zero(lambda: _record_settings(directory, options))
        return _train(
            model_factory,
            dataset,
            sampler,
            options,
            optimizer_factory,
            scheduler_factory,
            log,
            run=run,
            changed_settings=changed,
            owns_group=owns_group,
            timings=timings,
            started=started,
            started_at=started_at,
        )
    finally:
        for held in lock:
            held.release()


def _train(
    model_factory,
    dataset,
    sampler: ResumableSampler,
    options: ElasticOptions,
    optimizer_factory,
    scheduler_factory,
    log,
    *,
    run: str,
    changed_settings: list[str],
    owns_group: bool,
    timings: dict[str, float],
    started: float,
    started_at: float,
) -> Outcome:
    """train's start once rank 0 holds the run folder (see [Note: run folder])."""
    directory = Path(options.directory)
    world = collectives.world()
    journal = _Journal(directory, log if world.rank == 0 else None)
    global_batch, replica_batch = batch_sizes(options, world.size)
    torch.manual_seed(options.seed)  # the same initialization on every rank, at every start
    model = model_factory()
    plan = on_rank_zero(
        lambda: plan_for_world(
            model, _example_call(dataset, replica_batch), world.size, options.plan_options, timings
        )
    )
    if options.eval_samples and options.eval_samples < plan.mesh.dp:
        # refused before any step: found at the first evaluation, every restart would train to it again
        raise ShardplanError(
            f"{options.eval_samples} held-out sample(s) do not split over this world's "
            f"{plan.mesh.dp} data-parallel ranks: hold out at least as many samples as ranks "
            "(--eval-samples)"
        )
    program = _timed(
        timings, "parallelize_s", lambda: parallelize(model, plan, backend=options.backend)
    )
    optimizer = (optimizer_factory or _adamw)(program.parameters())
    configured = configured_hyperparameters(optimizer)  # before a scheduler sets its first rate
    state = _TrainingState(
        sampler,
        scheduler_factory(optimizer) if scheduler_factory else None,
        run=run,
        hyperparameters=configured,
        adopt_checkpoint=options.adopt_checkpoint,
    )
    resumed = _timed(
        timings, "load_s", lambda: _resume(program, optimizer, state, directory, journal)
    )
    if resumed is not None:
        _apply_changed_hyperparameters(optimizer, state, journal)
    journal.started(plan, resumed, world.size, global_batch, replica_batch, timings, started_at)
    if changed_settings:
        journal.note(
            "changed since the run's last start, this start's values are used: "
            + ", ".join(changed_settings)
        )
    base_lrs = [group.get("lr") for group in state.hyperparameters]
    scheduled = options.lr_schedule != "constant" or options.warmup_steps > 0
    stop = _Termination()
    losses: list[float] = []
    try:
        while state.step < options.steps and not stop.agreed():
            first_sample = state.sampler.consumed
            if scheduled:
                _set_lr(optimizer, base_lrs, lr_factor(state.step, options))
            losses.append(
                _train_step(
                    program, optimizer, state, dataset, global_batch, options.clip_grad_norm
                )
            )
            journal.stepped(state.step, losses[-1], world.size, first_sample, global_batch, started)
            # saved first: an evaluation that fails must not cost the step its checkpoint
            if state.step % options.checkpoint_every == 0 or state.step == options.steps:
                _save(program, optimizer, state, directory, journal)
            if options.eval_every and (
                state.step % options.eval_every == 0 or state.step == options.steps
            ):
                journal.evaluated(
                    state.step,
                    *_evaluate(program, dataset, state.sampler.num_samples, options, global_batch),
                )
        stopped = state.step < options.steps
        if stopped and state.step % options.checkpoint_every:  # SIGTERM: keep what was trained
            _save(program, optimizer, state, directory, journal)
    except (
        Exception
    ) as error:  # most often a rank died: when this one saw it starts the restart's timeline
        journal.failed(state.step + 1, error)
        raise
    finally:
        stop.restore()
    outcome = Outcome(step=state.step, losses=tuple(losses), stopped=stopped, plan=plan)
    if owns_group:
        del program, optimizer, state, model
        collectives.shutdown()  # see [Note: shutdown] in collectives.py
    return outcome


def _train_step(
    program,
    optimizer: torch.optim.Optimizer,
    state: "_TrainingState",
    dataset,
    global_batch: int,
    clip_grad_norm: float | None,
) -> float:
    """One optimizer step on this rank's share of the stream's next global batch; its loss."""
    mesh = program.plan.mesh
    mine = ResumableSampler.replica_slice(
        state.sampler.take(global_batch), mesh.replica_of(collectives.world().rank), mesh.dp
    )
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


def _set_lr(optimizer: torch.optim.Optimizer, base_lrs: list, factor: float) -> None:
    """Each param group's learning rate at `factor` of its configured one (lr_factor)."""
    for group, base in zip(optimizer.param_groups, base_lrs):
        if base is None:
            continue
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(base * factor)
        else:
            group["lr"] = base * factor


def _evaluate(
    program, dataset, first: int, options: ElasticOptions, global_batch: int
) -> tuple[float, int]:
    """(the mean loss over the held-out samples, the dataset's from `first` on, the samples read): a
    global batch at a time, each data-parallel rank its slice; a last part smaller than a global batch
    is read at the largest size the data-parallel ranks split evenly (the rest is left out)."""
    mesh = program.plan.mesh
    replica = mesh.replica_of(collectives.world().rank)
    held_out = list(range(first, first + options.eval_samples))
    total, weight = 0.0, 0
    for start in range(0, len(held_out), global_batch):
        chunk = held_out[start : start + global_batch]
        chunk = chunk[: len(chunk) - len(chunk) % mesh.dp]
        if not chunk:
            break
        mine = ResumableSampler.replica_slice(chunk, replica, mesh.dp)
        args, kwargs = as_call(default_collate([dataset[index] for index in mine]))
        total += float(program.evaluate(*args, **kwargs)) * len(chunk)
        weight += len(chunk)
    if not weight:
        raise ShardplanError(
            f"{options.eval_samples} held-out sample(s) do not split over {mesh.dp} "
            "data-parallel ranks: hold out at least as many samples as ranks (--eval-samples)"
        )
    return total / weight, weight


# [Note: changed settings]
# A run's settings (the command's flags) are recorded in settings.json at every start. A later start
# compares its own with them: those that fix the model or the data order (ElasticOptions.fixed_settings:
# the model, the data, the seed, the held-out samples) may not change once the run has a checkpoint, and
# the start is refused naming the value to give back; every other change is logged, and this start's
# value is used (steps, learning rate and its schedule, precision, batch, clip, evaluation, hardware).
SETTINGS_FILE = "settings.json"


def _record_settings(directory: Path, options: ElasticOptions) -> list[str]:
    """Write this start's settings into the run folder; what changed since the last start's, as
    "name old -> new" (refused for a fixed one when the run has a checkpoint)."""
    file = directory / SETTINGS_FILE
    before: dict[str, Any] = {}
    if os.path.lexists(file):
        try:
            found = parse_json(
                read_text(file, "run settings", regular_only=True), f"run settings {file}"
            )
        except ShardplanError as error:
            found = error
        if not isinstance(found, dict) and latest_checkpoints(directory):
            # replaced unread, it could no longer refuse a start whose model or data differ from
            # the checkpoints'
            why = found if isinstance(found, ShardplanError) else "it holds no object"
            raise ShardplanError(
                f"{why}; run settings {file} hold what the run's checkpoints were trained with: "
                "restore the file from a copy, or remove it to take this start's settings"
            )
        before = found if isinstance(found, dict) else {}
    now = json.loads(json.dumps(dict(options.settings)))
    changed = [
        (key, before[key], value)
        for key, value in now.items()
        if key in before and before[key] != value
    ]
    fixed = [change for change in changed if change[0] in options.fixed_settings]
    if fixed and latest_checkpoints(directory):
        key, old, new = fixed[0]
        raise ShardplanError(
            f"{key} was {json.dumps(old)} when the run in {directory} began and is {json.dumps(new)} "
            f"now: it fixes the model or the data order of the run's checkpoints; give "
            f"{json.dumps(old)} again, or train in another directory"
        )
    if now:
        write_text_atomically(
            file, json.dumps(now, indent=2, sort_keys=True) + "\n", through_links=False
        )
    return [f"{key} {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in changed]


def batch_sizes(options: ElasticOptions, world_size: int) -> tuple[int, int]:
    """(samples a step over every rank, samples a step on one rank) at `world_size`."""
    if (
        options.replica_batch_size is not None
    ):  # then global_batch_size is None (ElasticOptions checks)
        return options.replica_batch_size * world_size, options.replica_batch_size
    assert options.global_batch_size is not None  # for mypy: ElasticOptions requires one of the two
    if options.global_batch_size % world_size:
        raise ShardplanError(
            f"the global batch of {options.global_batch_size} samples does not split over "
            f"{world_size} ranks: give a global batch every world size the job may run at "
            "divides (e.g. 12 for 1-4 ranks), or replica_batch_size to scale it with the world"
        )
    return options.global_batch_size, options.global_batch_size // world_size


def plan_for_world(
    model: nn.Module,
    example: tuple[tuple, dict],
    world_size: int,
    plan_options: Mapping[str, Any],
    timings: dict[str, float],
) -> Plan:
    """The fastest data-parallel plan for `world_size` ranks, each stepping `example`'s batch; the
    seconds its analysis and its solve took go into `timings`."""
    from shardplan.compile import solve
    from shardplan.frontend.passes import analyze

    args, kwargs = example
    precision = plan_options.get("mixed_precision")
    compute_dtype = getattr(precision, "param_dtype", None)  # as compile analyzes it
    chain = _timed(
        timings, "analyze_s", lambda: analyze(model, args, kwargs, compute_dtype=compute_dtype)
    )
    # see [Note: elastic restarts]: each rank's batch is the world's share, so dp = world
    return _timed(
        timings,
        "solve_s",
        lambda: solve(
            chain,
            world_size,
            model_name=type(model).__name__,
            **{
                **plan_options,
                "allow_pipeline": False,
                "max_tensor_parallel": 1,
                "max_context_parallel": 1,
                "max_expert_parallel": 1,
            },
        ),
    )


def as_call(batch) -> tuple[tuple, dict]:
    """(args, kwargs) of `program.step` for a collated batch: a tensor, a tuple / list, or a dict of them."""
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    raise ShardplanError(
        f"a batch of the dataset's samples is a {type(batch).__name__}: make dataset[i] a "
        "tensor, a tuple or a dict of tensors"
    )


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

    def __init__(
        self,
        sampler: ResumableSampler,
        scheduler,
        *,
        run: str = "",
        hyperparameters: list[dict[str, Any]] | None = None,
        adopt_checkpoint: bool = False,
    ):
        self.step = 0
        self.sampler = sampler
        self.scheduler = scheduler
        self.run = run
        """This run's id (run.json): saved with each checkpoint, compared at a load ([Note: run folder])."""
        self.hyperparameters = hyperparameters or []
        """The optimizer's numbers (lr, betas, ...) per param group, as this start built it: saved, so that a
        later start sees what it changed."""
        self.adopt_checkpoint = adopt_checkpoint
        self.saved_hyperparameters: list[dict[str, Any]] | None = None
        """The loaded checkpoint's `hyperparameters`; None where it records none."""

    def extras(self) -> dict[str, Any]:
        extras = {"sampler": self.sampler, "progress": self}
        return extras if self.scheduler is None else {**extras, "scheduler": self.scheduler}

    def state_dict(self) -> dict[str, Any]:
        # rank 0's generator: after a world change no rank's stream continues as it would have anyway
        return {
            "step": self.step,
            "rng": torch.get_rng_state(),
            "run": self.run,
            "hyperparameters": self.hyperparameters,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Checked whole before anything is set; a CheckpointError makes the start try the checkpoint before."""
        step, rng, run = state.get("step"), state.get("rng"), state.get("run")
        if not _is_whole(step) or not 0 <= step <= MAX_COUNT:
            raise CheckpointError(
                f"its progress holds step {str(step)[:40]}, not a count of steps from 0: it is "
                "corrupt or was crafted"
            )
        live_rng = torch.get_rng_state()
        if not (
            isinstance(rng, torch.Tensor)
            and rng.dtype == live_rng.dtype
            and rng.shape == live_rng.shape
        ):
            shape = tuple(rng.shape) if isinstance(rng, torch.Tensor) else type(rng).__name__
            raise CheckpointError(
                f"its progress holds a random generator state of shape {shape}, where torch's is "
                f"{tuple(live_rng.shape)}: it is corrupt or was crafted"
            )
        if (
            run is not None and run != self.run and not self.adopt_checkpoint
        ):  # None: saved before runs had ids
            raise CheckpointError(
                f"it was saved by another run ({str(run)[:40]}; this folder's run is {self.run}): "
                "move it out of the folder, or pass --adopt-checkpoint (adopt_checkpoint=True) "
                "to continue that run here"
            )
        self.step = step
        torch.set_rng_state(rng)
        saved = state.get("hyperparameters")
        self.saved_hyperparameters = saved if _are_hyperparameters(saved) else None


def configured_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Per param group, its numbers and tuples of numbers (lr, betas, eps, weight_decay, ...): neither tensors nor
    flags."""
    return [
        {
            key: value
            for key, value in group.items()
            if key != "params" and _is_hyperparameter(value)
        }
        for group in optimizer.param_groups
    ]


def _is_hyperparameter(value: object) -> bool:
    return is_finite_number(value) or (
        isinstance(value, tuple) and bool(value) and all(map(is_finite_number, value))
    )


def _are_hyperparameters(saved: object) -> bool:
    return isinstance(saved, list) and all(
        isinstance(group, dict)
        and all(isinstance(key, str) and _is_hyperparameter(value) for key, value in group.items())
        for group in saved
    )


def _apply_changed_hyperparameters(
    optimizer: torch.optim.Optimizer, state: _TrainingState, journal: "_Journal"
) -> None:
    """The hyperparameters this start built its optimizer with, where they differ from those the checkpoint's
    start did: the load restored the checkpoint's, and a changed --lr would otherwise be dropped unsaid."""
    saved = state.saved_hyperparameters
    if saved is None or len(saved) != len(state.hyperparameters):
        return
    changes = [
        (index, key, saved[index][key], value)
        for index, group in enumerate(state.hyperparameters)
        for key, value in group.items()
        if key in saved[index] and saved[index][key] != value
    ]
    if not changes:
        return
    groups = len(state.hyperparameters) > 1
    described = ", ".join(
        f"{key} {old} -> {new}" + (f" (param group {index})" if groups else "")
        for index, key, old, new in changes
    )
    if state.scheduler is not None:
        raise ShardplanError(
            f"the optimizer was built with other hyperparameters than the run's checkpoint was "
            f"trained with ({described}), and its scheduler sets the rate from its saved state: "
            "build the optimizer as before to resume, or train in another directory"
        )
    for index, key, _, value in changes:
        group = optimizer.param_groups[index]
        if isinstance(group[key], torch.Tensor):
            group[key].fill_(value)
        else:
            group[key] = value
    journal.note(
        f"the optimizer's {described} at this start: training on with the new values (the optimizer "
        "state, its moments, is the checkpoint's)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class _Resumed:
    step: int
    plan: Plan | None
    """The plan that wrote the checkpoint; None where this version cannot read it (a plan an older version
    saved past the schema's bounds): only the log reads it, as every start plans afresh."""
    world_size: int


def _resume(
    program, optimizer, state: _TrainingState, directory: Path, journal: "_Journal"
) -> _Resumed | None:
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
        return _Resumed(
            step=step, plan=_saved_plan(metadata, path, journal), world_size=metadata["world_size"]
        )
    if found:
        raise CheckpointError(
            f"none of the {len(found)} checkpoint(s) in {directory} loads (the log says why for "
            "each): mend or move them, or train in another directory"
        )
    return None


def _saved_plan(metadata: dict, path: Path, journal: "_Journal") -> Plan | None:
    """The plan a loaded checkpoint records, or None with a note where it cannot be read: the state it holds
    loaded (checked by parameter name and shape, whatever the plan), so refusing would only make every
    restart fail on a record the log alone reads."""
    try:
        return Plan.from_json(json.dumps(metadata["plan"]))
    except PlanError as error:
        journal.note(
            f"checkpoint {path} loaded, but the plan it records cannot be read ({error}); the log "
            "compares no plans"
        )
        return None


def _save(program, optimizer, state: _TrainingState, directory: Path, journal: "_Journal") -> None:
    started = time.perf_counter()
    program.save(directory / f"step_{state.step:08d}", optimizer, extra=state.extras())
    on_rank_zero(lambda: remove_old_checkpoints(directory, state.step, state.run))
    journal.saved(state.step, time.perf_counter() - started)


def remove_old_checkpoints(directory: Path, saved_step: int, run: str) -> None:
    """After a save at `saved_step`, remove this run's checkpoints older than the newest KEPT_CHECKPOINTS - 1
    before it. Only those: a checkpoint of a later step, or one this run did not save (another run's, one
    whose progress cannot be read), is a start's to pass over, never this run's to delete."""
    older = [path for step, path in latest_checkpoints(directory) if step < saved_step]
    for path in older[KEPT_CHECKPOINTS - 1 :]:
        if _saved_by(path) == run:
            remove_checkpoint(path)


def _saved_by(path: Path) -> str | None:
    """The run id a checkpoint's progress records; None where it records none or cannot be read."""
    try:
        progress = read_saved_extra(path, "progress")
    except CheckpointError:
        return None
    run = progress.get("run") if isinstance(progress, dict) else None
    return run if isinstance(run, str) else None


# [Note: run folder]
# A run's folder holds its checkpoints (step_<n>), progress.json, events.jsonl, run.json (the run's id, made at
# its first start) and run.lock. Rank 0 holds an exclusive lock on run.lock while a start runs: a second job
# given the same folder stops at once, where it would interleave events.jsonl with the first's and remove its
# checkpoints as its own old ones. Each checkpoint's progress carries the run's id, and a start passes over a
# checkpoint of another run (one copied or swapped in would resume at another run's weights and learning rate,
# the log saying only "resumed") unless asked to adopt it. The run's own files are written anew beside their
# name and renamed, or appended to without following a link, and read only when they are regular files: a link
# or a FIFO someone left in the folder is refused, never written through or waited on.
RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


class _RunLock:
    """An exclusive flock on the run folder's LOCK_FILE; the system drops it when its process ends, however."""

    def __init__(self, directory: Path):
        import fcntl

        file = directory / LOCK_FILE
        try:
            self.descriptor = os.open(
                file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666
            )
        except OSError as error:
            cause = (
                "it is a symbolic link"
                if error.errno == errno.ELOOP
                else error.strerror or str(error)
            )
            raise ShardplanError(
                f"cannot lock the run folder: {file}: {cause}; remove it, or give another "
                "--directory"
            ) from None
        try:
            fcntl.flock(self.descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = (
                os.read(self.descriptor, 200).decode("utf-8", "replace").strip()
                or "another process"
            )
            os.close(self.descriptor)
            raise ShardplanError(
                f"another job is training in {directory} ({holder} holds {LOCK_FILE}): wait for it "
                "to end, or give this job another --directory"
            ) from None
        except OSError as error:
            os.close(self.descriptor)
            raise ShardplanError(
                f"cannot lock the run folder: {file}: {error.strerror or error}; give another "
                "--directory"
            ) from None
        os.ftruncate(self.descriptor, 0)
        os.pwrite(self.descriptor, f"process {os.getpid()} on {socket.gethostname()}".encode(), 0)

    def release(self) -> None:
        os.close(self.descriptor)


def _claim_run_folder(directory: Path, held: list[_RunLock]) -> str:
    """Lock the run folder (into `held`) and give the run's id, made at its first start ([Note: run folder])."""
    held.append(_RunLock(directory))
    file = directory / RUN_FILE
    if not os.path.lexists(file):
        run = uuid.uuid4().hex
        write_text_atomically(file, json.dumps({"run": run}) + "\n", through_links=False)
        return run
    data = parse_json(
        read_text(file, "run identity file", regular_only=True), f"run identity file {file}"
    )
    if not (
        isinstance(data, dict)
        and isinstance(data.get("run"), str)
        and _RUN_ID.fullmatch(data["run"])
    ):
        raise ShardplanError(
            f"run identity file {file} holds no run id: it was damaged; remove it (the next start "
            "makes a new id, and resumes the folder's checkpoints with --adopt-checkpoint)"
        )
    return data["run"]


def _samples_in(dataset) -> int:
    """len(dataset), or a one-line error where the data factory returned no dataset."""
    try:
        return len(dataset)
    except TypeError:
        raise ShardplanError(
            f"the data is a {type(dataset).__name__}, which has no len(): make the data factory "
            "return a dataset (len(dataset) and dataset[i])"
        ) from None


def _make_directory(directory: Path) -> None:
    """Make the run's directory, or say why it cannot be (before the rendezvous, not at the first log line)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        cause = (
            "it is a file" if isinstance(error, FileExistsError) else error.strerror or str(error)
        )
        raise ShardplanError(
            f"cannot keep the run in {directory}: {cause}; give a folder this process may "
            "write (made if missing)"
        ) from None


def _join(timeout_s: float) -> bool:
    """Join the process group torchrun's rendezvous set up; whether this call created it."""
    if dist.is_initialized():
        return False
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ShardplanError(
            "no process group and no torchrun environment (RANK, MASTER_ADDR): launch with "
            "torchrun --nnodes=MIN:MAX ... (README, 'Elastic training'), or call "
            "torch.distributed.init_process_group first"
        )
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return True


def _startup(started_at: float) -> dict[str, float]:
    """{"startup_s": seconds from this process's start to `started_at`} (Python, imports, the CLI), read from
    /proc/self/stat on Linux; {} elsewhere."""
    try:
        start_ticks = int(
            Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]
        )  # field 22, starttime
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
        if not os.path.lexists(file):
            return None
        try:
            progress = parse_json(
                read_text(file, "progress file", regular_only=True), f"progress file {file}"
            )
        except ShardplanError as error:
            self.note(f"{error}; the log counts no steps lost")
            return None
        if not (
            isinstance(progress, dict)
            and type(progress.get("step")) is int  # as stepped() writes them
            and type(progress.get("global_batch", 0)) is int
            and type(progress.get("time")) is float
        ):
            self.note(
                f"progress file {file} holds no step, time and global batch: it was damaged; the log counts "
                "no steps lost"
            )
            return None
        return progress

    def note(self, text: str) -> None:
        self._emit(text, {"event": "note", "text": text})

    def started(
        self,
        plan: Plan,
        resumed: _Resumed | None,
        world_size: int,
        global_batch: int,
        replica_batch: int,
        timings: dict[str, float],
        started_at: float,
    ) -> None:
        if self.log is None:
            return
        predicted_ms = plan.predicted.step_time_s * 1e3
        fields: dict[str, Any] = {
            "event": "start",
            "started_at": started_at,
            "world_size": world_size,
            "global_batch": global_batch,
            "replica_batch": replica_batch,
            "mesh": plan.mesh.describe(),
            "micro_batches": plan.schedule.num_micro_batches,
            "predicted_step_s": plan.predicted.step_time_s,
            **{name: round(value, 3) for name, value in timings.items()},
        }
        startup = f"start-up {timings['startup_s']:.1f} s, " if "startup_s" in timings else ""
        lines = [
            f"world of {world_size} ranks: planned {plan.mesh.describe()}, "
            f"{plan.schedule.num_micro_batches} micro-batch(es), predicted step {predicted_ms:.1f} ms "
            f"({startup}rendezvous {timings['rendezvous_s']:.1f} s, analysis {timings['analyze_s']:.1f} s, solve "
            f"{timings['solve_s']:.1f} s, parallelize "
            f"{timings['parallelize_s']:.1f} s, load {timings['load_s']:.1f} s)"
        ]
        if resumed is None:
            lines.append(f"no checkpoint in {self.directory}: training from step 0")
        else:
            lost = max(0, (self.last_progress or {}).get("step", resumed.step) - resumed.step)
            fields.update(
                resumed_step=resumed.step, old_world_size=resumed.world_size, steps_lost=lost
            )
            old_plan, changes = "its plan unreadable", []
            if resumed.plan is not None:
                fields.update(
                    old_mesh=resumed.plan.mesh.describe(),
                    old_predicted_step_s=resumed.plan.predicted.step_time_s,
                )
                old_plan = (
                    f"{resumed.plan.mesh.describe()}, predicted step "
                    f"{resumed.plan.predicted.step_time_s * 1e3:.1f} ms"
                )
                changes = self._plan_changes(resumed.plan, plan)
            lines += [
                f"resumed step {resumed.step} (saved on {resumed.world_size} ranks, {old_plan}); "
                f"{lost} step(s) lost",
                *changes,
            ]
            old_global = (self.last_progress or {}).get("global_batch")
            if old_global is not None and old_global != global_batch:
                lines.append(
                    f"global batch scaled from {old_global} to {global_batch} samples a step "
                    f"({replica_batch} per rank x {world_size} ranks); the learning rate is as it was"
                )
        self._emit("\n".join(lines), fields)

    @staticmethod
    def _plan_changes(old: Plan, new: Plan) -> list[str]:
        from shardplan.plan_changes import plan_changes

        changes = plan_changes(old, new)
        return (
            ["plan changes (as shardplan diff):"] + [f"  {change}" for change in changes]
            if changes
            else ["plan unchanged"]
        )

    def stepped(
        self,
        step: int,
        loss: float,
        world_size: int,
        first_sample: int,
        global_batch: int,
        started: float,
    ) -> None:
        if self.log is None:
            return
        now = time.time()
        fields = {
            "event": "step",
            "step": step,
            "loss": loss,
            "world_size": world_size,
            "first_sample": first_sample,
            "global_batch": global_batch,
        }
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
        progress = {
            "step": step,
            "time": now,
            "world_size": world_size,
            "global_batch": global_batch,
        }
        write_text_atomically(
            self.directory / PROGRESS_FILE, json.dumps(progress), through_links=False
        )

    def failed(self, step: int, error: Exception) -> None:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        self._emit(
            f"step {step} failed: {cause}", {"event": "failed", "step": step, "error": cause}
        )

    def evaluated(self, step: int, loss: float, samples: int) -> None:
        self._emit(
            f"step {step}: held-out loss {loss:.4f} ({samples} samples)",
            {"event": "eval", "step": step, "loss": loss, "samples": samples},
        )

    def saved(self, step: int, seconds: float) -> None:
        self._emit(
            f"checkpoint at step {step} ({seconds:.1f} s)",
            {"event": "checkpoint", "step": step, "seconds": round(seconds, 3)},
        )

    def _emit(self, text: str, fields: dict[str, Any]) -> None:
        if self.log is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        append_line(
            self.directory / EVENTS_FILE,
            json.dumps({"time": time.time(), **fields}),
            "the run's events file",
        )
        self.log(text)
