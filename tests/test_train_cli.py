"""`shardplan train`'s mixed precision, learning-rate schedule, held-out evaluation and the policy for flags
changed on resume, on one gloo rank; and `shardplan export` of what it trained."""

import contextlib
import io
import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch
from parity import spawn_world

from shardplan.runtime.elastic import ElasticOptions, lr_factor


def _options(**fields) -> ElasticOptions:
    return ElasticOptions(directory="run", steps=10, global_batch_size=4, **fields)


def test_the_learning_rate_warms_up_then_follows_its_schedule():
    constant = _options(warmup_steps=4)
    assert [lr_factor(step, constant) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = _options(lr_schedule="linear", warmup_steps=2)
    assert lr_factor(2, linear) == 1.0 and lr_factor(6, linear) == pytest.approx(0.5)
    cosine = _options(lr_schedule="cosine")
    assert lr_factor(0, cosine) == 1.0 and lr_factor(5, cosine) == pytest.approx(0.5)
    assert 0 < lr_factor(9, cosine) < 0.03 and math.isclose(lr_factor(9, linear), 1 / 8)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"lr_schedule": "step"}, "use one of constant, linear, cosine"),
        ({"warmup_steps": 10}, r"from 0 to below steps \(10\)"),
        ({"eval_every": 2}, "give eval_every and eval_samples together"),
        ({"eval_every": 0, "eval_samples": 2}, "a whole number from 1"),
    ],
)
def test_schedule_and_evaluation_options_are_checked(fields, message):
    with pytest.raises(Exception, match=message):
        _options(**fields)


def train_job(rank: int, world: int, folder: str) -> dict:
    from shardplan.cli.main import main
    from shardplan.runtime.checkpoint import read_metadata

    run, found = Path(folder) / "run", {}

    def train(*flags: str, directory: Path = run, out=None) -> tuple[int, str, str]:
        out, err = out or io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            status = main(
                [
                    "train",
                    "gpt",
                    "elastic_data:tokens",
                    "--directory",
                    str(directory),
                    "--global-batch",
                    "4",
                    "--hardware",
                    "cpu-gloo",
                    "--checkpoint-every",
                    "2",
                    *flags,
                ]
            )
        return status, out.getvalue(), err.getvalue()

    first = (
        "--param-dtype",
        "bfloat16",
        "--reduce-dtype",
        "float32",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--eval-every",
        "2",
        "--eval-samples",
        "4",
    )
    found["first"] = train("--steps", "4", *first)
    if found["first"][0]:
        return found
    _, metadata = read_metadata(run / "step_00000004")
    found["precision"] = metadata["plan"]["mixed_precision"]
    found["lr_at_4"] = metadata["optimizer"]["param_groups"][0]["lr"]
    found["events"] = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    found["resumed"] = train("--steps", "6", "--lr", "0.002", *first)
    if found["resumed"][0]:
        return found
    _, metadata = read_metadata(run / "step_00000006")
    found["lr_at_6"] = metadata["optimizer"]["param_groups"][0]["lr"]
    found["reseeded"] = train("--steps", "8", "--seed", "5", *first)
    found["export"] = main(["export", str(run / "step_00000006"), "-o", str(Path(folder) / "out")])
    stopped = Path(folder) / "stopped"
    found["stopped"] = train("--steps", "50", directory=stopped, out=_TerminatedAtStep(1))
    found["stopped_saved"] = sorted(path.name for path in stopped.glob("step_*"))
    found["exported"] = sorted(torch.load(Path(folder) / "out" / "model.pt", weights_only=True))
    return found


class _TerminatedAtStep(io.StringIO):
    """Standard output that sends this process SIGTERM when the log reports `step`, as torchrun stops a
    worker, or a scheduler a job, mid-run."""

    def __init__(self, step: int):
        super().__init__()
        self.line, self.sent = f"step {step}: ", False

    def write(self, text: str) -> int:
        if self.line in text and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)
        return super().write(text)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    return spawn_world(1, train_job, (str(tmp_path_factory.mktemp("train")),))


def _cosine(step: int, steps: int, warmup: int) -> float:
    return _options_at(steps, warmup)(step)


def _options_at(steps: int, warmup: int):
    options = ElasticOptions(
        directory="r", steps=steps, global_batch_size=4, lr_schedule="cosine", warmup_steps=warmup
    )
    return lambda step: lr_factor(step, options)


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_train_takes_mixed_precision_a_warmup_schedule_and_evaluates_held_out_samples(trained):
    status, out, err = trained["first"]
    assert status == 0, err
    assert trained["precision"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    # the last step taken (index 3) set the rate the checkpoint records
    assert trained["lr_at_4"] == pytest.approx(1e-3 * _cosine(3, 4, 2))
    evals = [event for event in trained["events"] if event["event"] == "eval"]
    assert [event["step"] for event in evals] == [2, 4] and all(
        event["samples"] == 4 and math.isfinite(event["loss"]) for event in evals
    )
    assert "step 2: held-out loss " in out
    assert "pass --batch" not in err and "--seq" not in err  # the data sets the shapes


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_changed_flag_on_resume_is_logged_and_wins_and_a_fixed_one_is_refused(trained):
    status, out, err = trained["resumed"]
    assert status == 0, err
    assert "this start's values are used: steps 4 -> 6, lr 0.001 -> 0.002" in out, out
    assert trained["lr_at_6"] == pytest.approx(2e-3 * _cosine(5, 6, 2))  # the new rate and length
    status, out, err = trained["reseeded"]
    assert status == 2 and "seed was 0 when the run in " in err and "give 0 again" in err, err
    assert err.count("\n") == 1


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_a_run_stopped_short_of_its_steps_saves_and_exits_as_stopped_by_sigterm(trained):
    """Not 0: torchrun would take the worker group as done and end the job, where it should restart the
    workers a stopped one left, and a scheduler requeue a preempted job."""
    status, out, err = trained["stopped"]
    assert status == 128 + signal.SIGTERM, err
    assert trained["stopped_saved"] == ["step_00000001"]


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_export_finds_the_trained_model_in_the_run_folder(trained):
    assert trained["export"] == 0
    assert "wte.weight" in trained["exported"]


def test_a_token_file_is_a_language_models_dataset_and_a_bad_one_is_refused(tmp_path, capsys):
    from shardplan.cli.main import TokenFile, main

    ids = torch.randint(0, 50, (6, 8), dtype=torch.int32)
    torch.save(ids, tmp_path / "tokens.pt")
    keywords = TokenFile(str(tmp_path / "tokens.pt"), keywords=True)
    assert len(keywords) == 6 and torch.equal(keywords[2]["input_ids"], ids[2].long())
    assert torch.equal(keywords[2]["labels"], ids[2].long())
    inputs, labels = TokenFile(str(tmp_path / "tokens.pt"), keywords=False)[1]
    assert torch.equal(inputs, ids[1].long()) and torch.equal(labels, ids[1].long())
    torch.save(torch.rand(6, 8), tmp_path / "floats.pt")
    for name, message in (
        ("floats.pt", "holds a 2-D torch.float32 tensor: save a 2-D integer tensor of token ids"),
        ("missing.pt", "cannot read the token file"),
    ):
        argv = ["train", "gpt", str(tmp_path / name), "--directory", str(tmp_path / "run")]
        assert main([*argv, "--steps", "2", "--global-batch", "2"]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
