"""Predicted vs measured with a calibrated profile: collectives of 1-256 MB and a few matmuls.

    .venv/bin/python benchmarks/bench_collectives.py                          # calibrate and measure together
    .venv/bin/python benchmarks/bench_collectives.py --profile profile.json   # measure against a saved profile

Target: every collective of 1-256 MB within +-15% of measured at world 2 on gloo.

By default the calibration's probes (6 KB-380 MB, square matmuls) and this table's probes
(decimal sizes the calibration never times, non-square matmuls) run in the same interleaved
rounds of one spawned world ([Note: the fastest of interleaved rounds] in shardplan/calibration/calibrate.py):
on a machine shared with other work both then see the same load, and the ratio measures the
model (fit, interpolation, ring factor), not the neighbours. With --profile the table is
measured alone, as a user would after calibrating earlier. The "alpha-beta only" column drops
the measured correction (hardware.py) to show what the straight-line fit alone predicts.

The first table times each collective with the ranks arriving together (its own cost, what
the target is about); the second times 1-16 MB inside a step, after compute, against the own
cost plus the link's in-step wait ([Note: collectives in a step] in shardplan/calibration/calibrate.py).
"""

import argparse
import dataclasses
import os
import sys

import torch

from shardplan.calibration.calibrate import (
    CPU_SWEEP,
    IN_STEP,
    collective_probes,
    fit_profile,
    matmul_probe,
    measure_job,
    measure_steps,
    summary,
)
from shardplan.common.dtypes import dtype_bytes
from shardplan.costmodel.hardware import COLLECTIVES, NO_CORRECTION, get_hardware, ring_factor
from shardplan.runtime.launch import run_world

SIZES_BYTES = tuple(mb * 10**6 for mb in (1, 4, 16, 64, 256))
IN_STEP_SIZES_BYTES = SIZES_BYTES[:3]
# (m, k, n): a small projection, a GPT-2-small attention projection and MLP up-projection at 512
# tokens, and a wide layer at 128 tokens.
MATMUL_SHAPES = ((64, 256, 256), (512, 768, 768), (512, 768, 3072), (128, 4096, 4096))
DTYPES = ("float32", "bfloat16")
TOLERANCE = 0.15


def table_probes(device: torch.device) -> dict:
    """Rank side: the probes of the two tables."""
    probes = collective_probes(
        [(kind, nbytes) for kind in COLLECTIVES for nbytes in SIZES_BYTES], device
    )
    probes |= collective_probes(
        [(kind, nbytes) for kind in COLLECTIVES for nbytes in IN_STEP_SIZES_BYTES],
        device,
        in_step=True,
    )
    for dtype in DTYPES:
        for m, k, n in MATMUL_SHAPES:
            probes["matmul", dtype, m, k, n] = matmul_probe(m, k, n, dtype, device)
    return probes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", help="a profile JSON written by `shardplan calibrate`; default: calibrate here"
    )
    parser.add_argument("--save-profile", help="write the profile calibrated here to this path")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument(
        "--rounds",
        type=int,
        default=CPU_SWEEP.rounds,
        help="timings per probe; the fastest is kept",
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()[0]
    sweep = None if args.profile else CPU_SWEEP
    measurements, seconds = run_world(
        measure_job,
        (args.rounds, sweep, table_probes),
        world_size=args.world_size,
        backend="gloo",
        total_steps=measure_steps(args.rounds, sweep),
        description="measuring",
    )
    profile = get_hardware(args.profile) if args.profile else fit_profile(measurements)
    if args.save_profile:
        with open(args.save_profile, "w") as handle:
            handle.write(profile.to_json())
    print(summary(profile))
    how = "saved profile, table measured alone" if args.profile else "calibrated in the same rounds"
    print(
        f"\nworld {args.world_size}, gloo, fastest of {args.rounds} rounds, {how}; load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores)\n"
    )
    within = collective_table(profile, seconds, args.world_size)
    in_step_table(profile, seconds, args.world_size)
    matmul_table(profile, seconds)
    print(f"\ncollectives within +-{TOLERANCE:.0%}: {within}/{len(COLLECTIVES) * len(SIZES_BYTES)}")
    return 0


def collective_table(profile, seconds: dict, world_size: int) -> int:
    """Print the collective table; return how many rows are within TOLERANCE."""
    print("| kind | size | predicted s | measured s | predicted/measured | alpha-beta only |")
    print("|---|---:|---:|---:|---:|---:|")
    within = 0
    for kind in COLLECTIVES:
        fit_only = dataclasses.replace(
            profile.intra_node.collectives[kind], correction=NO_CORRECTION
        )
        for nbytes in SIZES_BYTES:
            predicted_s = profile.collective_time_s(kind, nbytes, world_size, in_step=False)
            measured_s = seconds[kind, nbytes]
            within += abs(predicted_s / measured_s - 1) <= TOLERANCE
            print(
                f"| {kind} | {nbytes / 1e6:g} MB | {predicted_s:.5f} | {measured_s:.5f} | "
                f"{predicted_s / measured_s:.2f} | "
                f"{fit_only.time_s(nbytes * ring_factor(kind, world_size)) / measured_s:.2f} |"
            )
    return within


def in_step_table(profile, seconds: dict, world_size: int) -> None:
    """Print the in-step table: each timing after compute, a round the mean of its timings."""
    print("\n| kind (in a step) | size | predicted s | measured s | predicted/measured |")
    print("|---|---:|---:|---:|---:|")
    for kind in COLLECTIVES:
        for nbytes in IN_STEP_SIZES_BYTES:
            predicted_s = profile.collective_time_s(kind, nbytes, world_size)
            measured_s = seconds[IN_STEP, kind, nbytes]
            print(
                f"| {kind} | {nbytes / 1e6:g} MB | {predicted_s:.5f} | {measured_s:.5f} | "
                f"{predicted_s / measured_s:.2f} |"
            )


def matmul_table(profile, seconds: dict) -> None:
    print("\n| matmul (m, k, n) | dtype | GFLOP | predicted s | measured s | predicted/measured |")
    print("|---|---|---:|---:|---:|---:|")
    for dtype in DTYPES:
        itemsize = dtype_bytes(dtype)
        for m, k, n in MATMUL_SHAPES:
            flops = 2 * m * k * n
            predicted_s = profile.compute_time_s(flops, (m * k + k * n + m * n) * itemsize, dtype)
            measured_s = seconds["matmul", dtype, m, k, n]
            print(
                f"| {m} x {k} x {n} | {dtype} | {flops / 1e9:.3f} | {predicted_s:.6f} | {measured_s:.6f} | "
                f"{predicted_s / measured_s:.2f} |"
            )


if __name__ == "__main__":
    sys.exit(main())
