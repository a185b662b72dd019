"""The examples run as the README and their docstrings say (torchrun, 2 CPU ranks); the plans they
train are written by `shardplan plan`, run in this process (its entry point, main)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardplan.cli.main import main

ROOT = Path(__file__).parent.parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def _run(command: list[str], cwd: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_gpt_under_torchrun(tmp_path):
    assert (
        main(
            [
                "plan",
                "gpt",
                "--world-size",
                "2",
                "--hardware",
                "cpu-gloo",
                "--no-pipeline",
                "-o",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    mesh = json.loads((tmp_path / "plan.json").read_text())["mesh"]
    assert {name: size for name, size in mesh.items() if size != 1} == {"dp_shard": 2}, mesh
    out = _run(
        TORCHRUN + [str(ROOT / "examples" / "train_gpt.py"), "--plan", "plan.json", "--steps", "3"],
        tmp_path,
    )
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_train_gpt_pipelined_from_meta_under_torchrun(tmp_path):
    # 3 MiB a rank: there two stages train faster per sample than data parallelism does (it must recompute)
    assert (
        main(
            [
                "plan",
                "gpt",
                "--world-size",
                "2",
                "--hardware",
                "cpu-gloo",
                "--memory-budget",
                "3MiB",
                "-o",
                str(tmp_path / "plan.json"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "plan.json").read_text())["mesh"]["pp"] == 2
    out = _run(
        TORCHRUN + [str(ROOT / "examples" / "train_gpt.py"), "--plan", "plan.json", "--steps", "4"],
        tmp_path,
    )
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert (
        len(losses) == 4 and all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0]
    )


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_plan_and_train_a_hugging_face_model_from_its_config(tmp_path):
    script = str(ROOT / "examples" / "plan_hf_model.py")
    assert "wrote plan.json" in _run(
        [sys.executable, script, "--world-size", "2", "-o", "plan.json"], tmp_path
    )
    out = _run(
        TORCHRUN + [script, "--world-size", "2", "-o", "plan.json", "--train", "--steps", "2"],
        tmp_path,
    )
    assert out.count("step ") == 2
