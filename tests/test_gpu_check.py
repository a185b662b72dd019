"""benchmarks/gpu_check.py on CPU (gloo, its tiny size): the code a lent GPU runs keeps working between those days."""

import argparse
import json
import math
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "benchmarks", "gpu_check.py")


@pytest.mark.distributed
@pytest.mark.slow
def test_every_kind_is_measured_on_both_backends_beside_its_prediction(tmp_path, gpu_check):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, SCRIPT, "--cpu", "--warmup", "1", "--steps", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TRANSFORMERS_VERBOSITY": "error"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    document = json.loads(out.read_text())
    rows = document["rows"]
    kinds = [f"{strategy.value}/{checkpoint.value}" for strategy, checkpoint in gpu_check.KINDS]
    assert [(row["kind"], row["backend"]) for row in rows] == [
        (kind, backend) for kind in kinds for backend in gpu_check.BACKENDS
    ]
    assert [row["error"] for row in rows] == [None] * len(rows)
    for row in rows:
        assert row["allocated_bytes"] > 0 and row["predicted_bytes"] > 0
        assert row["reserved_bytes"] is None  # no caching allocator on CPU
        assert math.isfinite(row["allocated_ratio"]) and math.isfinite(row["time_ratio"])
        assert len(row["step_times_s"]) == 2 and row["measured_s"] > 0
    assert document["process_group"] == "gloo" and document["device"] == "cpu"
    assert document["precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    printed = [line.split() for line in done.stdout.splitlines()]
    assert sum(
        1
        for cells in printed
        if cells[:2] in ([kind, backend] for kind in kinds for backend in gpu_check.BACKENDS)
    ) == len(rows)
    assert "failed: -" in done.stdout


@pytest.mark.slow
def test_a_kind_that_fails_prints_its_error_and_the_next_is_measured(
    tmp_path, gpu_check, world_of_one, capsys
):
    import torch

    runs, _ = gpu_check.planned_runs(gpu_check.CPU_SIZE, "cpu-gloo")
    broken = gpu_check.Run(
        kind="broken", backend="shardplan", plan_json="[]", predicted_bytes=1, predicted_s=1.0
    )
    out = tmp_path / "out.json"
    gpu_check.check_job(
        torch.device("cpu"),
        None,
        [broken, runs[0]],
        gpu_check.CPU_SIZE,
        1,
        1,
        str(out),
        {"rows": []},
    )
    failed, measured = json.loads(out.read_text())["rows"]
    assert failed["error"].startswith("PlanError: plan file must hold a JSON object")
    assert measured["error"] is None and measured["allocated_bytes"] > 0
    printed = capsys.readouterr()
    assert "failed: PlanError" in printed.out and "Traceback" in printed.err


def test_a_rank_that_dies_costs_only_its_own_kind(tmp_path, gpu_check, monkeypatch):
    """A crash no exception reaches (a segfault, an aborted NCCL communicator) ends the world: the run it was
    on is recorded as failed and the rest are measured in a new world."""
    runs = [
        gpu_check.Run(
            kind=f"kind {index}",
            backend="shardplan",
            plan_json="{}",
            predicted_bytes=100,
            predicted_s=1.0,
        )
        for index in range(3)
    ]
    worlds = []

    def run_world(job, args, **_):
        remaining, out, document = args[0], args[4], args[5]
        worlds.append([run.kind for run in remaining])
        row = dict(
            gpu_check.failed_row(remaining[0], ""), error=None, allocated_bytes=50, elapsed_s=1.0
        )
        document["rows"].append(row)
        with open(out, "w") as handle:
            json.dump(document, handle)
        if len(worlds) == 1:
            raise RuntimeError("process 0 terminated with signal SIGSEGV")

    monkeypatch.setattr(gpu_check, "run_world", run_world)
    options = argparse.Namespace(out=str(tmp_path / "out.json"), warmup=1, steps=1)
    document = gpu_check.measure_all(runs, gpu_check.CPU_SIZE, options, {"rows": []}, "gloo")
    assert worlds == [["kind 0", "kind 1", "kind 2"], ["kind 2"]]
    assert [(row["kind"], row["error"] is None) for row in document["rows"]] == [
        ("kind 0", True),
        ("kind 1", False),
        ("kind 2", True),
    ]
    assert "SIGSEGV" in document["rows"][1]["error"]
    assert json.loads((tmp_path / "out.json").read_text()) == document
    assert "failed: kind 1 on shardplan" in gpu_check.summary(document["rows"])


def test_the_gpu_size_is_a_1b_llama_built_without_memory(gpu_check):
    entry = gpu_check.workload(gpu_check.GPU_SIZE).build()
    assert all(parameter.is_meta for parameter in entry.model.parameters())
    assert sum(parameter.numel() for parameter in entry.model.parameters()) == 1_104_218_112
