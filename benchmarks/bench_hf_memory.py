"""Predicted vs measured on Hugging Face architectures: every plan kind's peak memory and step time.

    .venv/bin/python benchmarks/bench_hf_memory.py                     # every architecture, calibrating
    .venv/bin/python benchmarks/bench_hf_memory.py --models hf-llama hf-t5 --profile cpu-gloo
    .venv/bin/python benchmarks/bench_hf_memory.py --models --extra   # architectures of no table, same size
    .venv/bin/python benchmarks/bench_hf_memory.py --keep runs        # and write each profile and measurement
    .venv/bin/python benchmarks/bench_hf_memory.py --models --extra --bf16 --profile cpu-gloo --rounds 1
    PYTHONPATH=old .venv/bin/python benchmarks/bench_hf_memory.py --price runs   # those runs on old code
    .venv/bin/python benchmarks/bench_hf_memory.py --price runs --refit  # their profiles fitted on this code

Each of shardplan.calibration.accuracy.HF_WORKLOADS (Llama, Mixtral, GPT-2, BERT, T5, random weights) under a
hand-written plan of every strategy x checkpoint kind, one unit per block of the analysed chain,
trained with AdamW on 2 CPU ranks (gloo), gradients kept between steps; peak memory is MemTracker's
over a step after a warm-up step (the largest over the ranks), time a whole training step of rank 0,
the fastest of interleaved rounds; prediction is compile.evaluate (shardplan.calibration.accuracy). `--extra` (or
a name of zoo.HF_ARCHITECTURES in `--models`) runs other architectures at the same size
(accuracy.HF_OTHER_ARCHITECTURES, hf_architecture_workload): Qwen2, Phi-3, Gemma, GPT-NeoX, OPT, BART,
Falcon, StarCoder2.

By default each architecture's steps are timed in the same interleaved rounds as a calibration of
`--mode` (medium: what `shardplan calibrate --medium` measures), and predicted on the profile fitted
from it, as a user predicts after calibrating their machine; the fastest round is kept on both sides,
so other work on the machine lengthens neither more than the other ([Note: the fastest of interleaved
rounds] in shardplan/calibration/calibrate.py). `--profile` predicts on a saved or built-in profile instead.
"""

import argparse
import dataclasses
import json
import os

import torch
from rich.console import Console

from shardplan import get_hardware
from shardplan.calibration.accuracy import (
    HF_OTHER_ARCHITECTURES,
    HF_WORKLOAD_NAMES,
    HF_WORKLOADS,
    Accuracy,
    accuracy_table,
    compare,
    demo_chain_and_plans,
    hf_workload,
    measure_plans,
)
from shardplan.calibration.calibrate import MODES, Measurements, fit_profile, summary, sweep_for
from shardplan.costmodel.hardware import HardwareProfile
from shardplan.plan import BF16_MIXED, MixedPrecision

MEMORY_BAND, STEP_TIME_BAND = (0.95, 1.05), (0.85, 1.15)
"""The targets for predicted / measured (accuracy's bands are the suite's looser ones)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="*", default=list(HF_WORKLOADS), choices=HF_WORKLOAD_NAMES
    )
    parser.add_argument(
        "--extra", action="store_true", help="also every architecture of HF_OTHER_ARCHITECTURES"
    )
    parser.add_argument(
        "--profile",
        help="a profile JSON or built-in name (cpu-gloo); default: calibrate in the "
        "same rounds as the training steps",
    )
    parser.add_argument(
        "--mode", choices=MODES, default="medium", help="calibration mode without --profile"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="timed rounds of every plan's step, the fastest kept (default: the mode's, or 3)",
    )
    parser.add_argument(
        "--keep",
        metavar="FOLDER",
        help="write each architecture's profile (<name>.profile.json), "
        "measured peaks and step times (<name>.measured.json) and "
        "calibration timings (<name>.calibration.json) there, to "
        "price the same runs on other code",
    )
    parser.add_argument(
        "--price",
        metavar="FOLDER",
        help="measure nothing: price the runs --keep wrote there "
        "on this code (its profiles and measurements)",
    )
    parser.add_argument(
        "--refit",
        action="store_true",
        help="with --price: fit each profile again on this code "
        "from the calibration's timings --keep wrote "
        "(<name>.calibration.json)",
    )
    parser.add_argument(
        "--factors-like",
        metavar="PROFILE",
        help="with --price: keep only the op time factors "
        "PROFILE has, as a calibration of the code that "
        "wrote PROFILE would fit",
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="train in bf16 mixed precision (fp32 master weights, gradients reduced in fp32)",
    )
    options = parser.parse_args()
    if (options.factors_like or options.refit) and not options.price:
        parser.error("--factors-like and --refit price kept runs: give --price FOLDER too")
    names = options.models + list(HF_OTHER_ARCHITECTURES if options.extra else ())
    untimed = [
        name
        for name in names
        if options.refit
        and not os.path.isfile(os.path.join(options.price, f"{name}.calibration.json"))
    ]
    if untimed:
        parser.error(
            f"--refit: {options.price} holds no calibration timings of {', '.join(untimed)} (--keep writes "
            "<name>.calibration.json only where it calibrates, not with --profile): keep those runs again "
            "without --profile, or drop --refit"
        )
    torch.set_num_threads(1)
    console = Console(width=120)
    sweep = None if options.profile or options.price else sweep_for(options.mode, "gloo")
    rounds = options.rounds or (sweep.rounds if sweep else 3)
    spans = []
    for name in names:
        workload = hf_workload(name)
        chain, plans = demo_chain_and_plans(
            2, workload, BF16_MIXED if options.bf16 else MixedPrecision()
        )
        load = os.getloadavg()[0]
        measurements = None
        if options.price:
            hardware, measured = kept_run(options.price, name, options.factors_like, options.refit)
        else:
            measurements, measured = measure_plans(plans, 2, rounds, sweep, workload=workload)
            hardware = (
                get_hardware(options.profile) if options.profile else fit_profile(measurements)
            )
        if sweep:
            console.print(summary(hardware))
        if options.keep:
            keep_run(options.keep, name, hardware, measured, measurements)
        rows = compare(chain, plans, measured, hardware)
        how = (
            f"the runs kept in {options.price}"
            if options.price
            else options.profile or f"{options.mode} calibration in the same rounds"
        )
        console.print(
            accuracy_table(
                rows,
                f"{name}: predicted ({how}) vs measured, 2 gloo ranks, "
                f"load average {load:.1f}-{os.getloadavg()[0]:.1f}",
            )
        )
        spans.append((name, rows))
    for name, rows in spans:
        memory, time = [row.memory_ratio for row in rows], [row.time_ratio for row in rows]
        misses = [row.kind for row in rows if not in_band(row)]
        console.print(
            f"{name}: memory {min(memory):.2f}-{max(memory):.2f}, step time {min(time):.2f}-{max(time):.2f}; "
            f"outside {MEMORY_BAND[0]}-{MEMORY_BAND[1]} / {STEP_TIME_BAND[0]}-{STEP_TIME_BAND[1]}: "
            f"{', '.join(misses) or '-'}"
        )
    memory, time = zip(*((row.memory_ratio, row.time_ratio) for _, rows in spans for row in rows))
    console.print(
        f"memory predicted/measured {min(memory):.2f}-{max(memory):.2f}, "
        f"step time {min(time):.2f}-{max(time):.2f}; load average {os.getloadavg()[0]:.2f} at the end"
    )


def in_band(row: Accuracy) -> bool:
    """Whether `row` holds the bands, memory and step time."""
    return (
        MEMORY_BAND[0] <= row.memory_ratio <= MEMORY_BAND[1]
        and STEP_TIME_BAND[0] <= row.time_ratio <= STEP_TIME_BAND[1]
    )


def keep_run(
    folder: str,
    name: str,
    hardware: HardwareProfile,
    measured: list[tuple[int, float]],
    measurements: Measurements | None,
) -> None:
    """Write `name`'s profile, measured peaks and step times, and (where it calibrated) the calibration's timings
    into `folder`, for kept_run to price again."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.profile.json"), "w") as handle:
        handle.write(hardware.to_json())
    with open(os.path.join(folder, f"{name}.measured.json"), "w") as handle:
        json.dump(measured, handle)
    if measurements:
        with open(os.path.join(folder, f"{name}.calibration.json"), "w") as handle:
            json.dump(dataclasses.asdict(measurements), handle)


def kept_run(
    folder: str, name: str, factors_like: str | None, refit: bool = False
) -> tuple[HardwareProfile, list[tuple[int, float]]]:
    """The profile and measurements --keep wrote for `name` (with `refit`, the profile fitted again from its
    calibration's timings); the profile's op time factors only of the ops `factors_like` (a profile) has
    factors for, when given."""
    if refit:
        with open(os.path.join(folder, f"{name}.calibration.json")) as handle:
            hardware = fit_profile(Measurements(**json.load(handle)))
    else:
        with open(os.path.join(folder, f"{name}.profile.json")) as handle:
            hardware = HardwareProfile.from_json(handle.read())
    with open(os.path.join(folder, f"{name}.measured.json")) as handle:
        measured = [(peak, seconds) for peak, seconds in json.load(handle)]
    if factors_like:
        ops = get_hardware(factors_like).op_time_factors
        hardware = dataclasses.replace(
            hardware,
            op_time_factors={
                op: factor for op, factor in hardware.op_time_factors.items() if op in ops
            },
        )
    return hardware, measured


if __name__ == "__main__":
    main()
