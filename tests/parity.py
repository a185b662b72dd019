"""Training a program next to a one-process reference, and the spawned gloo worlds that do it."""

import torch
import torch.distributed as dist

from shardplan.runtime.launch import run_world

TOLERANCE = 1e-5
"""Largest difference from the one-process reference a parity case may show (a case may set its own):
absolute in the loss and the parameters, relative in the gradient norm (see train_next_to_reference)."""
ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}
"""eps above the gradient rounding noise: GPT's key bias has an exactly zero gradient, whose
rounding noise (~1e-10, different in every summation order) default eps=1e-8 would amplify to lr."""


def train_next_to_reference(
    program, reference: torch.nn.Module, batches, clip: float | None = None
) -> dict:
    """Train both with AdamW on `batches`, pairs of (this rank's batch, the whole batch), each step with
    clipping when `clip` is given, then evaluate the first batch again. Returns the largest differences:
    loss_error, absolute, in the losses; grad_norm_error, relative, in the clipped gradient norms (None
    without `clip`: no norm is taken); param_error, absolute, in the parameters at the end (None off
    rank 0, whose export is the one compared)."""
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    loss_error, norm_errors = 0.0, []
    for mine, whole in batches:
        loss = program.step(mine, labels=mine)
        reference_loss = _loss(reference(whole, labels=whole))
        reference_loss.backward()
        if clip:
            norm = program.clip_grad_norm_(clip)
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            norm_errors.append(abs(float(norm) - float(reference_norm)) / float(reference_norm))
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss_error = max(loss_error, abs(float(loss) - float(reference_loss)))
    mine, whole = batches[0]
    with torch.no_grad():
        expected = _loss(reference(whole, labels=whole))
    loss_error = max(loss_error, abs(float(program.evaluate(mine, labels=mine)) - float(expected)))
    errors = {
        "loss_error": loss_error,
        "grad_norm_error": max(norm_errors, default=None),
        "param_error": None,
    }
    state = program.export_full_state_dict()  # on rank 0, which reports the results
    if dist.get_rank() == 0:
        errors["param_error"] = max(
            (state[name] - parameter.detach()).abs().max().item()
            for name, parameter in reference.named_parameters()
        )  # a KeyError if one is missing
    return errors


def _loss(output):
    return output if isinstance(output, torch.Tensor) else output.loss


def assert_parity(results: dict, cases: dict) -> None:
    """Every case within its tolerance of the reference in each difference train_next_to_reference
    measured: the loss and the parameters (absolute), and the gradient norm (relative) where it clips."""
    failures = {}
    for name, case in cases.items():
        tolerance = case.get("tolerance", TOLERANCE)
        checked = ("loss_error", "param_error") + (("grad_norm_error",) if case.get("clip") else ())
        errors = {field: results[name][field] for field in checked}
        if not all(error is not None and error <= tolerance for error in errors.values()):
            failures[name] = {"tolerance": tolerance, **errors}
    assert not failures, failures


def written_once(rank: int, world: int, writers: dict) -> dict:
    """Each writer's result (a plan's JSON) by its key, in `writers`' order: each writer is called on one
    rank and its result shared with all, so the ranks write side by side what would be the same on every
    rank. A writer must pickle (a module-level function, or a functools.partial of one)."""
    mine = {key: write() for key, write in list(writers.items())[rank::world]}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine)
    written = {key: value for part in gathered for key, value in part.items()}
    return {key: written[key] for key in writers}


def spawn_world(world: int, job, args: tuple) -> dict:
    """Run `job(rank, world, *args)` (a module-level function) on `world` spawned gloo ranks; return
    rank 0's result."""
    return run_world(
        _rank_job, (job, args), world_size=world, backend="gloo", total_steps=0, progress=False
    )


def _rank_job(device, report, job, args: tuple):
    return job(dist.get_rank(), dist.get_world_size(), *args)
