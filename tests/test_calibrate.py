"""Calibration: the fits on hand-made timings, and one quick calibration of this machine at world 2."""

import math
import os

import pytest
import torch

from shardplan.calibration.calibrate import (
    Measurements,
    calibrate,
    fit_collective,
    fit_matmul,
    fit_profile,
)
from shardplan.calibration.op_factors import fit_op_factors, time_op_calls_s
from shardplan.cli.main import main
from shardplan.costmodel.hardware import COLLECTIVES, HardwareProfile, get_hardware
from shardplan.errors import HardwareError
from shardplan.models import zoo

MIB = 2**20


def test_fit_collective_recovers_alpha_beta():
    latency_s, bandwidth = 2e-4, 1.5e9
    points = [(2.0**p, latency_s + 2.0**p / bandwidth) for p in range(12, 29, 2)]
    cost = fit_collective(points)
    assert cost.latency_s == pytest.approx(latency_s, rel=1e-6)
    assert cost.bus_bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert all(factor == pytest.approx(1.0, rel=1e-6) for _, factor in cost.correction.points)


def test_fit_collective_correction_reproduces_a_cache_cliff():
    """Past 32 MiB this 'machine' moves bytes at a third of the speed: no line fits, the correction does."""

    def measured_s(bus_bytes):
        return 1e-4 + bus_bytes / 3e9 + max(0.0, bus_bytes - 32 * MIB) * 2 / 3e9

    points = [(2.0**p, measured_s(2.0**p)) for p in range(12, 29, 2)]
    cost = fit_collective(points)
    for bus_bytes, seconds in points:
        assert cost.time_s(bus_bytes) == pytest.approx(seconds, rel=1e-9)
    # Between measured sizes the prediction lies between its neighbours.
    assert measured_s(2.0**25) < cost.time_s(2.0**26) < measured_s(2.0**27)


def test_fit_collective_rejects_bad_timings():
    with pytest.raises(HardwareError, match="at least 2 distinct sizes"):
        fit_collective([(4096, 1e-4)])
    with pytest.raises(HardwareError, match="do not grow with size"):
        fit_collective([(4096, 1e-3), (2**20, 1e-3), (2**24, 1e-3)])


def test_fit_matmul_peak_and_efficiency():
    overhead_s = 1e-6
    # (FLOPs, seconds): rates after the overhead are 1e10, 4e10, 5e10 FLOP/s.
    points = [
        (1e5, 1e5 / 1e10 + overhead_s),
        (1e7, 1e7 / 4e10 + overhead_s),
        (1e9, 1e9 / 5e10 + overhead_s),
    ]
    rate = fit_matmul(points, overhead_s)
    assert rate.peak_flops_per_s == pytest.approx(5e10)
    assert [f for _, f in rate.efficiency.points] == pytest.approx([0.2, 0.8, 1.0])
    with pytest.raises(HardwareError, match="no longer than an empty op"):
        fit_matmul([(1e3, 5e-7)], overhead_s)


def test_fit_matmul_efficiency_never_falls_with_size():
    # rates 4e10, 5e10, then 2.5e10 FLOP/s at the largest size (a busy machine): that size keeps 5e10
    points = [(1e7, 1e7 / 4e10), (1e9, 1e9 / 5e10), (1e10, 1e10 / 2.5e10)]
    rate = fit_matmul(points, 0.0)
    assert rate.peak_flops_per_s == pytest.approx(5e10)
    assert [f for _, f in rate.efficiency.points] == pytest.approx([0.8, 1.0, 1.0])


def hand_made_measurements() -> Measurements:
    sizes = [4096 * 4**i for i in range(9)]
    # gloo's reduce_scatter_tensor is an all_reduce plus a slice: it takes the all_reduce's time.
    all_reduce = tuple((n, 3e-4 + n / 1e9) for n in sizes)
    return Measurements(
        device_name="test cpu",
        backend="gloo",
        world_size=2,
        device_memory_bytes=8 * 2**30,
        devices_per_node=2,
        matmul_s={"float32": ((2e6, 2e6 / 5e10 + 2e-6), (2e9, 2e9 / 1e11 + 2e-6))},
        copy_bytes=256 * MIB,
        copy_s=256 * MIB * 2 / 20e9,
        op_overhead_s=5e-6,
        kernel_overhead_s=2e-6,
        collective_s={
            "all_gather_into_tensor": tuple((n, 2e-4 + n / 2e9) for n in sizes),
            "reduce_scatter_tensor": all_reduce,
            "all_reduce": all_reduce,
        },
        # inside a step, each collective takes 1 ms more at one size, 3 ms more at another: 2 ms on average
        in_step_collective_s={
            "all_gather_into_tensor": ((sizes[3], 1e-3 + 2e-4 + sizes[3] / 2e9),),
            "all_reduce": ((sizes[5], 3e-3 + 3e-4 + sizes[5] / 1e9),),
        },
        op_calls=(("gelu", 0, 4 * MIB, 2e-6 + 2.5 * 4 * MIB / 20e9),),
    )


def test_fit_profile_from_hand_made_measurements():
    profile = fit_profile(hand_made_measurements())
    assert profile.memory_bandwidth_bytes_per_s == pytest.approx(20e9)
    assert profile.matmul["float32"].peak_flops_per_s == pytest.approx(1e11)
    costs = profile.intra_node.collectives
    # World 2: bus bytes are nbytes / 2 for all_gather and reduce_scatter, nbytes for all_reduce.
    assert costs["all_gather_into_tensor"].bus_bandwidth_bytes_per_s == pytest.approx(1e9)
    assert costs["all_reduce"].bus_bandwidth_bytes_per_s == pytest.approx(1e9)
    # The emulated reduce_scatter moves the all_reduce's bytes in half the ring factor: half the bandwidth.
    assert costs["reduce_scatter_tensor"].bus_bandwidth_bytes_per_s == pytest.approx(0.5e9)
    for kind in COLLECTIVES:
        for nbytes, seconds in hand_made_measurements().collective_s[kind]:
            assert profile.collective_time_s(kind, nbytes, 2, in_step=False) == pytest.approx(
                seconds
            )
            assert profile.collective_time_s(kind, nbytes, 2) == pytest.approx(seconds + 2e-3)
    assert "gloo world 2" in profile.source and "1 thread" in profile.source
    assert {name: curve.points for name, curve in profile.op_time_factors.items()} == {
        "gelu": ((pytest.approx(4 * MIB / 20e9), pytest.approx(2.5)),)
    }
    assert HardwareProfile.from_json(profile.to_json()) == profile


def _in_step_compute_job(device, report):
    """Rank job: _compute_lasting asked for 1 ms on rank 0 and 40 ms on rank 1; the calls each rank's compute makes,
    gathered on rank 0."""
    from shardplan.calibration.calibrate import _compute_lasting, matmul_probe

    calls = [0]
    matmul = matmul_probe(256, 256, 256, "float32", device).call

    def work():
        calls[0] += 1
        matmul()

    compute = _compute_lasting(1e-3 if torch.distributed.get_rank() == 0 else 40e-3, device, work)
    calls[0] = 0  # the calls that chose the count are not the compute's
    compute()
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, calls[0])
    return counts


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_the_compute_before_an_in_step_collective_is_the_same_on_every_rank():
    """A rank that picked fewer matmuls (here asked for less; in a calibration, its first calls slow: 1 where
    the other picked 8) reaches the collective first and times the other's extra compute as the wait."""
    from shardplan.runtime.launch import run_world

    counts = run_world(
        _in_step_compute_job, world_size=2, backend="gloo", total_steps=0, progress=False
    )
    assert counts[0] == counts[1], counts  # rank 0 makes the calls rank 1 needs for its 40 ms


def test_measurements_kept_as_json_fit_the_same_profile(tmp_path):
    """bench_hf_memory.py --keep writes a run and its calibration's timings (keep_run); --price --refit reads them
    back and fits the calibration again (kept_run): the same profile, the same measurements."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
    import bench_hf_memory

    measurements = hand_made_measurements()
    profile = fit_profile(measurements)
    measured = [(1000, 0.5), (2000, 0.25)]
    bench_hf_memory.keep_run(
        str(tmp_path), "hf-llama", get_hardware("cpu-gloo"), measured, measurements
    )
    assert bench_hf_memory.kept_run(str(tmp_path), "hf-llama", None, refit=True) == (
        profile,
        measured,
    )
    assert bench_hf_memory.kept_run(str(tmp_path), "hf-llama", None)[0] == get_hardware("cpu-gloo")


def test_refitting_kept_runs_without_their_calibration_timings_says_so_in_one_line(tmp_path):
    """A folder --keep wrote with --profile (or before it wrote timings) has no <name>.calibration.json to refit."""
    import subprocess
    import sys

    (tmp_path / "hf-llama.profile.json").write_text("{}")
    script = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_hf_memory.py")
    done = subprocess.run(
        [sys.executable, script, "--models", "hf-llama", "--price", str(tmp_path), "--refit"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        f"--refit: {tmp_path} holds no calibration timings of hf-llama"
        in done.stderr.splitlines()[-1]
    )


def test_fit_op_factors_by_band_of_roofline_time_over_the_calls_long_enough_to_tell():
    profile = fit_profile(
        hand_made_measurements()
    )  # 20 GB/s, 1e11 FLOP/s, 5 us per kernel in a step
    bare_s = 2e-6  # what a timed call holds beside its work
    calls = [
        ("gelu", 0, 2 * MIB, bare_s + 4 * 2 * MIB / 20e9),  # four times its memory time (105 us)
        ("gelu", 0, 6 * MIB, bare_s + 3 * 6 * MIB / 20e9),  # three times, at 315 us: another band
        ("gelu", 0, 64, 50e-6),  # 64 bytes: its time is fixed cost and noise
        ("mm", 2e9, 12 * MIB, bare_s + 1.1 * 2e9 / 1e11),  # arithmetic-bound, 10% under the peak
        ("copy_", 0, 4 * MIB, 1e-8),
    ]  # timed under a bare call: the floor
    factors = fit_op_factors(profile, calls, bare_s)
    points = {name: curve.points for name, curve in factors.items()}
    assert points == {
        "gelu": (
            (pytest.approx(2 * MIB / 20e9), pytest.approx(4.0)),
            (pytest.approx(6 * MIB / 20e9), pytest.approx(3.0)),
        ),
        "mm": ((pytest.approx(2e9 / 1e11), pytest.approx(1.1)),),
        "copy_": ((pytest.approx(4 * MIB / 20e9), 1e-3),),
    }
    assert (
        fit_op_factors(profile, [("add", 0, 64, 1e-5)], bare_s) == {}
    )  # none long enough: roofline stands
    # a larger matmul slowed 3x by other processes takes a smaller one's rate; a GELU may slow with size
    loaded = fit_op_factors(
        profile,
        [
            ("mm", 2e9, 12 * MIB, bare_s + 1.2 * 2e9 / 1e11),  # at the peak's sizes
            ("mm", 2e10, 48 * MIB, bare_s + 3.6 * 2e10 / 1e11),
            ("gelu", 0, 2 * MIB, bare_s + 2 * 2 * MIB / 20e9),
            ("gelu", 0, 16 * MIB, bare_s + 3 * 16 * MIB / 20e9),
        ],
        bare_s,
    )
    assert [factor for _, factor in loaded["mm"].points] == pytest.approx([1.2, 1.2])
    assert [factor for _, factor in loaded["gelu"].points] == pytest.approx([2.0, 3.0])
    # two calls in one band make one point: their summed time over their summed roofline, at their mean
    one_band = fit_op_factors(
        profile,
        [
            ("gelu", 0, 5 * MIB, bare_s + 2 * 5 * MIB / 20e9),
            ("gelu", 0, 6 * MIB, bare_s + 4 * 6 * MIB / 20e9),
        ],
        bare_s,
    )
    assert one_band["gelu"].points == (
        (pytest.approx(5.5 * MIB / 20e9), pytest.approx((10 + 24) / 11)),
    )


def test_training_op_probe_counts_its_kernels():
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardplan.calibration.calibrate import _TRAINING_OP_KERNELS, training_op_probe
    from shardplan.frontend.passes.execution import is_kernel

    class Kernels(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += is_kernel(func)
            return func(*args, **(kwargs or {}))

    probe = training_op_probe(torch.device("cpu"))
    probe.call()  # the first call leaves the leaf's gradient; every timed call then adds to it
    with Kernels() as kernels:
        probe.call()
    assert kernels.count == _TRAINING_OP_KERNELS


def test_op_timing_needs_a_round():
    # what the timed kernels are is checked against the analysis in tests/test_passes.py
    with pytest.raises(HardwareError, match="at least 1 round"):
        time_op_calls_s([zoo.gpt(zoo.GPTConfig(n_layer=1))], torch.device("cpu"), rounds=0)


def test_calibrate_rejects_impossible_worlds():
    with pytest.raises(HardwareError, match="at least 2 ranks, got world_size=1"):
        calibrate(world_size=1)
    with pytest.raises(
        HardwareError, match="needs 2 GPUs, this machine has 0: pass --backend gloo"
    ):
        calibrate(world_size=2, backend="nccl")


MATMULS = ("mm", "addmm", "bmm")


def test_the_medium_sweep_times_every_matmul_and_collective_size_the_demo_can_plan():
    """The demo GPT at its whole replica batch (one micro-batch: its largest calls) and as one unit
    (its largest gather): medium times sizes up to both, on CPU and GPU, in more rounds than quick."""
    from shardplan.calibration.calibrate import sweep_for
    from shardplan.frontend.passes import analyze

    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    largest_call_flops = max(
        kind.flops // kind.calls
        for block in chain.blocks
        for kind in block.fwd_kinds + block.bwd_kinds
        if kind.name in MATMULS
    )
    model_bytes = sum(block.param_bytes for block in chain.blocks)
    medium, quick, full = (sweep_for(mode, "gloo") for mode in ("medium", "quick", "full"))
    assert (
        2 * max(medium.matmul_sizes) ** 3 >= largest_call_flops > 2 * max(quick.matmul_sizes) ** 3
    )
    assert max(medium.collective_sizes_bytes) >= model_bytes
    assert (
        medium.in_step_sizes_bytes == full.in_step_sizes_bytes
        and medium.copy_bytes == full.copy_bytes
    )
    assert quick.rounds < medium.rounds < full.rounds
    assert max(medium.collective_sizes_bytes) < max(
        full.collective_sizes_bytes
    )  # what makes full take minutes
    assert (
        min(sweep_for("medium", "nccl").matmul_sizes) >= 2048
    )  # a GPU's smaller matmuls time the launch
    with pytest.raises(
        HardwareError, match="unknown calibration mode 'slow': use one of quick, medium, full"
    ):
        sweep_for("slow", "gloo")


@pytest.mark.parametrize(
    "flags, mode",
    [
        ([], "full"),
        (["--quick"], "quick"),
        (["--medium"], "medium"),
        (["--mode", "medium"], "medium"),
    ],
)
def test_calibrate_flags_choose_the_mode(flags, mode, tmp_path, monkeypatch):
    import shardplan.calibration.calibrate as calibration

    chosen = []
    monkeypatch.setattr(
        calibration,
        "calibrate",
        lambda **options: chosen.append(options["mode"]) or get_hardware("cpu-gloo"),
    )
    assert main(["calibrate", *flags, "-o", str(tmp_path / "profile.json")]) == 0
    assert chosen == [mode]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_quick_calibration_at_world_2(tmp_path, capsys):
    path = tmp_path / "profile.json"
    assert main(["calibrate", "--quick", "--world-size", "2", "-o", str(path)]) == 0
    assert f"wrote {path}" in capsys.readouterr().out
    profile = get_hardware(path)  # validated on load: every figure positive and finite
    assert profile.name == "calibrated-gloo-cpu"
    assert set(profile.matmul) == {"float32", "bfloat16"}
    for kind in COLLECTIVES:
        seconds = [profile.collective_time_s(kind, n, 2) for n in (4096, 2**20, 2**24)]
        assert all(math.isfinite(s) and s > 0 for s in seconds)
        assert seconds[0] < seconds[2]
    assert 1e8 < profile.matmul["float32"].peak_flops_per_s < 1e13
    assert 1e8 < profile.memory_bandwidth_bytes_per_s < 1e13


@pytest.mark.timeout(60)  # a calibration takes minutes: these are refused before it starts
def test_calibrate_rejects_bad_input_before_measuring(tmp_path, capsys):
    with pytest.raises(
        HardwareError, match=r"sizes \[1002\] bytes do not split into 2 float32 shards"
    ):
        calibrate(world_size=2, sizes=(4096, 1002))
    with pytest.raises(SystemExit):
        main(["calibrate", "-o", str(tmp_path / "missing" / "profile.json")])
    with pytest.raises(SystemExit):
        main(["calibrate", "-o", str(tmp_path)])
    assert (
        f"cannot write {tmp_path}: it is a folder; give a file path inside it"
        in capsys.readouterr().err
    )


def _timing_job(device, report):
    """Rank job: one probe whose calls last 1 ms then 3 ms, after 20 ms of untimed work each, on a clock that moves
    only when the probe says so (a busy machine's scheduler cannot stretch what is asserted)."""
    import itertools
    import statistics
    import types

    from shardplan.calibration import calibrate
    from shardplan.calibration.calibrate import Probe, time_probes_s

    now = [0.0]

    def spend(seconds: float) -> None:
        now[0] += seconds

    calibrate.time = types.SimpleNamespace(
        perf_counter=lambda: now[0]
    )  # this spawned rank's own module
    durations = itertools.cycle((1e-3, 3e-3))

    def probe(**figure):
        return Probe(
            call=lambda: spend(next(durations)),
            loop=False,
            timings_per_round=2,
            before=lambda: spend(20e-3),
            **figure,
        )

    return time_probes_s(
        {"mean": probe(figure=statistics.fmean), "fastest": probe()}, device, rounds=2
    )


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_figure_is_the_fastest_or_the_mean_of_all_timings_and_the_work_before_is_not_timed():
    from shardplan.runtime.launch import run_world

    # each probe: one warm-up call, then rounds of a 1 ms and a 3 ms timing (20 ms of work before each, untimed)
    seconds = run_world(_timing_job, world_size=1, backend="gloo", total_steps=2, progress=False)
    assert seconds["mean"] == pytest.approx(2e-3)
    assert seconds["fastest"] == pytest.approx(1e-3)  # the default figure: the fastest timing


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_calibrate_off_a_terminal_prints_progress_with_time_left_and_a_kill_leaves_a_partial_profile(
    tmp_path,
):
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    output = tmp_path / "profile.json"
    command = [
        str(Path(sys.executable).with_name("shardplan")),
        "calibrate",
        "--quick",
        "-o",
        str(output),
    ]
    run = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines = []
    try:
        for line in run.stderr:
            lines.append(line)
            if " of " in line and "left" in line and line.split("step ")[1].startswith("2 "):
                break
    finally:
        os.killpg(
            run.pid, signal.SIGKILL
        )  # the command and its ranks, as a user's kill -9 of the group
        run.wait(timeout=30)
    text = "".join(lines)
    assert "Traceback" not in text, text
    assert "the time left follows each step" in lines[0] and "profile.partial.json" in lines[0], (
        text
    )  # up front
    assert "calibrating (quick, gloo, world 2), typically under a minute" in lines[0], text
    assert "step 1 of 6 (round 1 of 3):" in text and "about" in text and "left" in text, text
    partial = get_hardware(tmp_path / "profile.partial.json")
    assert (
        "PARTIAL: 2 of 3 rounds" in partial.source
        and partial.matmul["float32"].peak_flops_per_s > 0
    )
    assert not output.exists()
