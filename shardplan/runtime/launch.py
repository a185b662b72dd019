"""Spawn a world of ranks on this machine and run one job on every rank.

What the demo, the calibration and the benchmarks share: each rank sets up its
device and process group, runs the job, and leaves cleanly (see [Note:
shutdown] in collectives.py); rank 0's result comes back to the caller.
"""

import datetime
import os
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shardplan.common.forkserver import forkserver_context
from shardplan.errors import ShardplanError
from shardplan.runtime.collectives import shutdown
from shardplan.runtime.host_memory import keep_freed_host_memory

_TIMEOUT_S = 120
"""Process-group timeout of a spawned world: far above any one collective its jobs run (the largest
calibration buffer, 380 MB on gloo, takes ~0.6 s), so only a dead or stuck rank trips it."""


LOCAL_RANKS_PER_CORE = 4
"""The most ranks run_world spawns per core of this machine: past a few, ranks only wait on each other for
the cores (and each holds its own copy of torch, a few hundred MiB)."""


def check_local_world(world_size: int, flag: str = "--world-size") -> None:
    """Refuse a world that run_world would spawn as more processes than this machine can run; `flag` names
    the option that asked for it."""
    cores = len(os.sched_getaffinity(0))
    most = max(2, LOCAL_RANKS_PER_CORE * cores)
    if (
        not isinstance(world_size, int)
        or isinstance(world_size, bool)
        or not 1 <= world_size <= most
    ):
        raise ShardplanError(
            f"{flag} {world_size!r}: every rank runs as a process on this machine, which has "
            f"{cores} core(s), so give 1 to {most} ranks; plan larger worlds with "
            "`shardplan plan --world-size N`"
        )


def run_world(
    job,
    args: tuple = (),
    *,
    world_size: int,
    backend: str,
    total_steps: int,
    progress: bool = True,
    description: str = "",
):
    """Run `job(device, report, *args)` on `world_size` ranks, processes of their own; return rank 0's
    result.

    `job` must be a module-level function (it is pickled to each rank). Rank 0 calls `report(text)`
    after each of `total_steps` steps, which advances a progress bar here when `progress`.
    """
    if backend != "nccl":  # NCCL worlds are bounded by the GPUs, which their callers check
        check_local_world(world_size)
    # The rendezvous store listens here, on a port the OS picked as it bound it: a port probed free and
    # bound later by rank 0 could be taken in between by another world starting on this machine.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=_TIMEOUT_S),
    )
    # Ranks start as forks of a server that imported torch and shardplan once (common/forkserver.py).
    queue = forkserver_context().Queue()
    context = mp.start_processes(
        _rank_main,
        args=(world_size, store.port, backend, job, args, queue, dict(os.environ)),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    result = None
    with _progress_bar(progress, description, total_steps) as advance:
        done = False
        while not done:
            done = context.join(timeout=0.1)  # raises, after stopping the others, if a rank failed
            while not queue.empty():
                kind, payload = queue.get()
                if kind == "step":
                    advance(payload)
                else:
                    result = payload
    return result


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    job,
    args: tuple,
    queue,
    environment: dict[str, str],
) -> None:
    # A fork of the forkserver has the environment the server started with: the caller's is the one a
    # spawned rank would have had.
    os.environ.clear()
    os.environ.update(environment)
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(1)  # as ranks run on CPU: one core each
        keep_freed_host_memory()  # as parallelize does on CPU: the calibration times what the steps run
        device = torch.device("cpu")
    timeout = datetime.timedelta(seconds=_TIMEOUT_S)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    try:
        report = (lambda text: queue.put(("step", text))) if rank == 0 else (lambda text: None)
        result = job(device, report, *args)
        if rank == 0:
            queue.put(("result", result))
    finally:
        shutdown()  # see [Note: shutdown]


@contextmanager
def _progress_bar(show: bool, description: str, total_steps: int):
    """Yields advance(text): a rich progress bar on stderr, or nothing when not `show`."""
    if not show:
        yield lambda text: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[step]}"),
    )
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task(description, total=total_steps, step="")
        yield lambda text: bar.update(task, advance=1, step=text)
