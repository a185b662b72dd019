"""Predicted vs measured, on this machine: every mesh kind's peak memory and step time.

    .venv/bin/python benchmarks/bench_mesh.py                      # calibrates in the same rounds
    .venv/bin/python benchmarks/bench_mesh.py --profile profile.json
    .venv/bin/python benchmarks/bench_mesh.py --memory-only --gpt 1024 512 2 64 4 --kinds "tp2 sp vocab"
    .venv/bin/python benchmarks/bench_mesh.py --memory-only --gpt 1024 512 2 64 4 --kinds --dp-kinds

The demo GPT under every kind of shardplan.calibration.accuracy.MESH_KINDS (tp 2 without and with vocabulary and
sequence parallelism, dp 2 x tp 2, HSDP 2 x 2; every unit FULL_SHARD), trained on CPU ranks (gloo),
one spawned world per world size, each rank's batch its replica's; peak memory is MemTracker's (every
tensor on the rank, the largest over the ranks), time a whole training step of rank 0, the fastest
of interleaved rounds; prediction is compile.evaluate, on a calibration made in the same rounds as
the world of 2 (or --profile) and on the built-in cpu-gloo profile. A world of more ranks than the
machine's cores is priced on shardplan.calibration.accuracy.shared_cores ([Note: more ranks than cores]).
--memory-only measures each kind's peak memory in one step (no calibration, no timing: memory does not
depend on the machine's load) against the built-in profile's prediction; --gpt sets the GPT's shape
(8 heads), where a wider hidden size or a longer sequence makes a layer's transients a larger share of
the peak than the demo's; --dp-kinds adds every plain plan kind over 2 ranks (shardplan.calibration.accuracy.KINDS:
each strategy with each checkpointing), and --kinds with no kind leaves the mesh kinds out.
"""

import argparse
import os

import torch
from rich.console import Console

from shardplan import get_hardware
from shardplan.calibration.accuracy import (
    DEMO_WORKLOAD,
    KIND_NAMES,
    MESH_KINDS,
    Workload,
    accuracy_table,
    compare,
    demo_chain_and_plans,
    demo_mesh_plans,
    machine_cores,
    measure_by_world,
)
from shardplan.calibration.calibrate import CPU_SWEEP, fit_profile, summary
from shardplan.common.sizes import format_bytes
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, MixedPrecision


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile",
        help="a profile JSON written by `shardplan calibrate`; default: calibrate "
        "in the same rounds as the training steps of the world of 2",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=CPU_SWEEP.rounds,
        help="timed rounds of every probe and training step; the fastest is kept",
    )
    parser.add_argument(
        "--gpt",
        type=int,
        nargs=5,
        metavar=("D_MODEL", "SEQ", "LAYERS", "VOCAB", "BATCH"),
        help="the GPT at this shape (8 heads, BATCH sequences a replica); default: the demo's",
    )
    parser.add_argument(
        "--kinds", nargs="*", choices=list(MESH_KINDS), help="only these mesh kinds (none: none)"
    )
    parser.add_argument(
        "--dp-kinds",
        action="store_true",
        help="with --memory-only, also every plain plan kind (strategy x checkpointing) over 2 ranks",
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="peak memory only, measured in one step, against the built-in cpu-gloo profile",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="train in bf16 mixed precision (fp32 master weights, gradients reduced in fp32)",
    )
    options = parser.parse_args()
    torch.set_num_threads(1)
    workload = DEMO_WORKLOAD
    if options.gpt:
        d_model, seq, layers, vocab, batch = options.gpt
        config = zoo.GPTConfig(
            vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=8, d_model=d_model
        )
        workload = Workload(name="gpt", options=(("config", config), ("batch", batch)))
    precision = BF16_MIXED if options.bf16 else MixedPrecision()
    chain, named = (
        demo_mesh_plans(workload, options.kinds, precision) if options.kinds != [] else (None, {})
    )
    console = Console(width=120)
    if options.memory_only:
        if options.dp_kinds:
            chain, plain = demo_chain_and_plans(2, workload, precision)
            named.update((f"dp2 {kind}", plan) for kind, plan in zip(KIND_NAMES, plain))
        if not named:
            parser.error("no plan kinds to measure: name some with --kinds, or add --dp-kinds")
        plans = list(named.values())
        _, measured = measure_by_world(plans, 1, workload=workload)
        rows = compare(chain, plans, measured, get_hardware("cpu-gloo"), list(named))
        hidden_states = next(block for block in chain.blocks if block.name == "h.0").output_bytes
        console.print(f"{workload.options}: a layer's hidden states {format_bytes(hidden_states)}")
        for row in rows:
            console.print(
                f"{row.kind}: predicted {format_bytes(row.predicted_bytes)}, measured "
                f"{format_bytes(row.measured_bytes)}, ratio {row.memory_ratio:.3f}"
            )
        return
    if not named:
        parser.error(
            "no mesh kinds to measure: name some with --kinds (--dp-kinds needs --memory-only)"
        )
    plans = list(named.values())
    measurements, measured = measure_by_world(
        plans, options.rounds, sweep=None if options.profile else CPU_SWEEP, workload=workload
    )
    hardware = get_hardware(options.profile) if options.profile else fit_profile(measurements)
    how = "saved profile" if options.profile else "calibrated in the same rounds"
    console.print(summary(hardware))
    console.print(f"{machine_cores()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    for profile, words in (
        (hardware, how),
        (get_hardware("cpu-gloo"), "built-in cpu-gloo profile"),
    ):
        console.print(
            accuracy_table(
                compare(chain, plans, measured, profile, list(named)),
                f"every mesh kind: demo GPT on CPU ranks (gloo), {words}",
            )
        )


if __name__ == "__main__":
    main()
