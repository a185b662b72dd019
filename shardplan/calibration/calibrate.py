"""Measure this machine and write a HardwareProfile: `shardplan calibrate [-o profile.json]`.

Every figure is the fastest of several rounds (see [Note: the fastest of interleaved rounds]):
- square matmuls over a sweep of sizes, per dtype: the peak and the efficiency curve;
- a copy far larger than the caches: memory bandwidth; one-element ops, forward and backward:
  the fixed cost of a kernel in a training step (a bare call's, without autograd, is taken out
  of the timed matmuls and ops); a tiny transformer layer with and without selective
  checkpointing: what its dispatch modes add to each op ([Note: selective checkpointing's modes]);
  a chain of views forward and backward: a view's fixed cost ([Note: views' fixed cost]);
- every kernel of a training step of a few models: each ATen op's time over its roofline
  ([Note: op time factors]);
- all_gather_into_tensor, reduce_scatter_tensor and all_reduce over 6 KB-380 MB, the ranks
  arriving together: alpha-beta fitted by least squares, times the measured correction
  (hardware.py, [Note: model times measured correction]); and at a few sizes after compute, as
  in a training step: the mean wait a step adds to each ([Note: collectives in a step]).

All of it runs in a spawned world of `world_size` ranks (gloo on CPU, NCCL on GPUs), so it
sees what training ranks see: on CPU one thread per rank, the other ranks computing beside
it. Rank 0 reports its timings; the parent process shows progress and fits the profile.
"""

import dataclasses
import datetime
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from shardplan.calibration.op_factors import (
    fit_op_factors,
    fit_op_fixed_costs,
    op_workloads,
    time_op_calls_s,
    training_step_kernels,
)
from shardplan.common.dtypes import torch_dtype
from shardplan.common.files import write_text_atomically
from shardplan.costmodel.hardware import (
    COLLECTIVES,
    CollectiveCost,
    HardwareProfile,
    LinkProfile,
    MatmulRate,
    SizeCurve,
    ring_factor,
)
from shardplan.errors import HardwareError
from shardplan.frontend.passes.execution import is_dispatch, is_kernel
from shardplan.plan import Checkpoint, kept_by_selective
from shardplan.runtime.launch import run_world
from shardplan.runtime.measure import synchronize

_MIB = 2**20
_SINGLE_NAMES = {
    "all_gather_into_tensor": "all_gather_single",
    "reduce_scatter_tensor": "reduce_scatter_single",
}
"""torch 2.13 spells the tensor collectives *_single and deprecates the old names; older torch has only those."""
_MIN_TIMING_S = 2e-3
"""Each compute timing loops over calls until it lasts this long, well above timer resolution."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    """What to measure and how often."""

    matmul_sizes: tuple[int, ...]
    """n of the n x n x n matmuls timed in every dtype; the smallest must take well over one op's overhead."""
    dtypes: tuple[str, ...]
    collective_sizes_bytes: tuple[int, ...]
    """Full (gathered) buffer sizes of the collectives timed."""
    in_step_sizes_bytes: tuple[int, ...]
    """Sizes also timed inside a step, after compute ([Note: collectives in a step])."""
    rounds: int
    """Rounds: timings of every probe, of which the fastest is kept (in a step: the mean of all)."""
    copy_bytes: int
    """Buffer of the bandwidth copy: far beyond the last-level cache."""


# Every factor of 2 from 5.8 KB to 380 MB, midway (in log) between powers of 2. Measured here
# with gloo: a buffer of exactly 2^k bytes is often 10-30% slower than sizes 6% either side
# (likely cache-set conflicts between buffers at power-of-2 offsets), and training buffers
# have any size.
# Time also jumps by up to 30% between sizes 5% apart: a grid every factor of 2 follows more
# of that than one every factor of 4.
_ALL_SIZES_BYTES = tuple(int(2 ** (k + 0.5)) // 64 * 64 for k in range(12, 29))
_IN_STEP_SIZES_BYTES = _ALL_SIZES_BYTES[6:11:2]
"""About 0.4, 1.5 and 6 MB: below the last-level cache's cliff, where one size's own cost is known
to a few percent (past it, sizes 5% apart differ by 30%, and the excess would be that noise)."""
CPU_SWEEP = Sweep(
    matmul_sizes=(64, 128, 256, 512, 1024, 2048),
    dtypes=("float32", "bfloat16"),
    collective_sizes_bytes=_ALL_SIZES_BYTES,
    in_step_sizes_bytes=_IN_STEP_SIZES_BYTES,
    rounds=10,
    copy_bytes=256 * _MIB,
)
# GPU matmuls start at n=2048: a smaller one finishes faster than a kernel launches, so its
# time says nothing about throughput.
GPU_SWEEP = Sweep(
    matmul_sizes=(2048, 4096, 8192, 16384),
    dtypes=("float32", "bfloat16", "float16"),
    collective_sizes_bytes=_ALL_SIZES_BYTES,
    in_step_sizes_bytes=_IN_STEP_SIZES_BYTES,
    rounds=10,
    copy_bytes=2048 * _MIB,
)
QUICK_SWEEP = Sweep(
    matmul_sizes=(64, 256),
    dtypes=("float32", "bfloat16"),
    collective_sizes_bytes=_ALL_SIZES_BYTES[::6],
    in_step_sizes_bytes=_ALL_SIZES_BYTES[6:7],
    rounds=3,
    copy_bytes=64 * _MIB,
)
"""For tests: every kind of figure, roughly: matmuls stop at n = 256, every figure the fastest of 3 rounds."""
_MEDIUM_LARGEST_BYTES = 48 * _MIB
"""Medium mode's largest collective: above a whole small model's parameters (the demo GPT's 21 MB,
its units 4-8 MB); the full sweep's larger sizes take most of its time."""
_MEDIUM_ROUNDS = 5
_TYPICAL_DURATION = {
    "quick": "typically under a minute",
    "medium": "typically 20 s to 1.5 minutes",
    "full": "typically 2-5 minutes",
}
"""What each mode took at world 2 on 2 CPU cores, start-up included: quick 43-54 s, medium 76 s and
full 236 s with other work on the cores (load 8-17), medium 15-20 s with the cores to itself
(docs/benchmarks.md, "The demo"); the time left follows each step."""
MODES = tuple(_TYPICAL_DURATION)


def sweep_for(mode: str, backend: str) -> Sweep:
    """What a calibration of `mode` measures on `backend`: quick (seconds of measuring, for tests),
    medium (under a minute all told on 2 CPU cores) or full (minutes).

    Medium is the full sweep less its largest matmul and its collectives past _MEDIUM_LARGEST_BYTES,
    in half the rounds: every figure a step-time prediction of a small model reads (matmul rates up to
    n = 1024 on CPU, every collective size up to 48 MB, all three in-step sizes, the copy past the
    caches, every op workload), and enough rounds that the fastest of them is the machine's."""
    full = GPU_SWEEP if backend == "nccl" else CPU_SWEEP
    if mode == "full":
        return full
    if mode == "medium":
        return dataclasses.replace(
            full,
            matmul_sizes=full.matmul_sizes[:-1],
            rounds=_MEDIUM_ROUNDS,
            collective_sizes_bytes=tuple(
                size for size in full.collective_sizes_bytes if size <= _MEDIUM_LARGEST_BYTES
            ),
        )
    if mode == "quick":
        return QUICK_SWEEP
    raise HardwareError(f"unknown calibration mode {mode!r}: use one of {', '.join(MODES)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurements:
    """Rank 0's fastest timings: the input of `fit_profile`."""

    device_name: str
    backend: str
    world_size: int
    device_memory_bytes: int
    devices_per_node: int
    matmul_s: dict[str, tuple[tuple[float, float], ...]]
    """By dtype: (FLOPs of one call, seconds), by increasing size."""
    copy_bytes: int
    copy_s: float
    op_overhead_s: float
    """Fixed cost of a kernel in a training step (training_op_probe): what the profile prices."""
    kernel_overhead_s: float
    """Fixed cost of a bare kernel call (no autograd): what a timed call of a matmul or of a
    workload's op holds beside its work."""
    collective_s: dict[str, tuple[tuple[int, float], ...]]
    """By kind: (full buffer bytes, seconds), by increasing size; the ranks arriving together."""
    in_step_collective_s: dict[str, tuple[tuple[int, float], ...]]
    """The same at a few sizes, each timing after compute ([Note: collectives in a step])."""
    op_calls: tuple[tuple[str, int, int, float], ...]
    """Every kernel of one training step of each op workload: (op name, FLOPs, bytes, fastest seconds)."""
    selective_op_overhead_s: float = 0.0
    """What selective checkpointing adds to each op a forward dispatches ([Note: selective
    checkpointing's modes]); 0: not measured."""
    view_overhead_s: float = 0.0
    """Fixed cost of a view's dispatch in a training step ([Note: views' fixed cost]); 0: not measured."""


def calibrate(
    world_size: int = 2,
    backend: str | None = None,
    sizes: tuple[int, ...] | None = None,
    progress: bool = True,
    mode: str = "full",
    partial_path: str | None = None,
) -> HardwareProfile:
    """Measure this machine with `world_size` ranks and fit a profile.

    `backend`: "gloo" (CPU) or "nccl" (GPUs); by default NCCL when CUDA is present.
    `sizes`: collective buffer sizes in bytes, instead of the sweep's 6 KB-380 MB.
    `progress`: a bar on a terminal; otherwise (a log, CI) one line on stderr per round with the time left.
    `mode`: "quick", "medium" or "full" (see sweep_for).
    `partial_path`: after each round, the profile fitted so far is written there (atomically), so an
    interrupted calibration leaves a usable, rougher profile.

    >>> profile = calibrate(world_size=2, mode="quick")  # doctest: +SKIP
    >>> profile.collective_time_s("all_gather_into_tensor", 64 * 2**20, 2)  # doctest: +SKIP
    """
    backend = _choose_backend(backend, world_size)
    sweep = sweep_for(mode, backend)
    if sizes is not None:
        unfit = [size for size in sizes if size <= 0 or size % (4 * world_size)]
        if unfit:
            raise HardwareError(
                f"collective sizes {unfit} bytes do not split into {world_size} float32 shards: "
                f"use positive multiples of {4 * world_size} bytes"
            )
    else:
        sizes = _whole_shards(sweep.collective_sizes_bytes, world_size)
    sweep = dataclasses.replace(
        sweep,
        collective_sizes_bytes=tuple(sorted(set(sizes))),
        in_step_sizes_bytes=_whole_shards(sweep.in_step_sizes_bytes, world_size),
    )
    description = f"calibrating ({mode}, {backend}, world {world_size})"
    on_terminal = progress and sys.stderr.isatty()
    total_steps = measure_steps(sweep.rounds, sweep)
    if progress:
        kept = (
            f"; the profile measured so far is kept in {partial_path} as it goes"
            if partial_path
            else ""
        )
        matmuls, collectives = (
            len(sweep.matmul_sizes) * len(sweep.dtypes),
            3 * len(sweep.collective_sizes_bytes),
        )
        print(
            f"shardplan calibrate: {description}, {_TYPICAL_DURATION[mode]}: {total_steps} steps "
            f"({sweep.rounds} rounds of {matmuls} matmuls and {collectives} collectives, then {sweep.rounds} rounds "
            f"of training-step kernels){kept}"
            + ("" if on_terminal else "; the time left follows each step"),
            file=sys.stderr,
            flush=True,
        )
    measurements, _ = run_world(
        _calibration_job,
        (sweep, progress and not on_terminal, partial_path),
        world_size=world_size,
        backend=backend,
        total_steps=total_steps,
        progress=on_terminal,
        description=description,
    )
    return fit_profile(measurements)


def _calibration_job(
    device: torch.device, report, sweep: Sweep, lines: bool, partial_path: str | None
) -> tuple[Measurements | None, dict]:
    """Rank job: measure_job of `sweep`; on rank 0, a line per step on stderr when `lines`, and the
    profile fitted so far written to `partial_path` after every round of probes."""
    if dist.get_rank() == 0:
        if lines:
            report = _with_lines(report, measure_steps(sweep.rounds, sweep))
        if partial_path:
            return measure_job(
                device,
                report,
                sweep.rounds,
                sweep,
                partial=lambda m, done: _write_partial(partial_path, m, done, sweep.rounds),
            )
    return measure_job(device, report, sweep.rounds, sweep)


def _with_lines(report, total_steps: int):
    """`report`, also printing each step on stderr with the time spent and an estimate of the time left."""
    start, done = time.perf_counter(), [0]

    def report_and_print(text: str) -> None:
        report(text)
        done[0] += 1
        spent = time.perf_counter() - start
        left = spent / done[0] * (total_steps - done[0])
        print(
            f"shardplan calibrate: step {done[0]} of {total_steps} ({text}): {_duration(spent)} spent, "
            f"about {_duration(left)} left",
            file=sys.stderr,
            flush=True,
        )

    return report_and_print


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def _write_partial(path: str, measurements: "Measurements", rounds_done: int, rounds: int) -> None:
    """The profile of the probes' rounds so far (no op time factors yet), if they fit one yet."""
    try:
        profile = fit_profile(measurements)
    except HardwareError:
        return  # too few or too noisy timings so far: the next round tries again
    note = f"; PARTIAL: {rounds_done} of {rounds} rounds of probes, no op time factors (calibration interrupted?)"
    write_text_atomically(
        path, dataclasses.replace(profile, source=profile.source + note).to_json()
    )


def _whole_shards(sizes: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """Each size down to whole float32 shards over `world_size` ranks."""
    return tuple(sorted({size // (4 * world_size) * (4 * world_size) for size in sizes}))


def partial_path(output: str) -> str:
    """Where `shardplan calibrate` keeps the profile measured so far: beside `output`, e.g. profile.partial.json."""
    stem, extension = os.path.splitext(output)
    return f"{stem}.partial{extension or '.json'}"


def summary(profile: HardwareProfile) -> str:
    """One line per kind of figure, for people."""
    lines = [f"{profile.name} ({profile.source})"]
    for dtype, rate in sorted(profile.matmul.items()):
        lines.append(f"  matmul {dtype}: peak {rate.peak_flops_per_s / 1e9:.1f} GFLOP/s")
    lines.append(
        f"  memory: {profile.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, "
        f"op overhead {profile.op_overhead_s * 1e6:.2f} us, view {profile.view_overhead_s * 1e6:.2f} us, "
        f"selective checkpointing {profile.selective_op_overhead_s * 1e6:.2f} us an op"
    )
    if profile.op_time_factors:
        examples = [
            f"{name} {_factor_range(profile.op_time_factors[name])}"
            for name in _SUMMARY_OPS
            if name in profile.op_time_factors
        ]
        lines.append(
            f"  op time factors (measured / roofline): {len(profile.op_time_factors)} ops, "
            f"e.g. {', '.join(examples)}"
        )
    for kind, cost in profile.intra_node.collectives.items():
        lines.append(
            f"  {kind}: latency {cost.latency_s * 1e6:.0f} us, "
            f"bus bandwidth {cost.bus_bandwidth_bytes_per_s / 1e9:.2f} GB/s"
        )
    lines.append(
        f"  in a training step, each collective waits {profile.intra_node.in_step_wait_s * 1e6:.0f} us more"
    )
    return "\n".join(lines)


_SUMMARY_OPS = ("mm", "addmm", "native_layer_norm", "gelu", "add")


def _factor_range(curve: SizeCurve) -> str:
    factors = [factor for _, factor in curve.points]
    return (
        f"{min(factors):.2f}"
        if min(factors) == max(factors)
        else f"{min(factors):.2f}-{max(factors):.2f}"
    )


# Fitting: pure functions of the measurements.


def fit_profile(m: Measurements) -> HardwareProfile:
    costs = {
        kind: fit_collective(
            [(nbytes * ring_factor(kind, m.world_size), seconds) for nbytes, seconds in points]
        )
        for kind, points in m.collective_s.items()
    }
    excess_s = [
        seconds - costs[kind].time_s(nbytes * ring_factor(kind, m.world_size))
        for kind, points in m.in_step_collective_s.items()
        for nbytes, seconds in points
    ]
    link = LinkProfile(
        collectives=costs, in_step_wait_s=max(0.0, float(np.mean(excess_s))) if excess_s else 0.0
    )
    on_cpu = m.backend == "gloo"
    how = (
        "CPU compute per rank with 1 thread (as ranks run), all ranks computing at once; "
        if on_cpu
        else ""
    )
    profile = HardwareProfile(
        name=f"calibrated-{m.backend}-{'cpu' if on_cpu else 'gpu'}",
        device_memory_bytes=m.device_memory_bytes,
        matmul={
            dtype: fit_matmul(points, m.kernel_overhead_s) for dtype, points in m.matmul_s.items()
        },
        memory_bandwidth_bytes_per_s=2
        * m.copy_bytes
        / m.copy_s,  # a copy reads and writes every byte
        op_overhead_s=m.op_overhead_s,
        selective_op_overhead_s=m.selective_op_overhead_s,
        devices_per_node=m.devices_per_node,
        overlaps_communication=not on_cpu,
        intra_node=link,
        inter_node=link,
        source=(
            f"shardplan calibrate on {m.device_name}, {datetime.date.today().isoformat()}, "
            f"torch {torch.__version__}, {m.backend} world {m.world_size}; {how}"
            "inter_node copies intra_node (measured on one machine)"
        ),
    )
    profile = dataclasses.replace(
        profile, op_time_factors=fit_op_factors(profile, m.op_calls, m.kernel_overhead_s)
    )
    # A GPU's clock synchronizes after each call, which a step does not: its small calls would read the
    # synchronization as their fixed cost, where a step queues them behind the kernels before. Nor do
    # views cost a GPU's step time: the host dispatches them while the device runs the kernels before.
    fixed_costs = fit_op_fixed_costs(profile, m.op_calls, m.kernel_overhead_s) if on_cpu else {}
    return dataclasses.replace(
        profile, op_fixed_costs_s=fixed_costs, view_overhead_s=m.view_overhead_s if on_cpu else 0.0
    )


def fit_matmul(points: "list[tuple[float, float]] | tuple", kernel_overhead_s: float) -> MatmulRate:
    """Peak = the best rate measured; efficiency = each size's rate over it, a bare call's fixed cost
    taken out, never falling with size.

    A larger matmul can always run as tiles of a smaller one, so a rate that falls with size is
    the load of a shared machine, not the device: one timing of a large matmul is one long call,
    which any other process lengthens (here, n = 2048 measured at half the rate of n = 512 while
    other agents ran, and at 0.9 of it on a quiet core)."""
    rates, best = [], 0.0
    for flops, seconds in sorted(points):
        if seconds <= kernel_overhead_s:
            raise HardwareError(
                f"a matmul of {flops:.3g} FLOPs took {seconds * 1e6:.2f} us, no longer than an "
                f"empty op ({kernel_overhead_s * 1e6:.2f} us): start the sweep at a larger size"
            )
        best = max(best, flops / (seconds - kernel_overhead_s))
        rates.append((flops, best))
    peak = rates[-1][1]
    return MatmulRate(
        peak_flops_per_s=peak,
        efficiency=SizeCurve(points=tuple((flops, rate / peak) for flops, rate in rates)),
    )


def fit_collective(points: "list[tuple[float, float]]") -> CollectiveCost:
    """Alpha-beta by non-negative least squares on (bus bytes, seconds), plus the measured correction.

    The residuals are relative (each row divided by its time) so the smallest and largest sizes weigh alike.
    """
    bus_bytes = np.array([point[0] for point in points], dtype=np.float64)
    seconds = np.array([point[1] for point in points], dtype=np.float64)
    if len(points) < 2 or len(set(bus_bytes)) < len(points):
        raise HardwareError(
            f"fitting latency and bandwidth needs at least 2 distinct sizes, got {bus_bytes.tolist()}"
        )
    design = np.stack([np.ones_like(bus_bytes), bus_bytes], axis=1) / seconds[:, None]
    scale = np.linalg.norm(design, axis=0)  # equal column norms keep NNLS well conditioned
    solution, _ = scipy.optimize.nnls(design / scale, np.ones_like(seconds))
    latency_s, seconds_per_byte = solution / scale
    if latency_s <= 0 or seconds_per_byte <= 0:
        raise HardwareError(
            f"collective timings {seconds.tolist()} s at bus bytes {bus_bytes.tolist()} do not grow "
            "with size past a fixed latency: the machine was busy; calibrate again on a quiet machine"
        )
    fitted = CollectiveCost(
        latency_s=float(latency_s), bus_bandwidth_bytes_per_s=float(1 / seconds_per_byte)
    )
    correction = SizeCurve(
        points=tuple(
            sorted((float(x), float(t / fitted.time_s(x))) for x, t in zip(bus_bytes, seconds))
        )
    )
    return dataclasses.replace(fitted, correction=correction)


# Measuring: runs on every rank of the spawned world.
#
# [Note: the fastest of interleaved rounds]
# Every figure is the fastest timing over several rounds, not their median; a compute timing is the
# mean of a loop of calls (collectives in a step are the exception: the mean of every timing, see
# [Note: collectives in a step]). On a shared machine other
# processes only ever add time, and by how much depends on their load at that moment: runs of
# this calibration at load 5 on 2 cores gave medians up to 2x apart, the fastest times
# typically 15% apart. The fastest time is the figure of the machine, the median one of its load.
# Probes are timed in interleaved rounds (every probe once a round), so a busy spell slows one
# round of every probe, not every timing of one; and a benchmark that adds its own probes to
# the calibration's rounds (`measure_job`) compares prediction and measurement under one load.


@dataclass(frozen=True, kw_only=True, slots=True)
class Probe:
    """One thing to time."""

    call: Callable[[], object]
    loop: bool
    """Time a loop of calls lasting _MIN_TIMING_S (short compute ops), its count chosen by each rank;
    False for collectives, of which every rank must make the same number of calls."""
    timings_per_round: int = 1
    """Timings a round takes of this probe."""
    figure: Callable[[list[float]], float] = min
    """The probe's figure from all its timings, every round's: the fastest (a cost of its own, which
    other work only lengthens), or their mean (a cost whose spread is the thing measured: collectives
    in a step)."""
    before: Callable[[], object] | None = None
    """Untimed work every timing starts with, after the ranks' barrier (see [Note: collectives in a step])."""


def matmul_probe(m: int, k: int, n: int, dtype: str, device: torch.device) -> Probe:
    """One (m x k) @ (k x n) matmul."""
    a = torch.randn(m, k, dtype=torch_dtype(dtype), device=device)
    b = torch.randn(k, n, dtype=torch_dtype(dtype), device=device)
    return Probe(call=lambda: torch.mm(a, b), loop=True)


# [Note: collectives in a step]
# A collective's own cost is timed with the ranks arriving together (a barrier, then the call,
# back to back): stable to a few percent between calibrations, and what alpha-beta fits. Inside
# a training step the same call takes longer on average: the ranks reach it at different moments,
# communication threads wake late, its buffers have left the caches. Here a 1 MB gloo all-gather
# took 0.3 ms back to back and, after 2 ms of compute, a median of 0.75 ms, with a quarter of the
# timings at 3-5 ms (a scheduler time slice): a heavy tail no single size's figure reproduces
# from one calibration to the next. So a few sizes are also timed after _COMPUTE_BEFORE_S of
# matmuls on every rank (the same count of them on each: a rank timing its loop count alone, its first
# calls slow, picked 1 where the other picked 8, and the other's extra 2 ms read as the wait), 8
# timings a round, and the mean of all of them less the fitted own cost is the link's in_step_wait_s,
# a latency the cost model adds to each collective (and pipeline send) of a step (whole-step
# predictions check it: docs/benchmarks.md).
# The wait grows with size (on 2 CPU ranks about 0.5 ms each time the size doubles from 0.4 to 6 MB,
# flat and noisy past it to 24 MB), and compute that streams memory before it (copies of 64 MB) waits
# about 1 ms longer at every size than the matmuls; priced by size, or after copies, neither moved the
# five Hugging Face architectures' steps toward their measurements (benchmarks/bench_in_step.py,
# docs/benchmarks.md), so the figure stays one mean after matmuls.
_COMPUTE_BEFORE_S = 2e-3
"""Compute before each in-step collective timing: about one transformer layer's forward on a CPU rank."""


def collective_probes(
    points: "list[tuple[str, int]]", device: torch.device, *, in_step: bool = False
) -> dict[tuple, Probe]:
    """One probe per (kind, full buffer bytes), on float32 views of one buffer pair (the largest size's),
    keyed (kind, bytes), or ("in step", kind, bytes) when each timing follows compute
    ([Note: collectives in a step]).

    Collectives under 32 MiB are timed several times a round (up to 8): they are cheap, and the more
    timings the less one moment of the scheduler's jitter weighs (the figure is the fastest timing).
    In a step every size is timed _IN_STEP_TIMINGS times a round, and the figure is the mean of all.
    """
    world_size = dist.get_world_size()
    for kind, nbytes in points:
        if nbytes % (4 * world_size):
            raise ValueError(
                f"{kind} of {nbytes} bytes does not split into {world_size} float32 shards"
            )
    full = torch.zeros(max(nbytes for _, nbytes in points) // 4, device=device)
    shard = torch.zeros(full.numel() // world_size, device=device)
    compute = _compute_lasting(_COMPUTE_BEFORE_S, device) if in_step else None
    return {
        (IN_STEP, kind, nbytes) if in_step else (kind, nbytes): Probe(
            call=collective_call(kind, full[: nbytes // 4], shard[: nbytes // 4 // world_size]),
            loop=False,
            timings_per_round=_IN_STEP_TIMINGS if in_step else min(8, max(1, 32 * _MIB // nbytes)),
            before=compute,
            figure=statistics.fmean if in_step else min,
        )
        for kind, nbytes in points
    }


_IN_STEP_TIMINGS = 8
IN_STEP = "in step"
"""First item of an in-step collective probe's key."""


def _compute_lasting(
    seconds: float, device: torch.device, work: Callable[[], object] | None = None
) -> Callable[[], None]:
    """Calls of `work` (default: a 256 x 256 matmul) that take about `seconds`, the same count of them on every
    rank (the largest any rank needs: agreed by an all-reduce, so every rank of the world calls this)."""
    work = work or matmul_probe(256, 256, 256, "float32", device).call
    counts = torch.tensor(_loop_count(work, device, seconds), device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    count = int(counts)

    def compute() -> None:
        for _ in range(count):
            work()

    return compute


def time_probes_s(
    probes: dict,
    device: torch.device,
    rounds: int,
    report=lambda text: None,
    on_round=lambda figures, rounds_done: None,
) -> dict:
    """Seconds of one call of each probe, its `figure` of its timings over `rounds` interleaved rounds;
    `report` after each round, and `on_round` with the figures of the rounds so far.

    All ranks start every timing together (a barrier before it), as ranks compute and communicate in training.
    """
    loops = {}
    for key, probe in probes.items():
        dist.barrier()
        probe.call()  # warm up: buffers, connections, kernels, the autograd graph's first node
        loops[key] = _loop_count(probe.call, device) if probe.loop else 1
    timings_s: dict = {key: [] for key in probes}
    for round_index in range(rounds):
        for key, probe in probes.items():
            for _ in range(probe.timings_per_round):
                dist.barrier()
                if probe.before is not None:
                    probe.before()
                synchronize(device)
                start = time.perf_counter()
                for _ in range(loops[key]):
                    probe.call()
                synchronize(device)
                timings_s[key].append((time.perf_counter() - start) / loops[key])
        on_round(
            {key: probe.figure(timings_s[key]) for key, probe in probes.items()}, round_index + 1
        )
        report(f"round {round_index + 1} of {rounds}")
    return {key: probe.figure(timings_s[key]) for key, probe in probes.items()}


def _loop_count(call, device: torch.device, seconds: float = _MIN_TIMING_S) -> int:
    """Calls per timing: doubled until a loop lasts `seconds` (as timeit's autorange)."""
    count = 1
    while True:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(count):
            call()
        synchronize(device)
        if time.perf_counter() - start >= seconds:
            return count
        count *= 2


def measure_job(
    device: torch.device,
    report,
    rounds: int,
    sweep: Sweep | None,
    build_probes: "Callable[[torch.device], dict] | None" = None,
    partial: "Callable[[Measurements, int], None] | None" = None,
) -> tuple[Measurements | None, dict]:
    """Rank job (see run_world): the calibration of `sweep` and the probes of `build_probes`, in the same rounds.

    Returns the calibration's Measurements (None without a sweep) and the other probes' figures (seconds).
    `partial(measurements, rounds_done)` hears the sweep's Measurements so far (without op calls) after each round.
    """
    probes = _calibration_probes(sweep, device) if sweep else {}
    extra = build_probes(device) if build_probes else {}
    every = probes | extra
    ordered = {key: every[key] for key in sorted(every, key=_timing_order)}

    def on_round(figures: dict, rounds_done: int) -> None:
        if sweep and partial:
            partial(_measurements(sweep, figures, (), device), rounds_done)

    seconds = time_probes_s(ordered, device, rounds, report, on_round)
    measurements = None
    if sweep:
        workloads = op_workloads(device)
        op_calls = time_op_calls_s(
            workloads,
            device,
            rounds,
            report,
            steps=[training_step_kernels(entry.model) for entry in workloads],
        )
        measurements = _measurements(sweep, seconds, op_calls, device)
    return measurements, {key: seconds[key] for key in extra}


def measure_steps(rounds: int, sweep: Sweep | None) -> int:
    """Progress reports measure_job makes: a round of probes, and with a sweep a round of op workloads."""
    return rounds * (2 if sweep else 1)


def _timing_order(key) -> tuple:
    """Compute probes first, then collectives by size: a calibration size and a benchmark size
    next to it are timed back to back, at one moment of the machine's load."""
    if isinstance(key, tuple) and key[0] in COLLECTIVES:
        return (1, key[1], key[0])
    if isinstance(key, tuple) and key[0] == IN_STEP:
        return (1, key[2], f"{IN_STEP} {key[1]}")
    return (0, 0, str(key))


_TRAINING_OP_LENGTH = 32
"""Multiplies in one call of training_op_probe: enough that the call's own cost is spread thin."""
_TRAINING_OP_KERNELS = 2 * _TRAINING_OP_LENGTH + 2
"""Kernels of one call of training_op_probe: each multiply's forward and backward, the backward's
seed gradient and the accumulation into the leaf's (tests/test_calibrate.py counts them)."""


def training_op_probe(device: torch.device) -> Probe:
    """Forward and backward of _TRAINING_OP_LENGTH multiplies of one element: the fixed cost of a
    kernel in a training step (dispatch, autograd's node and its engine, launch) times
    _TRAINING_OP_KERNELS. A bare op (`one + one`) took half of it here (1.7 against 3.6 us on CPU)."""
    one = torch.ones(1, device=device, requires_grad=True)

    def call() -> None:
        value = one
        for _ in range(_TRAINING_OP_LENGTH):
            value = value * 1.0
        value.backward()

    return Probe(call=call, loop=True)


# [Note: selective checkpointing's modes]
# Selective checkpointing (torch.utils.checkpoint's create_selective_checkpoint_contexts, as
# runtime/activation_checkpoint.py runs it) wraps a block's forward in a Python dispatch mode that
# asks its policy about every op and stores the outputs it keeps, and its recompute in another that
# hands them back: every op the forward dispatches, views included, passes through Python twice.
# On a CPU rank that took about 40 us an op in a Llama layer of 4 x 128 tokens, hidden 256 (74 ops:
# 3 ms more on a 30 ms forward and backward, of which the re-run ops' own time is 0.9 ms), ten
# times a kernel's fixed cost in a training step; the modes' cost depends on the op (a linear's
# arguments and kept outputs cost more than a one-element multiply's, 20 us an op in a chain of
# those), so the probe is a transformer layer (the zoo GPT's, on tiny tensors: 32 ops, 35 us each
# here; a tiny Llama layer's read 26), forward and backward with and without selective
# checkpointing. The difference, less the re-run of the ops it does not keep (each a bare call's
# fixed cost), over the ops the forward dispatched, is the profile's selective_op_overhead_s.
# SELECTIVE_ALTERNATE runs the same modes (its policy counts matmuls, a Python increment beside the
# dispatch), so it pays the same overhead an op; the matmuls it re-runs are priced as ops.
def selective_op_probes(device: torch.device) -> dict[str, Probe]:
    """A tiny transformer layer forward and backward with ("selective") and without ("selective plain")
    selective checkpointing ([Note: selective checkpointing's modes])."""
    from shardplan.runtime.activation_checkpoint import checkpointed

    layer, x = _selective_probe_layer(device)
    selective = checkpointed(layer.forward, Checkpoint.SELECTIVE)
    return {
        "selective": Probe(call=lambda: selective(x).sum().backward(), loop=True),
        "selective plain": Probe(call=lambda: layer(x).sum().backward(), loop=True),
    }


def _selective_probe_layer(device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    from shardplan.models import zoo

    config = zoo.GPTConfig(vocab_size=64, seq_len=16, n_layer=1, n_head=2, d_model=32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layer = zoo.TransformerBlock(config).to(device)
        return layer, torch.randn(
            1, config.seq_len, config.d_model, device=device, requires_grad=True
        )


class _OpCount(TorchDispatchMode):
    """Ops dispatched (metadata queries not counted, as the analysis counts Block.fwd_dispatches) and
    kernels selective checkpointing re-runs."""

    def __init__(self) -> None:
        super().__init__()
        self.dispatches = self.rerun = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if is_dispatch(func):
            self.dispatches += 1
            self.rerun += is_kernel(func) and not kept_by_selective(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@functools.cache
def _selective_probe_ops() -> tuple[int, int]:
    """(ops dispatched, kernels re-run) by one forward of the probe's layer."""
    layer, x = _selective_probe_layer(torch.device("cpu"))
    count = _OpCount()
    with count:
        layer(x)
    return count.dispatches, count.rerun


def selective_op_overhead_s(seconds: dict) -> float:
    """The profile's selective_op_overhead_s from the probes' figures ([Note: selective checkpointing's modes])."""
    dispatches, rerun = _selective_probe_ops()
    extra_s = seconds["selective"] - seconds["selective plain"] - rerun * seconds["bare op"]
    return max(0.0, extra_s / dispatches)


# [Note: views' fixed cost]
# A view (view, transpose, expand, permute, a split's pieces) runs no kernel, so the cost model's op
# kinds price it nothing; on a CPU rank each still costs the host, forward and backward, what a
# one-element multiply's kernel does (2.5 us here in one process): Python's call, the dispatcher,
# autograd's view tracking, and in backward a view of its gradient. T5 dispatches 311 of them a
# forward beside 525 kernels (Llama 125 beside 210), and full checkpointing dispatches them again.
# So the calibration times a chain of _VIEW_PROBE_LENGTH transposes of a tiny leaf forward and
# backward, with and without the chain; the difference over its dispatches, one each way a
# transpose, is the profile's view_overhead_s (1.2-1.5 us on 2 ranks here), which the cost model
# charges each dispatch no op kind prices (cost.unpriced_dispatches) in forward, in backward and in
# recompute.
_VIEW_PROBE_LENGTH = 32


def view_probes(device: torch.device) -> dict[str, Probe]:
    """A tiny leaf's sum, forward and backward, after ("views") and without ("views plain") a chain of
    _VIEW_PROBE_LENGTH transposes ([Note: views' fixed cost])."""
    leaf = torch.ones(2, 2, device=device, requires_grad=True)

    def views() -> None:
        value = leaf
        for _ in range(_VIEW_PROBE_LENGTH):
            value = value.t()
        value.sum().backward()

    return {
        "views": Probe(call=views, loop=True),
        "views plain": Probe(call=lambda: leaf.sum().backward(), loop=True),
    }


def view_overhead_s(seconds: dict) -> float:
    """The profile's view_overhead_s from the probes' figures: one view dispatch, forward or backward."""
    return max(0.0, (seconds["views"] - seconds["views plain"]) / (2 * _VIEW_PROBE_LENGTH))


def _calibration_probes(sweep: Sweep, device: torch.device) -> dict:
    probes: dict[tuple | str, Probe] = {
        ("matmul", dtype, n, n, n): matmul_probe(n, n, n, dtype, device)
        for dtype in sweep.dtypes
        for n in sweep.matmul_sizes
    }
    source = torch.empty(sweep.copy_bytes // 4, device=device)
    target = torch.empty_like(source)
    probes["copy"] = Probe(call=lambda: target.copy_(source), loop=True)
    probes["op"] = training_op_probe(device)
    one = torch.ones(1, device=device)
    probes["bare op"] = Probe(call=lambda: one + one, loop=True)
    points = [(kind, nbytes) for kind in COLLECTIVES for nbytes in sweep.collective_sizes_bytes]
    in_step = [(kind, nbytes) for kind in COLLECTIVES for nbytes in sweep.in_step_sizes_bytes]
    return (
        probes
        | selective_op_probes(device)
        | view_probes(device)
        | collective_probes(points, device)
        | collective_probes(in_step, device, in_step=True)
    )


def _measurements(
    sweep: Sweep, seconds: dict, op_calls: tuple, device: torch.device
) -> Measurements:
    on_cpu = device.type == "cpu"
    return Measurements(
        device_name=_cpu_name() if on_cpu else torch.cuda.get_device_name(device),
        backend=dist.get_backend(),
        world_size=dist.get_world_size(),
        # CPU ranks share the host's memory; a GPU rank owns its device.
        device_memory_bytes=(
            _host_memory_bytes() // dist.get_world_size()
            if on_cpu
            else torch.cuda.get_device_properties(device).total_memory
        ),
        devices_per_node=(os.cpu_count() or 1) if on_cpu else torch.cuda.device_count(),
        matmul_s={
            dtype: tuple(
                (2.0 * n**3, seconds["matmul", dtype, n, n, n]) for n in sweep.matmul_sizes
            )
            for dtype in sweep.dtypes
        },
        copy_bytes=sweep.copy_bytes,
        copy_s=seconds["copy"],
        op_overhead_s=seconds["op"] / _TRAINING_OP_KERNELS,
        kernel_overhead_s=seconds["bare op"],
        selective_op_overhead_s=selective_op_overhead_s(seconds),
        view_overhead_s=view_overhead_s(seconds),
        collective_s={
            kind: tuple((nbytes, seconds[kind, nbytes]) for nbytes in sweep.collective_sizes_bytes)
            for kind in COLLECTIVES
        },
        in_step_collective_s={
            kind: tuple(
                (nbytes, seconds[IN_STEP, kind, nbytes]) for nbytes in sweep.in_step_sizes_bytes
            )
            for kind in COLLECTIVES
        },
        op_calls=op_calls,
    )


def collective_call(kind: str, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False):
    """`kind` on these buffers (`full` the world's, `shard` a rank's): a callable that runs it, or with
    `async_op` issues it and returns its work handle."""
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, async_op=async_op)
    function = getattr(dist, _SINGLE_NAMES[kind], None) or getattr(dist, kind)
    output, input = (full, shard) if kind == "all_gather_into_tensor" else (shard, full)
    return lambda: function(output, input, async_op=async_op)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass  # not Linux: fall back to what platform knows
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _choose_backend(backend: str | None, world_size: int) -> str:
    if world_size < 2:
        raise HardwareError(
            f"calibrating collectives needs at least 2 ranks, got world_size={world_size}: "
            "pass --world-size 2 or more"
        )
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < world_size:
        fix = f"pass --world-size {gpus}, or " if gpus >= 2 else ""
        raise HardwareError(
            f"NCCL calibration at world_size={world_size} needs {world_size} GPUs, this machine "
            f"has {gpus}: {fix}pass --backend gloo to measure the CPU"
        )
    if backend not in ("gloo", "nccl"):
        raise HardwareError(f"unknown backend {backend!r}: use 'gloo' (CPU) or 'nccl' (GPUs)")
    return backend
