"""Training a program next to a one-process reference, and the spawned gloo worlds that do it."""
import datetime
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardplan.runtime import shutdown
from shardplan.runtime.launch import free_port

ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.1}
"""eps above the gradient rounding noise: GPT's key bias has an exactly zero gradient, whose
rounding noise (~1e-10, different in every summation order) default eps=1e-8 would amplify to lr."""


def train_next_to_reference(program, reference: torch.nn.Module, batches, clip: float | None = None) -> dict:
    """Train both with AdamW on `batches`, pairs of (this rank's batch, the whole batch), each step with
    clipping when `clip` is given, then evaluate the first batch again; the largest loss (and relative
    norm) difference, and the largest parameter difference at the end (rank 0 compares; 0 elsewhere)."""
    optimizer = torch.optim.AdamW(program.parameters(), **ADAMW)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
    loss_error = 0.0
    for mine, whole in batches:
        loss = program.step(mine, labels=mine)
        reference_loss = _loss(reference(whole, labels=whole))
        reference_loss.backward()
        if clip:
            norm = program.clip_grad_norm_(clip)
            reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            loss_error = max(loss_error, abs(float(norm) - float(reference_norm)) / float(reference_norm))
        optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss_error = max(loss_error, abs(float(loss) - float(reference_loss)))
    mine, whole = batches[0]
    with torch.no_grad():
        expected = _loss(reference(whole, labels=whole))
    loss_error = max(loss_error, abs(float(program.evaluate(mine, labels=mine)) - float(expected)))
    state = program.export_full_state_dict()  # on rank 0, which reports the results
    param_error = max((state[name] - parameter.detach()).abs().max().item()
                      for name, parameter in reference.named_parameters()) if state else 0.0
    return {"loss_error": loss_error, "param_error": param_error}


def _loss(output):
    return output if isinstance(output, torch.Tensor) else output.loss


def spawn_world(world: int, job, args: tuple, tmp_path) -> dict:
    """Run `job(rank, world, *args)` (a module-level function) on `world` spawned gloo ranks; return
    rank 0's result, which must be JSON."""
    path = os.fspath(tmp_path / f"world{world}.json")
    mp.spawn(_rank, args=(world, free_port(), job, args, path), nprocs=world, join=True)
    with open(path) as handle:
        return json.load(handle)


def _rank(rank: int, world: int, port: int, job, args: tuple, path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = job(rank, world, *args)
        if rank == 0:
            with open(path, "w") as handle:
                json.dump(results, handle)
    finally:
        shutdown()  # see [Note: shutdown] in shardplan/runtime/collectives.py
