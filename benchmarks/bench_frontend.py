"""Front-end benchmark: analysis accuracy on the zoo, and capture + analysis time by depth.

    .venv/bin/python benchmarks/bench_frontend.py [--depths 8 16 32 80]

Accuracy: forward+backward FLOPs against FlopCounterMode over an eager step
(with the formulas torch lacks for CPU attention kernels, execution.flop_counter),
parameter bytes against the model, activation bytes at the end of forward
against MemTracker on a real CPU forward. Speed: LLaMA-7B shapes (seq 4096) on
the meta device; time per layer shows whether growth is linear.
"""
import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

from shardplan import zoo
from shardplan.passes import analyze
from shardplan.passes.execution import flop_counter
from shardplan.runtime.measure import forward_activation_bytes

SMALL = ["gpt", "mlp", "cnn", "encoder-decoder", "hf-gpt2", "hf-llama", "hf-bert", "hf-t5", "hf-mixtral"]


def measured(entry: zoo.ZooModel) -> tuple[int, int]:
    """(FLOPs of an eager forward+backward, activation bytes live after a real forward)."""
    activations = forward_activation_bytes(entry.model, entry.args, entry.kwargs)
    with flop_counter() as counter:
        output = entry.model(*entry.args, **entry.kwargs)
        (output if isinstance(output, torch.Tensor) else output.loss).backward()
    return counter.get_total_flops(), activations


def accuracy_table() -> Table:
    table = Table(title="analysis vs measurement (small configs, CPU)")
    for column in ("model", "blocks", "FLOPs pred/meas", "param bytes pred/meas", "activations pred/meas"):
        table.add_column(column, justify="right")
    for name in SMALL:
        torch.manual_seed(0)
        entry = zoo.build(name)
        chain = analyze(entry.model, entry.args, entry.kwargs)
        flops, activations = measured(entry)
        param_bytes = sum(p.numel() * p.element_size() for p in entry.model.parameters())
        predicted_activations = chain.saved_bytes + chain.returned_bytes
        table.add_row(name, str(len(chain.blocks)), f"{(chain.fwd_flops + chain.bwd_flops) / flops:.4f}",
                      f"{chain.param_bytes / param_bytes:.4f}", f"{predicted_activations / activations:.4f}")
    return table


def speed_table(depths: list[int]) -> Table:
    table = Table(title="capture + analysis of LLaMA-7B shapes (seq 4096, meta device)")
    for column in ("layers", "graph nodes", "capture s", "analyze s (total)", "s per layer"):
        table.add_column(column, justify="right")
    for depth in depths:
        entry = zoo.llama_7b(n_layer=depth)
        start = time.perf_counter()
        chain = analyze(entry.model, entry.args, entry.kwargs)
        seconds = time.perf_counter() - start
        table.add_row(str(depth), str(chain.extra["nodes"]), f"{chain.extra['capture_s']:.1f}",
                      f"{seconds:.1f}", f"{seconds / depth:.3f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80])
    options = parser.parse_args()
    torch.set_num_threads(1)
    console = Console()
    console.print(accuracy_table())
    console.print(speed_table(options.depths))


if __name__ == "__main__":
    main()
