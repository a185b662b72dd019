"""The command line, run in-process on small zoo models."""
import json
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest

from shardplan import load_plan
from shardplan.cli import main

SCHEMA = Path(__file__).parent.parent / "shardplan" / "schemas" / "plan.schema.json"


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the zoo GPT: unconstrained, and under a tight budget."""
    folder = tmp_path_factory.mktemp("plans")
    roomy, tight = folder / "roomy.json", folder / "tight.json"
    assert main(["plan", "gpt", "--world-size", "8", "--hardware", "cpu-gloo", "-o", str(roomy)]) == 0
    assert main(["plan", "gpt", "--world-size", "8", "--hardware", "cpu-gloo", "--memory-budget", "2MiB",
                 "-o", str(tight)]) == 0
    return roomy, tight


def test_plan_writes_json_that_validates_against_the_shipped_schema(plans, capsys):
    roomy, _ = plans
    jsonschema.validate(json.loads(roomy.read_text()), json.loads(SCHEMA.read_text()))
    assert load_plan(roomy).world_size == 8


def test_explain_draws_real_pictures(plans, tmp_path, capsys):
    _, tight = plans
    assert main(["explain", str(tight), "--pictures", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "peak memory" in out and "binding" in out
    for name in ("units.png", "memory.png"):
        picture = (tmp_path / name).read_bytes()
        assert picture[:8] == b"\x89PNG\r\n\x1a\n" and len(picture) > 10_000


def test_diff_names_what_changed(plans, capsys):
    roomy, tight = plans
    assert main(["diff", str(roomy), str(tight)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("predicted.peak_bytes: ") for line in lines), lines  # one change per line
    assert main(["diff", str(roomy), str(roomy)]) == 0
    assert capsys.readouterr().out.strip() == "the plans are the same"


def _baseline(tmp_path, **change) -> Path:
    case = {"model": "mlp", "world_size": 2, "hardware": "cpu-gloo"}
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"schema": "shardplan.baseline/1", "tolerance": 0.01, "cases": [case]}))
    assert main(["check", "--baseline", str(path), "--update"]) == 0
    data = json.loads(path.read_text())
    data["cases"][0].update({key: data["cases"][0][key] * factor for key, factor in change.items()})
    path.write_text(json.dumps(data))
    return path


def test_check_passes_on_todays_plans_and_fails_on_a_better_baseline(tmp_path, capsys):
    assert main(["check", "--baseline", str(_baseline(tmp_path))]) == 0
    assert main(["check", "--baseline", str(_baseline(tmp_path, step_time_s=0.5))]) == 1
    err = capsys.readouterr().err
    assert "mlp at world 2" in err and "step_time_s got worse" in err


def test_errors_are_one_line_without_traceback():
    run = subprocess.run([sys.executable, "-m", "shardplan.cli", "plan", "gpt", "--world-size", "2",
                          "--memory-budget", "12 parsecs"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
    assert "cannot read memory size" in run.stderr


def test_unknown_model_names_the_choices(capsys):
    assert main(["plan", "no-such-model", "--world-size", "2"]) == 2
    assert "zoo name" in capsys.readouterr().err


def test_every_command_has_help_with_examples(capsys):
    for command in ("plan", "explain", "diff", "check", "demo"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        assert "examples:" in capsys.readouterr().out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_plans_trains_and_compares(capsys):
    assert main(["demo", "--world-size", "2", "--steps", "1", "--hardware", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    assert "peak memory per rank" in out and "predicted / measured" in out
    losses = [float(x) for x in out.split("loss by step:")[1].split(",")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # warm-up, measured step, timed step


def _refused(argv: list[str], capsys) -> str:
    """stderr of a command that must fail with exit 2 and one line, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardplan: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("budget", ["1e400GiB", "1e30", "0.001", "nan", "inf"])
def test_absurd_budgets_are_refused_with_the_range(budget, capsys):
    err = _refused(["plan", "mlp", "--world-size", "2", "--memory-budget", budget], capsys)
    assert "between 1 B and 1 PiB" in err or "cannot read memory size" in err


@pytest.mark.timeout(60)
def test_a_world_past_the_ceiling_is_refused_at_once(capsys):
    start = time.perf_counter()
    assert "from 1 to 1048576" in _refused(["plan", "mlp", "--world-size", str(2**30)], capsys)
    assert time.perf_counter() - start < 5  # refused before the model is captured


def test_output_to_a_folder_is_refused(tmp_path, capsys):
    err = _refused(["plan", "mlp", "--world-size", "2", "--hardware", "cpu-gloo", "-o", str(tmp_path)], capsys)
    assert "it is a folder; give a file path inside it" in err


@pytest.mark.parametrize("config, message", [
    ("[1, 2]", 'not a JSON object with a "model_type" string'),
    ('"gpt2"', 'not a JSON object with a "model_type" string'),
    ('{"n_layer": 2}', 'not a JSON object with a "model_type" string'),
    ('{"model_type": "no-such-model"}', "does not know"),
    ('{"model_type": "gpt2", "n_layer": "two"}', "n_layer"),
    ('{"model_type": "gpt2", "x": ' + "[" * 5000 + "]" * 5000 + "}", "more than 32 levels deep"),
])
def test_bad_hugging_face_configs_are_refused(config, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(config)
    assert message in _refused(["plan", str(path), "--world-size", "2"], capsys)


@pytest.mark.timeout(60)
def test_explain_reads_within_bounds(capsys):
    assert "larger than 16 MiB" in _refused(["explain", "/dev/zero"], capsys)
