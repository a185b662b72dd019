"""Predicted vs measured on Hugging Face architectures: every plan kind's peak memory and step time.

    .venv/bin/python benchmarks/bench_hf_memory.py                     # every architecture
    .venv/bin/python benchmarks/bench_hf_memory.py --models hf-llama hf-t5

Each of shardplan.accuracy.HF_WORKLOADS (Llama, Mixtral, GPT-2, BERT, T5 from tiny configs, random
weights) under a hand-written plan of every strategy x checkpoint kind, one unit per block of the
analysed chain, trained with AdamW on 2 CPU ranks (gloo), gradients kept between steps; peak memory
is MemTracker's over a step after a warm-up step (the largest over the ranks), time a whole training
step of rank 0, the fastest of interleaved rounds, a kind outside the time band measured once more;
prediction is compile.evaluate on the built-in cpu-gloo profile (shardplan.accuracy).
"""
import argparse
import os

import torch
from rich.console import Console

from shardplan import get_hardware
from shardplan.accuracy import HF_WORKLOADS, accuracy_table, measure_accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(HF_WORKLOADS), choices=list(HF_WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of every plan's step; the fastest is kept")
    options = parser.parse_args()
    torch.set_num_threads(1)
    console = Console(width=120)
    ratios = []
    for name in options.models:
        rows = measure_accuracy(get_hardware("cpu-gloo"), rounds=options.rounds, workload=HF_WORKLOADS[name])
        console.print(accuracy_table(rows, f"{name}: predicted (cpu-gloo) vs measured, 2 gloo ranks"))
        ratios += [(row.memory_ratio, row.time_ratio) for row in rows]
    memory, time = zip(*ratios)
    console.print(f"memory predicted/measured {min(memory):.2f}-{max(memory):.2f}, "
                  f"step time {min(time):.2f}-{max(time):.2f}; load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
