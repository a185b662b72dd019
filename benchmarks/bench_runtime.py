"""shardplan runtime vs FSDP2: step time and peak memory per rank, same model, same units, one run.

    .venv/bin/python benchmarks/bench_runtime.py            # CPU, gloo, world 2
    .venv/bin/python benchmarks/bench_runtime.py --quick    # smaller model, fewer steps (CI smoke)

For each plan kind both backends train the same GPT with the same unit
boundaries and decisions. Time: a training step (program.step, optimizer.step,
zero_grad), the slowest rank, median over rounds that alternate the backends
so machine noise hits both alike. Memory: the peak of live tensor bytes on
rank 0 over one step, by torch.distributed._tools.mem_tracker.MemTracker
(shardplan.runtime.measure: parameters, gradients, optimizer states,
activations and temporaries; it sees every tensor torch allocates, which
allocator statistics on CPU do not).
"""

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardplan.models import zoo  # noqa: E402
from shardplan.plan import Checkpoint, ShardStrategy  # noqa: E402
from shardplan.runtime import parallelize  # noqa: E402
from shardplan.runtime.launch import run_world  # noqa: E402
from shardplan.runtime.manual import manual_plan  # noqa: E402
from shardplan.runtime.measure import peak_step_bytes, step_time_s  # noqa: E402

BACKENDS = ("shardplan", "fsdp2")
KINDS = (
    (ShardStrategy.FULL_SHARD, Checkpoint.NONE),
    (ShardStrategy.SHARD_GRAD_OP, Checkpoint.NONE),
    (ShardStrategy.FULL_SHARD, Checkpoint.FULL),
    (ShardStrategy.FULL_SHARD, Checkpoint.SELECTIVE),
)


def _setup(options, rank: int, world: int, backend: str, strategy, checkpoint):
    config = zoo.GPTConfig(
        vocab_size=options.vocab,
        seq_len=options.seq,
        n_layer=options.layers,
        n_head=8,
        d_model=options.d_model,
    )
    torch.manual_seed(0)
    entry = zoo.gpt(config, batch=options.batch * world)
    plan = manual_plan(
        entry.model,
        zoo.gpt_units(options.layers),
        dp=world,
        strategies=(strategy,),
        checkpoints=(checkpoint,),
    )
    program = parallelize(entry.model, plan, backend=backend)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-4)
    ids = entry.args[0].chunk(world)[rank]
    return entry.model, program, optimizer, ids


def _train_step(program, optimizer, ids) -> None:
    program.step(ids, labels=ids)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _measure_rank(device, report, options) -> list[tuple]:
    """Rank job (see run_world): per plan kind, (strategy, checkpoint, median step seconds by backend,
    peak step bytes by backend)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for strategy, checkpoint in KINDS:
        runs = {
            backend: _setup(options, rank, world, backend, strategy, checkpoint)
            for backend in BACKENDS
        }
        times = {backend: [] for backend in BACKENDS}
        for _, program, optimizer, ids in runs.values():
            for _ in range(options.warmup):
                _train_step(program, optimizer, ids)
        for _ in range(options.rounds):
            for backend, (_, program, optimizer, ids) in runs.items():
                times[backend].append(
                    step_time_s(lambda: _train_step(program, optimizer, ids), options.steps)
                )
        peaks = {
            backend: peak_step_bytes(
                lambda: _train_step(program, optimizer, ids),
                model,
                optimizer,
                *program.parameters(),
            )
            for backend, (model, program, optimizer, ids) in runs.items()
        }
        rows.append(
            (
                strategy.value,
                checkpoint.value,
                {b: statistics.median(t) for b, t in times.items()},
                peaks,
            )
        )
        report(f"{strategy.value}/{checkpoint.value}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="per round")
    parser.add_argument("--quick", action="store_true")
    options = parser.parse_args()
    if options.quick:
        options.layers, options.d_model, options.seq, options.rounds, options.steps = (
            2,
            64,
            32,
            2,
            2,
        )
    rows = run_world(
        _measure_rank,
        (options,),
        world_size=options.world,
        backend="gloo",
        total_steps=len(KINDS),
        description="plan kinds",
    )
    print(
        f"GPT {options.layers} layers, d_model {options.d_model}, seq {options.seq}, vocab {options.vocab}, "
        f"batch {options.batch}/rank; CPU gloo, world {options.world}, 1 thread/rank; "
        f"median of {options.rounds} rounds x {options.steps} steps"
    )
    print(
        f"{'strategy':<14} {'checkpoint':<10} {'shardplan ms':>12} {'fsdp2 ms':>9} {'time ratio':>10} "
        f"{'shardplan MiB':>13} {'fsdp2 MiB':>9} {'memory ratio':>12}"
    )
    for strategy, checkpoint, times, peaks in rows:
        print(
            f"{strategy:<14} {checkpoint:<10} {times['shardplan'] * 1e3:>12.1f} {times['fsdp2'] * 1e3:>9.1f} "
            f"{times['shardplan'] / times['fsdp2']:>10.3f} {peaks['shardplan'] / 2**20:>13.2f} "
            f"{peaks['fsdp2'] / 2**20:>9.2f} {peaks['shardplan'] / peaks['fsdp2']:>12.3f}"
        )


if __name__ == "__main__":
    main()
