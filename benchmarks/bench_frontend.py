"""Front-end benchmark: analysis accuracy on the zoo, capture + analysis time by depth, and compile
of LLaMA-7B / 70B shapes with and without block reuse.

    .venv/bin/python benchmarks/bench_frontend.py [--depths 8 16 32 80] [--skip-accuracy] [--skip-compile]

Accuracy: forward+backward FLOPs against FlopCounterMode over an eager step
(with the formulas torch lacks for CPU attention kernels, execution.flop_counter),
parameter bytes against the model, activation bytes at the end of forward
against MemTracker on a real CPU forward. Speed: LLaMA-7B shapes (seq 4096) on
the meta device, each repeated layer analyzed (full) or one per class with its facts stamped on the
others (reuse); time per layer shows whether growth is linear. Compile: capture + analysis +
solve, per world, with and without reuse side by side (the chains are checked equal), a re-plan
from the cached chain, and parallelize's check that a plan is for the model: by the model's signature (the
default) and by the graph (verify_graph=True: a capture, the fingerprint of which is compared).
"""

import argparse
import dataclasses
import time

import torch
from rich.console import Console
from rich.table import Table

from shardplan.compile import solve
from shardplan.errors import InfeasibleError
from shardplan.frontend.passes import analyze, fingerprint_of
from shardplan.frontend.passes.execution import flop_counter
from shardplan.frontend.signature import model_signature
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED
from shardplan.runtime.measure import forward_activation_bytes

WORLDS = ((8, True), (64, False), (1024, False))
"""(world, offload allowed): the targets, each compile within 10 s, a re-plan within 1 s."""
TIMINGS = ("capture_s", "analyze_s", "reused_blocks")

SMALL = [
    "gpt",
    "mlp",
    "cnn",
    "encoder-decoder",
    "hf-gpt2",
    "hf-llama",
    "hf-bert",
    "hf-t5",
    "hf-mixtral",
]


def measured(entry: zoo.ZooModel) -> tuple[int, int]:
    """(FLOPs of an eager forward+backward, activation bytes live after a real forward)."""
    activations = forward_activation_bytes(entry.model, entry.args, entry.kwargs)
    with flop_counter() as counter:
        output = entry.model(*entry.args, **entry.kwargs)
        (output if isinstance(output, torch.Tensor) else output.loss).backward()
    return counter.get_total_flops(), activations


def accuracy_table() -> Table:
    table = Table(title="analysis vs measurement (small configs, CPU)")
    for column in (
        "model",
        "blocks",
        "FLOPs pred/meas",
        "param bytes pred/meas",
        "activations pred/meas",
    ):
        table.add_column(column, justify="right")
    for name in SMALL:
        torch.manual_seed(0)
        entry = zoo.build(name)
        chain = analyze(entry.model, entry.args, entry.kwargs)
        flops, activations = measured(entry)
        param_bytes = sum(p.numel() * p.element_size() for p in entry.model.parameters())
        predicted_activations = chain.saved_bytes + chain.returned_bytes
        table.add_row(
            name,
            str(len(chain.blocks)),
            f"{(chain.fwd_flops + chain.bwd_flops) / flops:.4f}",
            f"{chain.param_bytes / param_bytes:.4f}",
            f"{predicted_activations / activations:.4f}",
        )
    return table


def timed(run):
    """(run()'s result, wall seconds, CPU seconds of this process). One thread computes, so on a quiet
    machine the two agree; on a shared one the CPU seconds are what the work costs."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = run()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def seconds(wall_s: float, cpu_s: float) -> str:
    return f"{wall_s:.1f} / {cpu_s:.1f}"


def speed_table(depths: list[int]) -> Table:
    table = Table(
        title="capture + analysis of LLaMA-7B shapes (seq 4096, meta device); seconds wall / CPU"
    )
    for column in (
        "layers",
        "graph nodes",
        "full: capture",
        "full: analyze",
        "CPU s per layer",
        "reuse: capture",
        "reuse: analyze",
        "CPU s per layer",
    ):
        table.add_column(column, justify="right")
    for depth in depths:
        entry = zoo.llama_7b(n_layer=depth)
        row = [str(depth)]
        for reuse in (False, True):
            chain, wall_s, cpu_s = timed(
                lambda: analyze(entry.model, entry.args, entry.kwargs, reuse_blocks=reuse)
            )
            if not reuse:
                row.append(str(chain.extra["nodes"]))
            row += [
                f"{chain.extra['capture_s']:.1f}",
                seconds(wall_s, cpu_s),
                f"{cpu_s / depth:.3f}",
            ]
        table.add_row(*row)
    return table


def compile_table() -> Table:
    table = Table(
        title="compile = capture + analysis + solve, h100-80g, bf16 params, 1 sequence of 4096, meta "
        "device; seconds wall / CPU"
    )
    for column in (
        "model",
        "blocks",
        "reuse",
        "analyze",
        *(f"compile, world {w}{' (offload)' if o else ''}" for w, o in WORLDS),
        "re-plan (solve) CPU s",
        "re-plan, explain=False",
        "start-up check: signature ms CPU; graph",
    ):
        table.add_column(column, justify="right")
    for name, build in (("LLaMA-7B", zoo.llama_7b), ("LLaMA-70B", zoo.llama_70b)):
        entry = build()
        chains = []
        for reuse in (False, True):
            chain, analyze_wall_s, analyze_cpu_s = timed(
                lambda: analyze(entry.model, entry.args, entry.kwargs, reuse_blocks=reuse)
            )
            chains.append(
                dataclasses.replace(
                    chain, extra={k: v for k, v in chain.extra.items() if k not in TIMINGS}
                )
            )
            cells, solve_cpu_s, bare_cpu_s = [], [], []
            for world, offload in WORLDS:
                _, wall_s, cpu_s = timed(lambda: plan_or_none(chain, world, offload))
                solve_cpu_s.append(cpu_s)
                cells.append(seconds(analyze_wall_s + wall_s, analyze_cpu_s + cpu_s))
                bare_cpu_s.append(
                    timed(lambda: plan_or_none(chain, world, offload, explain=False))[2]
                )
            _, _, signature_cpu_s = timed(lambda: model_signature(entry.model))
            _, fingerprint_wall_s, fingerprint_cpu_s = timed(
                lambda: fingerprint_of(entry.model, chain.inputs, reuse_blocks=reuse)
            )
            table.add_row(
                name,
                str(len(chain.blocks)),
                f"{chain.extra['reused_blocks']} copies" if reuse else "no",
                seconds(analyze_wall_s, analyze_cpu_s),
                *cells,
                f"{min(solve_cpu_s):.2f}-{max(solve_cpu_s):.2f}",
                f"{min(bare_cpu_s):.2f}-{max(bare_cpu_s):.2f}",
                f"{signature_cpu_s * 1e3:.0f}; {seconds(fingerprint_wall_s, fingerprint_cpu_s)}",
            )
        assert chains[0] == chains[1], (
            f"{name}: the chain with block reuse differs from the full analysis"
        )
    return table


def plan_or_none(chain, world: int, offload: bool, explain: bool = True):
    try:
        return solve(
            chain,
            world,
            hardware="h100-80g",
            mixed_precision=BF16_MIXED,
            allow_offload=offload,
            explain=explain,
        )
    except InfeasibleError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80])
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-compile", action="store_true")
    options = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=220)  # the compile table's ten columns
    if not options.skip_accuracy:
        console.print(accuracy_table())
    console.print(speed_table(options.depths))
    if not options.skip_compile:
        console.print(compile_table())


if __name__ == "__main__":
    main()
