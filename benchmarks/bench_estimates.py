"""Predicted vs measured, on this machine: block compute times, and every plan kind's memory and step time.

    .venv/bin/python benchmarks/bench_estimates.py                      # calibrates first (a few minutes)
    .venv/bin/python benchmarks/bench_estimates.py --profile profile.json

Blocks: the demo GPT's blocks, forward+backward timed by hooks at block boundaries
in one process (one thread, as a rank runs), against the cost model's compute terms.
Plans: the demo GPT trained on 2 CPU ranks (gloo) under hand-written plans of
every strategy x checkpoint kind; peak memory is MemTracker's (every tensor on
the rank), time the slowest rank's step; prediction is compile.evaluate.
"""
import argparse
import warnings
import time

import torch
from rich.console import Console
from rich.table import Table

from shardplan import Checkpoint, ShardStrategy, get_hardware, zoo
from shardplan.calibrate import calibrate
from shardplan.compile import evaluate
from shardplan.cost import CostContext, Decision, unit_cost
from shardplan.demo import DEMO_BATCH, DEMO_GPT, train_with_plan
from shardplan.passes import analyze
from shardplan.runtime.manual import manual_plan
from shardplan.sizes import format_bytes

KINDS = [(strategy, checkpoint) for strategy in ShardStrategy for checkpoint in Checkpoint]
GROUPS = [("wte", "wpe")] + [(f"h.{i}",) for i in range(DEMO_GPT.n_layer)] + [("ln_f", "lm_head")]


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

    def mark_forward(name):
        return lambda *args: forward_starts.__setitem__(name, time.perf_counter())

    def mark_backward(name):
        return lambda *args: backward_ends.__setitem__(name, time.perf_counter())

    for name in names:
        modules[name].register_forward_pre_hook(mark_forward(name))
        modules[name].register_full_backward_hook(mark_backward(name))
        for param in modules[name].parameters():
            param.register_post_accumulate_grad_hook(mark_backward(name))
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the embedding has no input grad
    spent: dict[str, list[float]] = {name: [] for name in names}
    for step in range(rounds + 1):
        forward_starts.clear()
        backward_ends.clear()
        loss = entry.model(*entry.args, **entry.kwargs)
        forward_end = backward_start = time.perf_counter()
        loss.backward()
        if step:  # the first step warms caches and allocators
            starts = [forward_starts[name] for name in names] + [forward_end]
            previous_end = dict(zip(sorted(names, key=backward_ends.get),
                                    [backward_start] + sorted(backward_ends.values())))
            for index, name in enumerate(names):
                spent[name].append(starts[index + 1] - starts[index] + backward_ends[name] - previous_end[name])
        entry.model.zero_grad(set_to_none=True)
    return {name: min(times) for name, times in spent.items()}


def block_table(hardware, rounds: int) -> Table:
    torch.manual_seed(0)
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    measured = measure_block_times(entry, [b.name for b in chain.blocks], rounds)
    ctx = CostContext(hardware=hardware, dp=1)
    table = Table(title=f"block forward+backward time, one process, one thread ({hardware.name})")
    for column in ("block", "predicted ms", "measured ms", "predicted / measured"):
        table.add_column(column, justify="right")
    for block in chain.blocks:
        cost = unit_cost((block,), Decision(strategy=ShardStrategy.REPLICATE), ctx)
        predicted = cost.compute_fwd_s + cost.compute_bwd_s
        table.add_row(block.name, f"{predicted * 1e3:.2f}", f"{measured[block.name] * 1e3:.2f}",
                      f"{predicted / measured[block.name]:.2f}")
    return table


def plan_table(hardware, world_size: int, steps: int) -> Table:
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    table = Table(title=f"every plan kind: demo GPT on {world_size} CPU ranks (gloo), {steps} steps")
    for column in ("strategy", "checkpoint", "memory pred", "memory meas", "ratio", "step pred ms", "step meas ms",
                   "ratio"):
        table.add_column(column, justify="right")
    for strategy, checkpoint in KINDS:
        plan = manual_plan(entry.model, GROUPS, dp=world_size, strategies=(strategy,), checkpoints=(checkpoint,))
        predicted = evaluate(chain, plan, hardware)
        measured = train_with_plan(plan, world_size, steps, progress=False)
        table.add_row(strategy.value, checkpoint.value, format_bytes(predicted.peak_bytes),
                      format_bytes(measured.peak_bytes), f"{predicted.peak_bytes / measured.peak_bytes:.2f}",
                      f"{predicted.step_time_s * 1e3:.0f}", f"{measured.step_time_s * 1e3:.0f}",
                      f"{predicted.step_time_s / measured.step_time_s:.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a calibrated profile JSON (default: calibrate now)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="timed steps for the block table (the fastest is kept)")
    options = parser.parse_args()
    torch.set_num_threads(1)
    hardware = get_hardware(options.profile) if options.profile else calibrate(world_size=options.world_size)
    console = Console()
    console.print(block_table(hardware, options.rounds))
    console.print(plan_table(hardware, options.world_size, options.steps))


if __name__ == "__main__":
    main()
