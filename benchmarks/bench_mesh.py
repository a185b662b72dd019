"""Predicted vs measured, on this machine: every mesh kind's peak memory and step time.

    .venv/bin/python benchmarks/bench_mesh.py                      # calibrates in the same rounds
    .venv/bin/python benchmarks/bench_mesh.py --profile profile.json

The demo GPT under every kind of shardplan.accuracy.MESH_KINDS (tp 2 without and with vocabulary and
sequence parallelism, dp 2 x tp 2, HSDP 2 x 2; every unit FULL_SHARD), trained on CPU ranks (gloo),
one spawned world per world size, each rank's batch its replica's; peak memory is MemTracker's (every
tensor on the rank, the largest over the ranks), time a whole training step of rank 0, the fastest
of interleaved rounds; prediction is compile.evaluate, on a calibration made in the same rounds as
the world of 2 (or --profile) and on the built-in cpu-gloo profile. A world of more ranks than the
machine's cores is priced on shardplan.accuracy.shared_cores ([Note: more ranks than cores]).
"""
import argparse
import os

import torch
from rich.console import Console

from shardplan import get_hardware
from shardplan.accuracy import accuracy_table, compare, demo_mesh_plans, machine_cores, measure_by_world
from shardplan.calibrate import CPU_SWEEP, fit_profile, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a profile JSON written by `shardplan calibrate`; default: calibrate "
                                          "in the same rounds as the training steps of the world of 2")
    parser.add_argument("--rounds", type=int, default=CPU_SWEEP.rounds,
                        help="timed rounds of every probe and training step; the fastest is kept")
    options = parser.parse_args()
    torch.set_num_threads(1)
    chain, named = demo_mesh_plans()
    plans = list(named.values())
    measurements, measured = measure_by_world(plans, options.rounds, sweep=None if options.profile else CPU_SWEEP)
    hardware = get_hardware(options.profile) if options.profile else fit_profile(measurements)
    how = "saved profile" if options.profile else "calibrated in the same rounds"
    console = Console(width=120)
    console.print(summary(hardware))
    console.print(f"{machine_cores()} cores, load average {os.getloadavg()[0]:.2f} at the end")
    for profile, words in ((hardware, how), (get_hardware("cpu-gloo"), "built-in cpu-gloo profile")):
        console.print(accuracy_table(compare(chain, plans, measured, profile, list(named)),
                                     f"every mesh kind: demo GPT on CPU ranks (gloo), {words}"))


if __name__ == "__main__":
    main()
