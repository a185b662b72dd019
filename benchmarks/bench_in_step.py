"""What a collective waits inside a training step, by size and by the compute before it, on 2 gloo ranks.

    .venv/bin/python benchmarks/bench_in_step.py               # 5 rounds, about a minute on 2 idle cores
    .venv/bin/python benchmarks/bench_in_step.py --rounds 10
    .venv/bin/python benchmarks/bench_in_step.py --prefetched  # issued before the compute, waited after (~20 s)

The calibration prices a collective in a step as its own cost (the ranks arriving together, the fastest
timing) plus one mean wait, timed at about 0.4, 1.5 and 6 MB after 2 ms of cache-resident matmuls on every
rank ([Note: collectives in a step] in shardplan/calibration/calibrate.py). This times every kind at every size from
0.4 to 24 MB the same way, after each of two computes of the same length: those matmuls, and copies of a
64 MB buffer (past the last-level cache: memory streams, as through a backward's activations and an
optimizer's states). It prints each size's own time and its mean excess after either compute, then the
mean at the calibration's sizes and a line fitted through the excess in log(size), per compute.

`--prefetched` asks what the runtime's prefetch meets instead: at the calibration's sizes, interleaved round
by round and each the mean of its timings, the collective after the matmuls (the calibration's probe), the
matmuls alone, and the collective issued before the same matmuls and waited for after them (as a unit's
gather is issued a unit ahead). It prints each size's own time, what the first waits beyond it, and what
the prefetched one adds to the matmuls beyond it: on a CPU (no overlap) the cost model charges every gather
the first, prefetched or not.
"""

import argparse
import dataclasses
import os
import statistics

import numpy as np
import torch
import torch.distributed as dist

from shardplan.calibration.calibrate import (
    _ALL_SIZES_BYTES,
    _COMPUTE_BEFORE_S,
    _IN_STEP_SIZES_BYTES,
    _IN_STEP_TIMINGS,
    _MIB,
    IN_STEP,
    Probe,
    _compute_lasting,
    collective_call,
    collective_probes,
    time_probes_s,
)
from shardplan.costmodel.hardware import COLLECTIVES, ring_factor
from shardplan.runtime.launch import run_world

SIZES_BYTES = _ALL_SIZES_BYTES[6:13]
"""About 0.4 to 24 MB, every factor of 2 (multiples of 64 bytes: whole float32 shards of 2 ranks)."""
_STREAMED_BYTES = 64 * _MIB


def in_step_job(device, report, rounds: int) -> dict:
    """Rank job: each (kind, size)'s own time, and its mean time after each compute ("matmuls", "copies")."""
    points = [(kind, nbytes) for kind in COLLECTIVES for nbytes in SIZES_BYTES]
    source = torch.ones(_STREAMED_BYTES // 4, device=device)
    target = torch.empty_like(source)
    befores = {
        "matmuls": _compute_lasting(_COMPUTE_BEFORE_S, device),
        "copies": _compute_lasting(_COMPUTE_BEFORE_S, device, lambda: target.copy_(source)),
    }
    probes = collective_probes(points, device)
    for name, before in befores.items():
        probes |= {
            (name, kind, nbytes): dataclasses.replace(probe, before=before)
            for (_, kind, nbytes), probe in collective_probes(points, device, in_step=True).items()
        }
    by_size = dict(sorted(probes.items(), key=lambda item: (item[0][-1], str(item[0]))))
    return time_probes_s(by_size, device, rounds, report)


def prefetched_job(device, report, rounds: int) -> dict:
    """Rank job: at the calibration's sizes, each (kind, size)'s own time, its mean after the matmuls, and the
    mean of its issue, the matmuls and its wait; and the matmuls' mean alone."""
    points = [(kind, nbytes) for kind in COLLECTIVES for nbytes in _IN_STEP_SIZES_BYTES]
    compute = _compute_lasting(_COMPUTE_BEFORE_S, device)
    probes = collective_probes(points, device) | collective_probes(points, device, in_step=True)
    full = torch.zeros(max(_IN_STEP_SIZES_BYTES) // 4, device=device)
    shard = torch.zeros(full.numel() // dist.get_world_size(), device=device)

    def ahead(kind: str, nbytes: int):
        issue = collective_call(
            kind, full[: nbytes // 4], shard[: nbytes // 4 // dist.get_world_size()], async_op=True
        )

        def call() -> None:
            work = issue()
            compute()
            work.wait()

        return call

    def timed(call) -> Probe:
        return Probe(
            call=call, loop=False, timings_per_round=_IN_STEP_TIMINGS, figure=statistics.fmean
        )

    probes |= {("prefetched", kind, nbytes): timed(ahead(kind, nbytes)) for kind, nbytes in points}
    probes[("matmuls",)] = timed(compute)
    return time_probes_s(probes, device, rounds, report)


def show_prefetched(seconds: dict) -> None:
    matmuls = seconds[("matmuls",)]
    print(
        f"{matmuls * 1e3:.2f} ms of matmuls; own time (fastest), and beyond it the mean wait after the matmuls and "
        f"what the collective issued before them adds to them, ms"
    )
    print(f"{'kind':24s} {'MB':>6s} {'own':>6s} {'waited after':>13s} {'prefetched':>11s}")
    after, ahead = [], []
    for kind in COLLECTIVES:
        for nbytes in _IN_STEP_SIZES_BYTES:
            own = seconds[kind, nbytes]
            after.append(seconds[IN_STEP, kind, nbytes] - own)
            ahead.append(seconds["prefetched", kind, nbytes] - matmuls - own)
            print(
                f"{kind:24s} {nbytes / 1e6:6.2f} {own * 1e3:6.2f} {after[-1] * 1e3:13.2f} {ahead[-1] * 1e3:11.2f}"
            )
    print(
        f"mean: waited after the matmuls {statistics.fmean(after) * 1e3:.2f} ms (the calibration's in-step wait), "
        f"issued before them {statistics.fmean(ahead) * 1e3:.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--prefetched",
        action="store_true",
        help="a collective issued before the compute and waited for after it, beside the calibration's",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    job = prefetched_job if args.prefetched else in_step_job
    seconds = run_world(
        job,
        (args.rounds,),
        world_size=2,
        backend="gloo",
        total_steps=args.rounds,
        description="in-step collectives",
    )
    if args.prefetched:
        print(
            f"2 gloo ranks, {args.rounds} rounds, load average {load:.1f}-{os.getloadavg()[0]:.1f}"
        )
        show_prefetched(seconds)
        return
    computes = ("matmuls", "copies")
    print(
        f"2 gloo ranks, {args.rounds} rounds, load average {load:.1f}-{os.getloadavg()[0]:.1f}: own time (fastest) "
        f"and mean excess after {_COMPUTE_BEFORE_S * 1e3:.0f} ms of each compute, ms"
    )
    print(f"{'kind':24s} {'MB':>6s} {'own':>6s} " + " ".join(f"{name:>8s}" for name in computes))
    excess = {name: [] for name in computes}
    for kind in COLLECTIVES:
        for nbytes in SIZES_BYTES:
            own_s = seconds[kind, nbytes]
            for name in computes:
                excess[name].append((kind, nbytes, seconds[name, kind, nbytes] - own_s))
            print(
                f"{kind:24s} {nbytes / 1e6:6.2f} {own_s * 1e3:6.2f} "
                + " ".join(f"{excess[name][-1][2] * 1e3:8.2f}" for name in computes)
            )
    calibrated = set(_IN_STEP_SIZES_BYTES)
    for name, rows in excess.items():
        at_calibrated = statistics.fmean(wait for _, nbytes, wait in rows if nbytes in calibrated)
        slope, intercept = np.polyfit(
            np.log2([nbytes * ring_factor(kind, 2) for kind, nbytes, _ in rows]),
            [wait for _, _, wait in rows],
            1,
        )
        print(
            f"after {name}: mean excess {at_calibrated * 1e3:.2f} ms at the calibration's sizes, "
            f"{statistics.fmean(wait for _, _, wait in rows) * 1e3:.2f} at all; fitted in log(size): "
            f"{slope * 1e3:+.2f} ms each time the bus bytes double"
        )


if __name__ == "__main__":
    main()
