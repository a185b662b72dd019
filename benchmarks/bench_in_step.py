"""What a collective waits inside a training step, by size and by the compute before it, on 2 gloo ranks.

    .venv/bin/python benchmarks/bench_in_step.py               # 5 rounds, about a minute on 2 idle cores
    .venv/bin/python benchmarks/bench_in_step.py --rounds 10

The calibration prices a collective in a step as its own cost (the ranks arriving together, the fastest
timing) plus one mean wait, timed at about 0.4, 1.5 and 6 MB after 2 ms of cache-resident matmuls on every
rank ([Note: collectives in a step] in shardplan/calibrate.py). This times every kind at every size from
0.4 to 24 MB the same way, after each of two computes of the same length: those matmuls, and copies of a
64 MB buffer (past the last-level cache: memory streams, as through a backward's activations and an
optimizer's states). It prints each size's own time and its mean excess after either compute, then the
mean at the calibration's sizes and a line fitted through the excess in log(size), per compute.
"""
import argparse
import dataclasses
import os
import statistics

import numpy as np
import torch

from shardplan.calibrate import (_ALL_SIZES_BYTES, _COMPUTE_BEFORE_S, _IN_STEP_SIZES_BYTES, _MIB, _compute_lasting,
                                 collective_probes, time_probes_s)
from shardplan.hardware import COLLECTIVES, ring_factor
from shardplan.runtime.launch import run_world

SIZES_BYTES = _ALL_SIZES_BYTES[6:13]
"""About 0.4 to 24 MB, every factor of 2 (multiples of 64 bytes: whole float32 shards of 2 ranks)."""
_STREAMED_BYTES = 64 * _MIB


def in_step_job(device, report, rounds: int) -> dict:
    """Rank job: each (kind, size)'s own time, and its mean time after each compute ("matmuls", "copies")."""
    points = [(kind, nbytes) for kind in COLLECTIVES for nbytes in SIZES_BYTES]
    source = torch.ones(_STREAMED_BYTES // 4, device=device)
    target = torch.empty_like(source)
    befores = {"matmuls": _compute_lasting(_COMPUTE_BEFORE_S, device),
               "copies": _compute_lasting(_COMPUTE_BEFORE_S, device, lambda: target.copy_(source))}
    probes = collective_probes(points, device)
    for name, before in befores.items():
        probes |= {(name, kind, nbytes): dataclasses.replace(probe, before=before)
                   for (_, kind, nbytes), probe in collective_probes(points, device, in_step=True).items()}
    by_size = dict(sorted(probes.items(), key=lambda item: (item[0][-1], str(item[0]))))
    return time_probes_s(by_size, device, rounds, report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    seconds = run_world(in_step_job, (args.rounds,), world_size=2, backend="gloo", total_steps=args.rounds,
                        description="in-step collectives")
    computes = ("matmuls", "copies")
    print(f"2 gloo ranks, {args.rounds} rounds, load average {load:.1f}-{os.getloadavg()[0]:.1f}: own time (fastest) "
          f"and mean excess after {_COMPUTE_BEFORE_S * 1e3:.0f} ms of each compute, ms")
    print(f"{'kind':24s} {'MB':>6s} {'own':>6s} " + " ".join(f"{name:>8s}" for name in computes))
    excess = {name: [] for name in computes}
    for kind in COLLECTIVES:
        for nbytes in SIZES_BYTES:
            own_s = seconds[kind, nbytes]
            for name in computes:
                excess[name].append((kind, nbytes, seconds[name, kind, nbytes] - own_s))
            print(f"{kind:24s} {nbytes / 1e6:6.2f} {own_s * 1e3:6.2f} "
                  + " ".join(f"{excess[name][-1][2] * 1e3:8.2f}" for name in computes))
    calibrated = set(_IN_STEP_SIZES_BYTES)
    for name, rows in excess.items():
        at_calibrated = statistics.fmean(wait for _, nbytes, wait in rows if nbytes in calibrated)
        slope, intercept = np.polyfit(np.log2([nbytes * ring_factor(kind, 2) for kind, nbytes, _ in rows]),
                                      [wait for _, _, wait in rows], 1)
        print(f"after {name}: mean excess {at_calibrated * 1e3:.2f} ms at the calibration's sizes, "
              f"{statistics.fmean(wait for _, _, wait in rows) * 1e3:.2f} at all; fitted in log(size): "
              f"{slope * 1e3:+.2f} ms each time the bus bytes double")


if __name__ == "__main__":
    main()
