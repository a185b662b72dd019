"""The command line, run in-process on small zoo models."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from shardplan import load_plan
from shardplan.cli.main import main
from shardplan.plan import format_count, mesh_words, unit_labels

SCHEMA = Path(__file__).parent.parent / "shardplan" / "schemas" / "plan.schema.json"


def shardplan(*argv: str, **environment) -> subprocess.CompletedProcess:
    """The installed `shardplan` command, as a user runs it."""
    command = Path(sys.executable).with_name("shardplan")
    return subprocess.run(
        [str(command), *argv],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **environment},
    )


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Two plans of the zoo GPT: unconstrained, and under a tight budget."""
    folder = tmp_path_factory.mktemp("plans")
    roomy, tight = folder / "roomy.json", folder / "tight.json"
    assert (
        main(["plan", "gpt", "--world-size", "8", "--hardware", "cpu-gloo", "-o", str(roomy)]) == 0
    )
    assert (
        main(
            [
                "plan",
                "gpt",
                "--world-size",
                "8",
                "--hardware",
                "cpu-gloo",
                "--memory-budget",
                "2MiB",
                "-o",
                str(tight),
            ]
        )
        == 0
    )
    return roomy, tight


def test_plan_writes_json_that_validates_against_the_shipped_schema(plans, capsys):
    roomy, _ = plans
    jsonschema.validate(json.loads(roomy.read_text()), json.loads(SCHEMA.read_text()))
    assert load_plan(roomy).world_size == 8


def test_explain_shows_shapes_batches_mesh_and_draws_real_pictures(plans, tmp_path):
    _, tight = plans
    run = shardplan("explain", str(tight), "--pictures", str(tmp_path))
    assert run.returncode == 0, run.stderr
    out, plan = run.stdout, load_plan(tight)
    assert "peak memory" in out
    assert f"binding constraint: {plan.reasoning.binding_constraint}" in " ".join(
        out.split()
    )  # a sentence, not a column
    assert f"{plan.mesh.describe()} ({plan.mesh.dp} data-parallel ranks" in out
    assert "4 x 32 int64" in out  # the zoo GPT's token ids: batch 4, sequence 32
    assert f"{plan.mesh.dp * 4} = {plan.mesh.dp} data-parallel ranks x 4" in out
    micro = plan.schedule.num_micro_batches
    assert f"{micro} of {4 / micro:g} per data-parallel rank" in out
    assert "replica" not in out.replace("replicate", "")  # no HSDP here: "replica" names nothing
    limits = ", ".join(
        f"{r.micro_batch}: {'>= ' if r.longest >= 16 * 32 else ''}{r.longest}"
        for r in plan.sequence_limits
    )
    assert plan.sequence_limits and f"by micro-batch size: {limits}" in " ".join(out.split())
    for name in ("units.png", "memory.png"):
        picture = (tmp_path / name).read_bytes()
        assert picture[:8] == b"\x89PNG\r\n\x1a\n" and len(picture) > 10_000


def test_diff_names_what_changed_in_mib_and_ms_by_unit(plans):
    roomy, tight = plans
    run = shardplan("diff", str(roomy), str(tight))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    peak = next(line for line in lines if line.startswith("peak memory: "))  # one change per line
    assert peak.endswith("%)") and peak.count("MiB") == 2, peak
    assert any(line.startswith("step time: ") and line.count(" ms") == 2 for line in lines), lines
    assert any(line.startswith("unit h.") for line in lines), lines  # units named by their modules
    assert not any(line.startswith("units[") for line in lines), lines  # each unit's change once
    assert len(lines) == len(set(lines)), lines
    assert main(["diff", str(roomy), str(roomy)]) == 0


def test_diff_into_a_closed_pipe_exits_quietly(plans):
    roomy, tight = plans
    command = Path(sys.executable).with_name("shardplan")
    process = subprocess.Popen(
        [str(command), "diff", str(roomy), str(tight)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # `| head` that has read all it wanted, before shardplan writes
    _, error = process.communicate(timeout=240)
    assert b"Traceback" not in error and b"BrokenPipe" not in error, error
    assert process.returncode == 141


def _hugging_face_llama_plan():
    """A plan of the zoo's Hugging Face LLaMA, a unit per layer (module paths under model.layers), and its
    parameters' sizes."""
    from shardplan.models import zoo
    from shardplan.runtime.manual import manual_plan

    model = zoo.build("hf-llama").model
    groups = [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]]
    sizes = {name: parameter.numel() for name, parameter in model.named_parameters()}
    return manual_plan(model, groups, dp=2), sizes


def test_units_keep_their_distinguishing_names_at_80_columns_and_count_parameters():
    from rich.console import Console

    from shardplan.cli import report

    plan, sizes = _hugging_face_llama_plan()
    console = Console(width=80, record=True)
    console.print(report.units_table(plan, sizes))
    table = console.export_text()
    assert "model.embed_tokens..layers.0" in table and "model.layers.1..lm_head" in table, table
    assert "…" not in table and "full_shard" in table, table  # no column cut
    first = plan.units[0]
    elements = sum(sizes[name] for name in first.params)
    assert elements > 1000 and format_count(elements) in table  # elements, not tensors
    text = plan.summary(sizes)
    assert format_count(elements) in text and "tensors" not in text
    assert "tensors" in plan.summary()  # without the sizes, the column says what it counts
    assert "2 data-parallel ranks" in text and "units sharded over dp_shard=2" in text


def test_the_mesh_says_when_no_unit_is_sharded():
    from dataclasses import replace

    from shardplan.plan import ShardStrategy

    plan, _ = _hugging_face_llama_plan()
    replicated = replace(
        plan, units=tuple(replace(u, strategy=ShardStrategy.REPLICATE) for u in plan.units)
    )
    assert "every unit replicated: no state is sharded" in mesh_words(replicated)


HUGGING_FACE_CONFIG = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_embd": 32,
    "n_head": 2,
    "vocab_size": 64,
    "n_positions": 512,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


def _baseline(tmp_path, cases: list[dict]) -> Path:
    path = tmp_path / "baseline.json"
    path.write_text(
        json.dumps({"schema": "shardplan.baseline/1", "tolerance": 0.01, "cases": cases})
    )
    return path


def test_check_passes_on_todays_plans_and_fails_on_a_better_baseline(tmp_path, capsys):
    path = _baseline(tmp_path, [{"model": "mlp", "world_size": 2, "hardware": "cpu-gloo"}])
    # a loose run records today's figures, not its tolerance: the gate stays as tight as it was
    assert main(["check", "--baseline", str(path), "--update", "--tolerance", "0.5"]) == 0
    assert main(["check", "--baseline", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["tolerance"] == 0.01
    data["cases"][0]["step_time_s"] *= 0.5
    path.write_text(json.dumps(data))
    assert main(["check", "--baseline", str(path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL mlp at world 2" in out and "step_time_s got worse" in out


@pytest.mark.parametrize(
    "flag, saved, message",
    [
        (
            "nan",
            0.01,
            "--tolerance is nan",
        ),  # NaN would pass every case, and --update would write it
        ("inf", 0.01, "--tolerance is inf"),
        ("-0.5", 0.01, "--tolerance is -0.5"),
        (None, "1%", "field tolerance is '1%'"),
        (None, 10**400, "field tolerance is 1000000000000000000000"),  # past float's range
        (None, True, "field tolerance is True"),
    ],
    ids=["nan", "inf", "negative", "text", "past-float", "bool"],
)
def test_check_refuses_a_tolerance_that_is_not_a_finite_number_from_0(
    flag, saved, message, tmp_path, capsys
):
    path = _baseline(tmp_path, [{"model": "mlp", "world_size": 2, "hardware": "cpu-gloo"}])
    path.write_text(
        path.read_text().replace('"tolerance": 0.01', f'"tolerance": {json.dumps(saved)}')
    )
    before = path.read_text()
    tolerance = [] if flag is None else ["--tolerance", flag]
    err = _refused(["check", "--baseline", str(path), "--update", *tolerance], capsys)
    assert message in err and "finite number, 0 or more" in err
    assert path.read_text() == before


@pytest.mark.parametrize(
    "cases, message",
    [
        (
            [{"model": "mlp", "world_size": 2, "step_time_s": "0.002", "peak_bytes": 1}],
            "case 0 ('mlp') field step_time_s is '0.002': make it a finite number, 0 or more",
        ),
        (
            [{"model": "mlp", "world_size": 2.0}],
            "case 0 ('mlp') field world_size is 2.0: make it a whole number from 1",
        ),
        (
            [
                {"model": "mlp", "world_size": 2},
                {"model": "mlp", "world_size": 2, "peak_bytes": -1},
            ],
            "case 1 ('mlp') field peak_bytes is -1",
        ),
        (
            [{"model": "mlp", "world_size": 2, "memory_budget": 2**20}],
            "field memory_budget is 1048576: make it a string",
        ),
        (
            [{"model": ["mlp"], "world_size": 2}],
            "case 0 (['mlp']) field model is ['mlp']: make it a string",
        ),
        (
            [{"model": "mlp", "world_size": 2, "hardware": None}],
            "field hardware is None: make it a string",
        ),
        (
            [{"model": "mlp"}],
            "case 0 is malformed (Case.__init__() missing 1 required keyword-only argument",
        ),
        (["mlp"], "case 0 is 'mlp': make it an object with model and world_size"),
        ("mlp", "has no cases"),
        ([], "has no cases"),  # a gate of none would pass whatever the planner does
    ],
)
def test_check_refuses_a_malformed_case_naming_it_and_the_field_before_planning(
    cases, message, tmp_path, capsys
):
    path = _baseline(tmp_path, [])
    path.write_text(path.read_text().replace('"cases": []', f'"cases": {json.dumps(cases)}'))
    assert message in _refused(["check", "--baseline", str(path)], capsys)


@pytest.mark.timeout(240)
def test_check_gates_any_model_a_line_per_case_and_a_new_case_asks_for_update(
    tmp_path, monkeypatch, capsys
):
    """A zoo model, a Hugging Face config beside the baseline, and a package.module:factory, all new."""
    (tmp_path / "config.json").write_text(json.dumps(HUGGING_FACE_CONFIG))
    (tmp_path / "my_models.py").write_text(
        "from shardplan.models import zoo\n\ndef build():\n    return zoo.build('mlp')\n"
    )
    cases = [
        {"model": model, "world_size": 2, "hardware": "cpu-gloo"}
        for model in ("mlp", "config.json", "my_models:build")
    ]
    path = _baseline(tmp_path, cases)
    # in this process, not a fresh `shardplan`: the cases are planned in forks of the forkserver the
    # test session started already, which a fresh command would first start and import torch in
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["check", "--baseline", str(path)]) == 1
    new = capsys.readouterr()
    assert "Traceback" not in new.err + new.out, new.err
    fails = [line for line in new.out.splitlines() if line.startswith("FAIL ")]
    assert len(fails) == 3 and all("ms (baseline: not recorded)" in line for line in fails), new.out
    assert new.out.count("run `shardplan check --update` to record them") == 3
    assert main(["check", "--baseline", str(path), "--update"]) == 0
    capsys.readouterr()
    assert main(["check", "--baseline", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" at ")[0] for line in lines[:3]] == [
        "PASS mlp",
        "PASS config.json",
        "PASS my_models:build",
    ]
    assert all("(baseline " in line and "+0.0%" in line for line in lines[:3]), lines
    assert lines[-1] == "3 case(s): 3 passed, 0 failed"


def test_plan_flags_reach_the_planner(tmp_path, capsys):
    output = tmp_path / "plan.json"
    run = shardplan(
        "plan",
        "mlp",
        "--world-size",
        "2",
        "--hardware",
        "cpu-gloo",
        "--no-pipeline",
        "--param-dtype",
        "bfloat16",
        "--reduce-dtype",
        "float32",
        "--optimizer",
        "sgd",
        "--wrap",
        r"layers\.2$",
        "--pin",
        r"layers\.0$=replicate",
        "--global-batch",
        "4",
        "--max-tp",
        "1",
        "-o",
        str(output),
    )
    assert run.returncode == 0, run.stderr
    plan = load_plan(output)
    assert plan.mesh.dp * plan.batch_per_replica == 4
    assert (
        f"inputs per data-parallel rank: input 0: {plan.batch_per_replica} x 64 float32, input 1: "
        f"{plan.batch_per_replica} float32;" in run.stdout
    )  # positional inputs named by their position

    assert (plan.mixed_precision.param_dtype, plan.mixed_precision.reduce_dtype) == (
        "bfloat16",
        "float32",
    )
    assert plan.optimizer == "sgd" and plan.mesh.pp == 1
    assert any(unit.modules[0] == "layers.2" for unit in plan.units)
    assert (
        next(unit for unit in plan.units if "layers.0" in unit.modules).strategy.value
        == "replicate"
    )
    assert "use one of full_shard" in _refused(
        ["plan", "mlp", "--world-size", "2", "--pin", "layers=sideways"], capsys
    )


def test_every_constraint_and_the_unit_size_have_a_flag(tmp_path):
    output = tmp_path / "plan.json"
    run = shardplan(
        "plan",
        "mlp",
        "--world-size",
        "2",
        "--hardware",
        "cpu-gloo",
        "--no-wrap",
        r"layers\.1$",
        "--checkpoint",
        r"layers\.2$=full",
        "--pin",
        r"layers\.3$=full_shard,shard_grad_op",
        "--max-unit-blocks",
        "2",
        "--no-replica-groups",
        "-o",
        str(output),
    )
    assert run.returncode == 0, run.stderr
    units = load_plan(output).units
    assert ("layers.0", "layers.1") in [
        unit.modules for unit in units
    ]  # no unit may start at layers.1
    assert all(len(unit.modules) <= 2 for unit in units)
    assert next(unit for unit in units if "layers.2" in unit.modules).checkpoint.value == "full"
    assert next(unit for unit in units if "layers.3" in unit.modules).strategy.value in (
        "full_shard",
        "shard_grad_op",
    )


def test_stage_cut_flags_and_replica_groups_reach_the_planners_options():
    from shardplan.cli.main import _parser
    from shardplan.cli.plan_flags import plan_options as _plan_options
    from shardplan.solver.space import Constraints

    options = _parser().parse_args(
        [
            "plan",
            "mlp",
            "--world-size",
            "4",
            "--stage-cut",
            r"layers\.2$",
            "--no-stage-cut",
            r"layers\.1$",
            "--no-replica-groups",
            "--no-reasoning",
        ]
    )
    planned = _plan_options(options)
    assert planned["constraints"] == Constraints(
        stage_boundary=(r"layers\.2$",), no_stage_boundary=(r"layers\.1$",)
    )
    assert planned["allow_replica_groups"] is False and planned["max_unit_blocks"] is None
    assert planned["explain"] is False


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--checkpoint", "layers=sometimes"],
            "--checkpoint mode 'sometimes' is unknown: use one of none, full, selective, selective_alternate",
        ),
        (["--checkpoint", "layers"], "is not REGEX=MODE"),
        (["--no-wrap", "("], "--no-wrap '(' is not a regular expression"),
        (["--stage-cut", "no-such-block"], "matches no block"),
        (["--max-unit-blocks", "0"], "max_unit_blocks=0 leaves units no blocks"),
    ],
)
def test_constraint_flags_refuse_bad_values_in_one_line(flags, message, capsys):
    assert message in _refused(
        ["plan", "mlp", "--world-size", "2", "--hardware", "cpu-gloo", *flags], capsys
    )


def test_a_bfloat16_hugging_face_config_warns_that_fp32_masters_are_dropped(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HUGGING_FACE_CONFIG | {"torch_dtype": "bfloat16"}))
    pure = shardplan(
        "plan",
        str(config),
        "--world-size",
        "2",
        "--hardware",
        "cpu-gloo",
        "-o",
        str(tmp_path / "a.json"),
    )
    assert pure.returncode == 0, pure.stderr
    assert (
        "no fp32 master weights; to keep fp32 masters pass --param-dtype bfloat16 --reduce-dtype float32"
        in pure.stderr
    )
    assert (
        "example input at batch 1 and sequence length 512 (pass --batch and --seq for your "
        "training shape)" in pure.stderr
    )
    assert "deprecated" not in pure.stderr  # torch_dtype is read as transformers' dtype
    assert (
        main(
            [
                "plan",
                str(config),
                "--world-size",
                "2",
                "--hardware",
                "cpu-gloo",
                "--batch",
                "2",
                "--seq-len",
                "64",
                "--param-dtype",
                "bfloat16",
                "-o",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    assert "warning" not in capsys.readouterr().err
    mixed = load_plan(tmp_path / "b.json")
    assert mixed.mixed_precision.reduce_dtype == "float32" and mixed.inputs[0].shape[-1] == 64


def test_headroom_keeps_a_share_of_the_memory_free_below_the_default_budget(tmp_path, capsys):
    from shardplan.costmodel.hardware import get_hardware

    profile = get_hardware(
        "cpu-gloo"
    )  # no runtime reserve: the budget is a share of the device's memory
    budgets = {}
    for headroom in (None, "0.5"):
        output = tmp_path / f"{headroom}.json"
        assert (
            main(
                ["plan", "mlp", "--world-size", "2", "--hardware", "cpu-gloo", "-o", str(output)]
                + (["--headroom", headroom] if headroom else [])
            )
            == 0
        )
        budgets[headroom] = load_plan(output).reasoning.budget_bytes
    assert budgets == {
        None: int(profile.device_memory_bytes * profile.usable_memory_fraction),
        "0.5": int(profile.device_memory_bytes * 0.5),
    }
    both = ["plan", "mlp", "--world-size", "2", "--headroom", "0.1", "--memory-budget", "1GiB"]
    assert "pass one of them" in _refused(both, capsys)
    assert "from 0 to below 1" in _refused(
        ["plan", "mlp", "--world-size", "2", "--headroom", "10"], capsys
    )


def test_errors_are_one_line_without_traceback():
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardplan.cli.main",
            "plan",
            "gpt",
            "--world-size",
            "2",
            "--memory-budget",
            "12 parsecs",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert run.stderr.strip().count("\n") == 0 and "Traceback" not in run.stderr
    assert "cannot read memory size" in run.stderr


def test_unknown_model_names_the_choices(capsys):
    assert main(["plan", "no-such-model", "--world-size", "2"]) == 2
    assert "zoo name" in capsys.readouterr().err


def test_every_command_has_help_with_examples(capsys):
    for command in ("plan", "explain", "diff", "export", "check", "calibrate", "demo", "train"):
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        assert "examples:" in capsys.readouterr().out


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_demo_plans_trains_and_compares(capsys):
    assert main(["demo", "--world-size", "2", "--steps", "1", "--hardware", "cpu-gloo"]) == 0
    out = capsys.readouterr().out
    assert (
        "peak memory per rank" in out
        and "predicted / measured" in out
        and "step time (fastest of 1)" in out
    )
    assert "load average" in out  # what a step-time ratio on a shared machine is read against
    losses = [float(x) for x in out.split("loss by step:")[1].split(",")]
    assert len(losses) == 3 and losses[-1] < losses[0]  # warm-up, measured step, timed step


def test_the_demo_compares_the_fastest_step_as_the_calibration_keeps_the_fastest_round():
    from shardplan.cli.demo import Measured, load_note

    measured = Measured(peak_bytes=1, step_times_s=(0.5, 0.3, 0.4), losses=())
    assert measured.step_time_s == 0.3 and measured.mean_step_time_s == pytest.approx(0.4)
    assert load_note(measured).startswith(
        "step times 500, 300, 400 ms (mean 400.0 ms); load average "
    )


def _refused(argv: list[str], capsys) -> str:
    """stderr of a command that must fail with exit 2 and one line, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith("shardplan: error: ") and "Traceback" not in err
    ), err
    return err


@pytest.mark.parametrize("budget", ["1e400GiB", "1e30", "0.001", "nan", "inf"])
def test_absurd_budgets_are_refused_with_the_range(budget, capsys):
    err = _refused(["plan", "mlp", "--world-size", "2", "--memory-budget", budget], capsys)
    assert "between 1 B and 1 PiB" in err or "cannot read memory size" in err


FACTORIES = (
    "from shardplan.models import zoo\n\ndef bare():\n    return zoo.residual_mlp().model\n\n"
    "def pair():\n    entry = zoo.residual_mlp()\n    return entry.model, entry.args\n"
)


@pytest.mark.parametrize(
    "spec, flags, message",
    [
        (
            "gpt",
            ["--seq", "64"],
            "--seq does not apply to zoo model gpt: it takes --batch; leave --seq out",
        ),
        ("mlp", ["--batch", "-2"], "--batch -2 is not a size: give 1 or more"),
        (
            "gpt",
            ["--batch", "0"],
            "--batch 0 is not a size",
        ),  # not a capture error blaming control flow
        (
            "gpt",
            ["--batch", "100000000000"],
            "building gpt at --batch 100000000000 ran out of memory: give a smaller",
        ),
        (
            "config.json",
            ["--batch", "1", "--seq", "0"],
            "--seq 0 is not a size",
        ),  # not silently 512
        (
            "factories:bare",
            [],
            "factory factories:bare returned ResidualMLP: return a zoo.ZooModel or (model, args, kwargs)",
        ),
        (
            "factories:pair",
            [],
            "factory factories:pair returned a tuple of 2: return a zoo.ZooModel",
        ),
        (
            "factories:pair",
            ["--batch", "2"],
            "--batch does not apply to factory factories:pair: it takes neither",
        ),
    ],
)
def test_sizes_and_factories_that_do_not_make_a_model_are_refused(
    spec, flags, message, tmp_path, monkeypatch, capsys
):
    (tmp_path / "config.json").write_text(json.dumps(HUGGING_FACE_CONFIG))
    (tmp_path / "factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert message in _refused(
        ["plan", spec, "--world-size", "2", "--hardware", "cpu-gloo", *flags], capsys
    )


def _forbid(monkeypatch, module, name: str) -> None:
    """Make `module.name` fail the test if it is called: the command must refuse before it gets there."""

    def called(*args, **kwargs):
        raise AssertionError(f"{module.__name__}.{name} was called")

    monkeypatch.setattr(module, name, called)


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_a_demo_of_no_steps_is_refused_before_it_plans(steps, capsys, monkeypatch):
    from shardplan.cli import demo

    _forbid(monkeypatch, demo, "resolve_hardware")  # not after a calibration and a whole demo
    _forbid(monkeypatch, demo, "plan_demo")
    assert f"--steps {steps} trains no step" in _refused(
        ["demo", "--hardware", "cpu-gloo", "--steps", steps], capsys
    )


@pytest.mark.parametrize("world", ["1000000", "0", "-2"])
def test_a_demo_world_past_what_this_machine_runs_is_refused_before_it_plans_or_spawns(
    world, capsys, monkeypatch
):
    from shardplan.cli import demo
    from shardplan.errors import ShardplanError
    from shardplan.runtime import launch

    _forbid(monkeypatch, demo, "plan_demo")
    _forbid(monkeypatch, launch.mp, "start_processes")
    err = _refused(["demo", "--hardware", "cpu-gloo", "--world-size", world], capsys)
    assert (
        f"--world-size {world}: every rank runs as a process on this machine" in err
        and "give 1 to" in err
    )
    with pytest.raises(ShardplanError, match="every rank runs as a process on this machine"):
        launch.run_world(print, world_size=int(world), backend="gloo", total_steps=0)


def test_a_world_past_the_ceiling_is_refused_before_the_model_is_captured(capsys, monkeypatch):
    from shardplan.frontend import passes

    _forbid(monkeypatch, passes, "analyze")
    assert "from 1 to 1048576" in _refused(["plan", "mlp", "--world-size", str(2**30)], capsys)


def test_output_to_a_folder_is_refused(tmp_path, capsys):
    err = _refused(
        ["plan", "mlp", "--world-size", "2", "--hardware", "cpu-gloo", "-o", str(tmp_path)], capsys
    )
    assert "it is a folder; give a file path inside it" in err


@pytest.mark.parametrize(
    "config, message",
    [
        ("[1, 2]", 'not a JSON object with a "model_type" string'),
        ('"gpt2"', 'not a JSON object with a "model_type" string'),
        ('{"n_layer": 2}', 'not a JSON object with a "model_type" string'),
        ('{"model_type": "no-such-model"}', "does not know"),
        ('{"model_type": "gpt2", "n_layer": "two"}', "n_layer"),
        (
            '{"model_type": "gpt2", "x": ' + "[" * 5000 + "]" * 5000 + "}",
            "more than 32 levels deep",
        ),
    ],
)
def test_bad_hugging_face_configs_are_refused(config, message, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(config)
    assert message in _refused(["plan", str(path), "--world-size", "2"], capsys)


@pytest.mark.timeout(60)
def test_explain_reads_within_bounds(capsys):
    assert "larger than 16 MiB" in _refused(["explain", "/dev/zero"], capsys)


@pytest.mark.parametrize(
    "argv", [["calibrate", "--world-size", "1"], ["plan", "no-such-model", "--world-size", "2"]]
)
def test_debug_shows_the_traceback_of_an_error_that_prints_one_line_without_it(
    argv, tmp_path, capsys
):
    from shardplan.errors import ShardplanError

    argv = [*argv, "-o", str(tmp_path / "out.json")]
    assert main(argv) == 2 and "Traceback" not in capsys.readouterr().err
    with pytest.raises(ShardplanError):
        main([*argv, "--debug"])


def test_the_readme_maps_each_fsdp_habit_to_its_shardplan_spelling():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme[readme.index("| FSDP habit | shardplan |") :]
    rows = table[: table.index("\n\n")].splitlines()
    for habit in (
        "auto_wrap_policy",
        "transformer_layer_cls",
        "MixedPrecision",
        "CPUOffload",
        "no_sync",
        "clip_grad_norm_",
        "SHARDED_STATE_DICT",
        "FULL_STATE_DICT",
        "activation_checkpointing",
        "torch.cuda.memory_stats",
    ):
        spelling = next((row.split(" | ")[1] for row in rows if habit in row.split(" | ")[0]), "")
        assert spelling.count("`") >= 2, habit  # a row whose second cell spells it in code


ENDING_FACTORIES = """import os, sys, time
from shardplan.models import zoo

def leaves():
    sys.exit()

def waits():
    time.sleep(3600)

def build():
    return zoo.build("mlp")
"""


@pytest.mark.timeout(300)
def test_check_plans_each_case_apart_and_fails_one_that_ends_its_process_with_the_reason(
    tmp_path, monkeypatch, capsys
):
    """A case whose model's code exits, aborts or never returns is that case's FAIL; the cases after it are still
    checked (the last one for lack of figures), and no case passes unplanned."""
    (tmp_path / "ending_models.py").write_text(ENDING_FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    models = [
        "sys:exit",
        "builtins:quit",
        "os:abort",
        "ending_models:leaves",
        "ending_models:waits",
        "ending_models:build",
    ]
    path = _baseline(
        tmp_path, [{"model": model, "world_size": 2, "hardware": "cpu-gloo"} for model in models]
    )
    assert main(["check", "--baseline", str(path), "--case-timeout", "10"]) == 1
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert [line.split(" at ")[0] for line in lines] == [f"FAIL {model}" for model in models], out
    assert out.count("the planning process exited with status") == 3, out
    assert "the planning process was killed by SIGABRT" in out
    assert "planning took more than 10 s and was stopped" in out
    assert "the baseline has no recorded figures for this case" in out  # the last case was planned
    assert out.splitlines()[-1] == "6 case(s): 0 passed, 6 failed"


def test_a_hugging_face_config_warns_only_of_the_shape_flags_left_out(tmp_path, capfd):
    from shardplan.cli.model_spec import load_model

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**HUGGING_FACE_CONFIG, "torch_dtype": "float32"}))
    heard = []
    load_model(str(config), seq=16, warn=heard.append, shape_flags=("--seq",))
    assert heard == []  # --global-batch sets the batch: no "pass --batch"
    load_model(str(config), warn=heard.append, shape_flags=())
    assert heard == []  # train reads the data's shapes
    load_model(str(config), seq=16, warn=heard.append)
    assert len(heard) == 1 and "--batch" in heard[0] and "--seq" not in heard[0]
    captured = capfd.readouterr()
    assert "deprecated" not in captured.out + captured.err  # torch_dtype read as dtype


def test_batch_help_says_what_the_flag_does_with_a_global_batch(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "largest micro-batch" not in text
    assert "with --global-batch only the shape the model is analyzed at" in text
    assert "the solver chooses the micro-batches" in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "--seq" not in capsys.readouterr().out


def test_a_check_case_is_planned_with_the_flags_plan_takes(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(HUGGING_FACE_CONFIG))
    flags = ["--seq", "64", "--global-batch", "8", "--param-dtype", "bfloat16", "--wrap", r"h\.1$"]
    case = {"model": "config.json", "world_size": 2, "hardware": "cpu-gloo", "flags": flags}
    path = _baseline(tmp_path, [case])
    assert main(["check", "--baseline", str(path), "--update"]) == 0
    written = json.loads(path.read_text())
    assert written["cases"][0]["flags"] == flags
    jsonschema.validate(written, json.loads((SCHEMA.parent / "baseline.schema.json").read_text()))
    out = capsys.readouterr().out
    assert "PASS config.json at world 2 on cpu-gloo, --seq 64 --global-batch 8" in out
    # the figures recorded are those `shardplan plan` predicts with the same flags
    plan_path = tmp_path / "plan.json"
    argv = ["plan", str(config), "--world-size", "2", "--hardware", "cpu-gloo", *flags]
    assert main([*argv, "-o", str(plan_path)]) == 0
    plan = load_plan(plan_path)
    assert written["cases"][0]["peak_bytes"] == plan.predicted.peak_bytes
    assert plan.mixed_precision.param_dtype == "bfloat16" and plan.inputs[0].shape[1] == 64
    assert plan.mesh.dp * plan.batch_per_replica == 8


@pytest.mark.parametrize(
    "case, message",
    [
        ({"flags": ["--sequence", "64"]}, "unrecognized arguments: --sequence 64"),
        ({"flags": ["--world-size", "4"]}, "flag --world-size is the case's field world_size"),
        ({"flags": "--seq 64"}, "field flags is '--seq 64': make it a list of strings"),
        ({"flags": ["--seq", 64]}, "make it a list of strings"),
        ({"planner": "fast"}, "unexpected keyword argument 'planner'"),
    ],
)
def test_check_refuses_a_case_whose_flags_plan_would_not_take(case, message, tmp_path, capsys):
    path = _baseline(tmp_path, [{"model": "mlp", "world_size": 2, **case}])
    err = _refused(["check", "--baseline", str(path)], capsys)
    assert message in err, err


def test_the_baseline_schema_holds_the_committed_baseline_and_refuses_what_check_refuses(tmp_path):
    schema = json.loads((SCHEMA.parent / "baseline.schema.json").read_text())
    committed = Path(__file__).parent.parent / "benchmarks" / "baseline.json"
    jsonschema.validate(json.loads(committed.read_text()), schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(
            {"schema": "shardplan.baseline/1", "cases": [{"model": "mlp", "world_size": 0}]},
            schema,
        )


def test_planning_prints_progress_lines_where_stderr_is_no_terminal(tmp_path, capsys, monkeypatch):
    from shardplan.cli import main as cli

    monkeypatch.setattr(cli, "PROGRESS_FIRST_S", 0.0)
    argv = ["plan", "mlp", "--world-size", "2", "--hardware", "cpu-gloo"]
    assert main([*argv, "-o", str(tmp_path / "plan.json")]) == 0
    err = capsys.readouterr().err
    assert "shardplan: capturing and planning mlp for 2 ranks: 0 s so far" in err, err
    assert "shardplan: capturing and planning mlp for 2 ranks: done in " in err, err


def test_plan_emits_torchtitan_and_accelerate_configs_their_parsers_accept(tmp_path, capsys):
    import tomllib

    output = tmp_path / "plan.json"
    flags = ["--world-size", "8", "--no-reasoning", "--pin", r"lm_head=replicate"]
    argv = ["plan", "hf-llama", *flags, "--emit", "torchtitan", "--emit", "accelerate"]
    assert main([*argv, "-o", str(output)]) == 0
    plan = load_plan(output)
    titan = (tmp_path / "plan.torchtitan.toml").read_text()
    config = tomllib.loads(titan)
    mesh = plan.mesh
    assert config["parallelism"]["data_parallel_shard_degree"] == mesh.dp_shard
    assert config["parallelism"]["data_parallel_replicate_degree"] == mesh.dp_replicate
    assert config["parallelism"]["pipeline_parallel_degree"] == mesh.pp
    assert config["training"]["global_batch_size"] == mesh.dp * plan.batch_per_replica
    assert config["training"]["seq_len"] == plan.inputs[0].shape[1]
    assert config["activation_checkpoint"]["mode"] in ("none", "full", "selective")
    # what torchtitan cannot express is listed: the pinned unit's strategy
    lm_head = next(unit for unit in plan.units if "lm_head" in unit.modules)
    assert f"#   {lm_head.name}: the plan says replicate" in titan
    try:  # torchtitan's own config classes, where torchtitan installs
        from torchtitan.config.configs import ParallelismConfig, TrainingConfig
    except ImportError:
        pass
    else:
        ParallelismConfig(**config["parallelism"])
        TrainingConfig(**config["training"])
    yaml = pytest.importorskip("yaml")
    text = (tmp_path / "plan.accelerate.yaml").read_text()
    accelerate = yaml.safe_load(text)
    assert accelerate["distributed_type"] == "FSDP"
    assert accelerate["fsdp_config"]["fsdp_version"] == 2
    assert "LlamaDecoderLayer" in accelerate["fsdp_config"]["fsdp_transformer_layer_cls_to_wrap"]
    assert f"#   {lm_head.name}: the plan says replicate" in text
    try:  # Accelerate's own parser, where Accelerate installs
        from accelerate.commands.config.config_args import ClusterConfig
    except ImportError:
        pass
    else:
        parsed = ClusterConfig.from_yaml_file(tmp_path / "plan.accelerate.yaml")
        assert parsed.fsdp_config["fsdp_version"] == 2
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'plan.torchtitan.toml'}" in out


def test_the_pictures_name_every_unit_and_give_each_stage_its_own_memory_axis(
    tmp_path, monkeypatch
):
    from dataclasses import replace

    from shardplan.cli import report
    from shardplan.plan import UnitPrediction

    assert report.label_spots(5) == [0, 1, 2, 3, 4]
    spots = report.label_spots(100, 40)
    assert len(spots) == 40 and spots[0] == 0 and spots[-1] == 99  # evenly, not the widest
    plan, _ = _hugging_face_llama_plan()
    stages = (
        replace(plan.stages[0], index=0, units=(plan.units[0].name,)),
        replace(plan.stages[0], index=1, units=(plan.units[1].name,)),
    )
    piped = replace(
        plan,
        mesh=replace(plan.mesh, dp_shard=1, pp=2),
        schedule=replace(plan.schedule, name="gpipe"),
        stages=stages,
        predicted=replace(
            plan.predicted,
            units=tuple(
                UnitPrediction(
                    unit=unit.name,
                    forward_bytes=2**20 * (index + 1),
                    backward_bytes=2**21,
                    compute_s=1e-3,
                )
                for index, unit in enumerate(plan.units)
            ),
        ),
    )
    drawn = {}
    save = report._save

    def keep(figure, path):
        drawn[os.path.basename(path)] = [
            (
                [label.get_text() for label in axis.get_xticklabels()],
                [text.get_text() for text in axis.texts],
            )
            for axis in figure.axes
        ]
        return save(figure, path)

    monkeypatch.setattr(report, "_save", keep)
    report.draw(piped, str(tmp_path))
    memory = drawn["memory.png"]
    assert len(memory) == 2  # a stage an axis: no stage's units under another's ticks
    for (ticks, notes), unit in zip(memory, plan.units):
        label = unit_labels([u.name for u in plan.units])[unit.name]
        assert ticks == [f"F {label}", f"B {label}"] and len(notes) == 1  # its own peak note
    [(_, names)] = drawn["units.png"]
    assert sorted(names) == sorted(unit_labels([u.name for u in plan.units]).values())


def test_plan_adds_itself_to_a_baseline_that_check_then_passes(tmp_path, capsys):
    config = tmp_path / "configs" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(HUGGING_FACE_CONFIG))
    baseline = tmp_path / "ci" / "baseline.json"
    baseline.parent.mkdir()
    argv = ["plan", str(config), "--world-size", "2", "--hardware", "cpu-gloo", "--seq", "64"]
    argv += ["--param-dtype", "bfloat16", "-o", str(tmp_path / "plan.json")]
    assert main([*argv, "--add-to-baseline", str(baseline), "--emit", "accelerate"]) == 0
    assert f"added a case to {baseline}" in capsys.readouterr().out
    assert main([*argv, "--add-to-baseline", str(baseline)]) == 0  # the same case: replaced
    assert f"replaced the case in {baseline}" in capsys.readouterr().out
    [case] = json.loads(baseline.read_text())["cases"]
    assert case["model"] == os.path.join("..", "configs", "config.json")  # beside the baseline
    assert case["flags"] == ["--seq", "64", "--param-dtype", "bfloat16"]
    assert case["peak_bytes"] == load_plan(tmp_path / "plan.json").predicted.peak_bytes
    assert main(["check", "--baseline", str(baseline)]) == 0
    assert "PASS ../configs/config.json at world 2 on cpu-gloo, --seq 64" in capsys.readouterr().out
