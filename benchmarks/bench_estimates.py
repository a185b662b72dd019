"""Predicted vs measured, on this machine: block compute times, and every plan kind's memory and step time.

    .venv/bin/python benchmarks/bench_estimates.py                      # calibrates in the same rounds
    .venv/bin/python benchmarks/bench_estimates.py --profile profile.json

Blocks: the demo GPT's blocks, forward+backward timed by hooks at block boundaries
in one process (one thread, as a rank runs), against the cost model's compute terms,
at the demo's batch and at one sequence (a pipeline's micro-batch).
Plans: the demo GPT trained on 2 CPU ranks (gloo) under hand-written plans of
every strategy x checkpoint kind; peak memory is MemTracker's (every tensor on
the rank), time a whole training step (forward, backward, optimizer step,
zero_grad) on rank 0; prediction is compile.evaluate. By default every plan's step
is timed in the same interleaved rounds of one spawned world as the calibration's
probes ([Note: the fastest of interleaved rounds] in shardplan/calibration/calibrate.py), the
fastest round kept on both sides, so that on a machine shared with other work the
ratio measures the model, not the neighbours' load (as bench_collectives.py does).
"""

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from shardplan import ShardStrategy, get_hardware
from shardplan.calibration.accuracy import (
    accuracy_table,
    compare,
    demo_chain_and_plans,
    measure_plans,
)
from shardplan.calibration.calibrate import CPU_SWEEP, fit_profile, summary
from shardplan.costmodel.cost import CostContext, Decision, unit_cost
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.models.zoo import DEMO_BATCH, DEMO_GPT


def measure_block_times(entry: zoo.ZooModel, names: list[str], rounds: int) -> dict[str, float]:
    """Fastest seconds of each named block's forward + backward over `rounds` steps, blocks in chain order.

    The fastest, as the calibration's figures are (see [Note: the fastest of interleaved rounds] in
    calibrate.py): on a machine other processes load, the median measures their load.

    Timed as spans between block boundaries, as the analysis attributes every op to a block: a
    block's forward runs from its forward pre-hook to the next block's (the last one to the loss);
    its backward ends when its input gradient and its parameters' gradients are all done (an
    embedding's own backward runs after its module's backward hook: its input needs no gradient)
    and starts when the block finishing before it ended. So ops of the model's root (the add of
    token and position embeddings, the loss) count in a neighbouring block, as in the analysis.
    """
    modules = dict(entry.model.named_modules())
    forward_starts: dict[str, float] = {}
    backward_ends: dict[str, float] = {}

    def mark_backward(name):
        return lambda *args: backward_ends.__setitem__(name, time.perf_counter())

    def mark_forward(name):
        def hook(module, inputs):
            forward_starts[name] = time.perf_counter()
            for tensor in inputs:  # its gradient is complete when the block's backward is done
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(mark_backward(name))

        return hook

    # Tensor and parameter hooks, not module backward hooks: those add autograd nodes of their own,
    # whose Python cost (~0.1 ms) would double a sub-millisecond block's time.
    for name in names:
        modules[name].register_forward_pre_hook(mark_forward(name))
        for param in modules[name].parameters():
            param.register_post_accumulate_grad_hook(mark_backward(name))
    spent: dict[str, list[float]] = {name: [] for name in names}
    for step in range(rounds + 1):
        forward_starts.clear()
        backward_ends.clear()
        loss = entry.model(*entry.args, **entry.kwargs)
        forward_end = backward_start = time.perf_counter()
        loss.backward()
        if step:  # the first step warms caches and allocators
            starts = [forward_starts[name] for name in names] + [forward_end]
            previous_end = dict(
                zip(
                    sorted(names, key=backward_ends.get),
                    [backward_start] + sorted(backward_ends.values()),
                )
            )
            for index, name in enumerate(names):
                spent[name].append(
                    starts[index + 1] - starts[index] + backward_ends[name] - previous_end[name]
                )
        entry.model.zero_grad(set_to_none=True)
    return {name: min(times) for name, times in spent.items()}


def block_table(hardware, rounds: int, batch: int) -> Table:
    torch.manual_seed(0)
    entry = zoo.gpt(DEMO_GPT, batch=batch)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    measured = measure_block_times(entry, [b.name for b in chain.blocks], rounds)
    ctx = CostContext(hardware=hardware, dp=1)
    table = Table(
        title=f"block forward+backward time, {batch} sequence(s), one process, one thread ({hardware.name})"
    )
    for column in ("block", "predicted ms", "measured ms", "predicted / measured"):
        table.add_column(column, justify="right")
    for block in chain.blocks:
        cost = unit_cost((block,), Decision(strategy=ShardStrategy.REPLICATE), ctx)
        predicted = cost.compute_fwd_s + cost.compute_bwd_s
        table.add_row(
            block.name,
            f"{predicted * 1e3:.2f}",
            f"{measured[block.name] * 1e3:.2f}",
            f"{predicted / measured[block.name]:.2f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        help="a profile JSON written by `shardplan calibrate`; default: calibrate "
        "in the same rounds as the training steps",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=CPU_SWEEP.rounds,
        help="timed rounds of every probe and training step, and timed steps of the block table; "
        "the fastest is kept",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    chain, plans = demo_chain_and_plans(options.world_size)
    sweep = None if options.profile else CPU_SWEEP
    measurements, measured = measure_plans(plans, options.world_size, options.rounds, sweep)
    hardware = get_hardware(options.profile) if options.profile else fit_profile(measurements)
    how = "saved profile" if options.profile else "calibrated in the same rounds"
    console = Console()
    console.print(summary(hardware))
    for batch in (DEMO_BATCH, 1):
        console.print(block_table(hardware, options.rounds, batch))
    console.print(
        accuracy_table(
            compare(chain, plans, measured, hardware),
            f"every plan kind: demo GPT on {options.world_size} CPU ranks (gloo), {how}",
        )
    )


if __name__ == "__main__":
    main()
