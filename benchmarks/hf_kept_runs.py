"""What is systematic in step time across runs that bench_hf_memory.py --keep wrote: by plan kind, by
strategy, and by the in-step wait each run's calibration measured.

    .venv/bin/python benchmarks/hf_kept_runs.py DIR [DIR ...]

One run is one architecture's profile and measurements in one folder (<name>.profile.json,
<name>.measured.json), priced on this code as `bench_hf_memory.py --price` prices them; each run's line
says how many of its kinds hold the bands (unrounded ratios). A run with any
kind's step time outside 0.75-1.25 of its prediction met a load spike (a step 1.3-2x the same kind's in
another run, or a calibration whose in-step wait read 4-7 ms) and is left out. Of the rest it prints each
kind's mean ratio (predicted / measured), the medians of the differences between two strategies' steps at
each checkpoint kind (predicted and measured milliseconds, and in how many runs the measured difference
exceeds the predicted), and each run's mean ratio against its calibration's in-step wait, with the
correlation and the line through them.
"""

import argparse
import collections
import os
import statistics

from bench_hf_memory import MEMORY_BAND, STEP_TIME_BAND, in_band, kept_run

from shardplan.calibration.accuracy import Accuracy, compare, demo_chain_and_plans, hf_workload

SPIKE_BAND = (0.75, 1.25)
"""A run with a kind outside this ratio of step time met a load spike, not the model."""
DIFFERENCES = (
    ("full_shard", "shard_grad_op"),
    ("shard_grad_op", "replicate"),
    ("shard_optimizer", "shard_grad_op"),
    ("shard_optimizer", "replicate"),
)
CHECKPOINTS = ("none", "full", "selective")


def kept_runs(folders: list[str]) -> list[tuple[str, float, list[Accuracy]]]:
    """(architecture, its calibration's in-step wait in seconds, its priced rows) of every run in `folders`."""
    chains: dict = {}
    runs = []
    for folder in folders:
        for file in sorted(os.listdir(folder)):
            if not file.endswith(".measured.json"):
                continue
            name = file.removesuffix(".measured.json")
            if name not in chains:
                chains[name] = demo_chain_and_plans(2, hf_workload(name))
            hardware, measured = kept_run(folder, name, None)
            runs.append(
                (
                    name,
                    hardware.intra_node.in_step_wait_s,
                    compare(*chains[name], measured, hardware),
                )
            )
    return runs


def met_a_spike(rows: list[Accuracy]) -> bool:
    return any(not SPIKE_BAND[0] <= row.time_ratio <= SPIKE_BAND[1] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="folders bench_hf_memory.py --keep wrote")
    options = parser.parse_args()
    runs = kept_runs(options.folders)
    print(
        f"each run: its calibration's in-step wait, memory and step time predicted / measured, kinds within "
        f"{MEMORY_BAND[0]}-{MEMORY_BAND[1]} and {STEP_TIME_BAND[0]}-{STEP_TIME_BAND[1]}"
    )
    for name, wait, rows in runs:
        memory, time = [row.memory_ratio for row in rows], [row.time_ratio for row in rows]
        held = sum(in_band(row) for row in rows)
        print(
            f"  {name:12s} wait {wait * 1e3:.2f} ms, memory {min(memory):.2f}-{max(memory):.2f}, "
            f"step time {min(time):.2f}-{max(time):.2f}, {held} of {len(rows)} in band"
        )
    quiet = [run for run in runs if not met_a_spike(run[2])]
    print(
        f"{len(quiet)} of {len(runs)} runs without a kind outside {SPIKE_BAND[0]}-{SPIKE_BAND[1]} "
        f"(left out: {', '.join(name for name, _, rows in runs if met_a_spike(rows)) or '-'})"
    )
    by_kind = collections.defaultdict(list)
    for _, _, rows in quiet:
        for row in rows:
            by_kind[row.kind].append(row.time_ratio)
    print("\nstep time predicted / measured by kind: mean (lowest-highest)")
    for kind, ratios in by_kind.items():
        print(f"  {kind:26s} {statistics.fmean(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})")
    print(
        "\ndifference of two strategies' steps, median predicted / measured ms (measured above predicted in)"
    )
    for first, second in DIFFERENCES:
        cells = []
        for checkpoint in CHECKPOINTS:
            pairs = []
            for _, _, rows in quiet:
                by = {row.kind: row for row in rows}
                a, b = by[f"{first}/{checkpoint}"], by[f"{second}/{checkpoint}"]
                pairs.append(
                    ((a.predicted_s - b.predicted_s) * 1e3, (a.measured_s - b.measured_s) * 1e3)
                )
            above = sum(measured > predicted for predicted, measured in pairs)
            cells.append(
                f"{checkpoint} {statistics.median(p for p, _ in pairs):+.0f} / "
                f"{statistics.median(m for _, m in pairs):+.0f} ({above} of {len(pairs)})"
            )
        print(f"  {first} - {second}: " + "; ".join(cells))
    waits = [wait * 1e3 for _, wait, _ in quiet]
    means = [statistics.fmean(row.time_ratio for row in rows) for _, _, rows in quiet]
    line = statistics.linear_regression(waits, means)
    print(
        f"\neach run's mean ratio against its calibration's in-step wait: r = "
        f"{statistics.correlation(waits, means):.2f}, {line.slope:+.3f} a ms, 1.00 at "
        f"{(1 - line.intercept) / line.slope:.2f} ms; waits {min(waits):.2f}-{max(waits):.2f} ms, "
        f"means {min(means):.3f}-{max(means):.3f}"
    )
    for (name, wait, _), mean in sorted(zip(quiet, means), key=lambda item: item[0][1]):
        print(f"  {name:12s} wait {wait * 1e3:.2f} ms, mean ratio {mean:.3f}")


if __name__ == "__main__":
    main()
