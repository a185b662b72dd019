"""The command line: shardplan plan | explain | diff | export | check | calibrate | demo | train.

Errors print on one line without a traceback and exit 2 (`--debug` shows the traceback).
"""

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import threading
import time

from rich.console import Console

from shardplan.cli import plan_flags
from shardplan.common.dtypes import FLOAT_DTYPES
from shardplan.errors import ShardplanError
from shardplan.plan import MixedPrecision

EXAMPLES = {
    "plan": "shardplan plan gpt --world-size 8 --hardware h100-80g --memory-budget 40GiB -o plan.json\n"
    "  shardplan plan llama-7b --world-size 64 -o llama.json\n"
    "  shardplan plan config.json --batch 1 --seq 4096 --world-size 16   (a Hugging Face config)\n"
    "  shardplan plan mypackage.models:build --world-size 4   (build() returns (model, args, kwargs))\n"
    "  shardplan plan config.json --world-size 8 --emit torchtitan --emit accelerate   "
    "(also plan.torchtitan.toml, plan.accelerate.yaml)\n"
    "  shardplan plan config.json --world-size 8 --param-dtype bfloat16 --reduce-dtype float32 "
    "--wrap 'layers\\.\\d+$' --pin 'embed=replicate'",
    "explain": "shardplan explain plan.json --pictures plan-pictures/\n"
    "  shardplan explain run1/step_00000100   # the plan a checkpoint was trained on",
    "diff": "shardplan diff old.json new.json\n"
    "  shardplan diff run1/step_00000100/shardplan.json plan.json   # a checkpoint's plan",
    "export": "shardplan export run1/step_00000100 -o exported/\n"
    "  shardplan export ckpt/step_00000100 --model config.json -o exported/   # a checkpoint saved from Python",
    "check": "shardplan check --baseline benchmarks/baseline.json\n"
    "  shardplan check --baseline benchmarks/baseline.json --update\n"
    "  shardplan check --measure cpu-gloo   # predicted vs measured training on this machine",
    "calibrate": "shardplan calibrate -o profile.json --world-size 2\n"
    "  shardplan calibrate --medium -o profile.json   # under a minute: what a small model's step reads",
    "demo": "shardplan demo --world-size 2 --steps 5\n"
    "  shardplan calibrate --medium -o profile.json && shardplan demo --hardware profile.json",
    "train": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 "
    "--rdzv-id=run1 --max-restarts=3 --no-python \\\n"
    "      shardplan train gpt mypackage.data:tokens --directory run1 --steps 1000 --global-batch 64 "
    "--hardware cpu-gloo",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _quiet_libraries()
    if argv[:1] == ["calibrate"]:
        return _guarded(lambda: _calibrate(argv[1:]), "--debug" in argv)
    parser = _parser()
    options = parser.parse_args(argv)
    options.argv = argv
    return _guarded(lambda: options.run(options), options.debug)


def _guarded(command, debug: bool) -> int:
    try:
        status = command() or 0
        sys.stdout.flush()  # here, where a closed pipe is caught, not at the interpreter's exit
        return status
    except BrokenPipeError:  # `shardplan diff a b | head`: the reader has what it wanted
        _silence_stdout()
        return 141  # as a process SIGPIPE ends (128 + 13)
    except ShardplanError as error:
        if debug:
            raise
        print(f"shardplan: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("shardplan: interrupted", file=sys.stderr)
        return 130


QUIET_LOGGERS = ("torch._subclasses.fake_tensor",)
"""Loggers of libraries that log, with a traceback, failures shardplan catches and answers itself (a
capture that falls back): a command prints its own one-line warnings and errors instead."""


def _quiet_libraries() -> None:
    import logging
    import warnings

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    shown = warnings.showwarning

    def one_line(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package + os.sep):  # shardplan's own: one line
            print(f"shardplan: warning: {str(message).splitlines()[0]}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    # not where warnings are being recorded (catch_warnings(record=True): a test's, or a caller's)
    recording = getattr(getattr(warnings, "_showwarnmsg_impl", None), "__name__", "") == "append"
    original = warnings.showwarning is getattr(warnings, "_showwarning_orig", None)
    if original and not recording:
        warnings.showwarning = one_line


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush finds no closed pipe to complain of."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout is no file (a test's capture)
        pass


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardplan",
        description="Plan and run sharded PyTorch training.",
        epilog="examples:\n  " + "\n  ".join(EXAMPLES.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, run, help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(
            name,
            help=help_text,
            description=help_text,
            epilog="examples:\n  " + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
        sub.set_defaults(run=run)
        return sub

    plan = command(
        "plan",
        _plan,
        "Capture a model, solve for the fastest plan within the budget, write it as JSON.",
    )
    plan_flags.add_plan_arguments(plan)
    plan.add_argument("-o", "--output", default="plan.json")
    plan.add_argument(
        "--add-to-baseline",
        metavar="BASELINE",
        help="also record this plan as a case of the shardplan check baseline BASELINE (made if "
        "missing): its model, world size, hardware, budget and every other flag given, with "
        "today's figures; a case of the same model and flags is replaced",
    )

    explain = command(
        "explain", _explain, "Show a plan: units, predicted memory and time, and pictures."
    )
    explain.add_argument(
        "plan", help="a plan JSON, or a checkpoint (its folder or its shardplan.json)"
    )
    explain.add_argument(
        "--pictures", help="folder for units.png and memory.png (default: beside the plan)"
    )

    diff = command(
        "diff", _diff, "What changed between two plans, and what it does to memory and time."
    )
    diff.add_argument("old", help="a plan JSON, or a checkpoint (its folder or its shardplan.json)")
    diff.add_argument("new", help="the same")

    export = command(
        "export",
        _export,
        "Write a checkpoint's model as a Hugging Face save_pretrained folder (Hugging Face models) "
        "or a plain state dict (model.pt).",
    )
    export.add_argument("checkpoint", help="a checkpoint folder, e.g. run1/step_00000100")
    export.add_argument("-o", "--output", required=True, help="the folder to write (new, or empty)")
    export.add_argument(
        "--model",
        help="the model's SPEC, as given to plan or train (default: what `shardplan train` "
        "recorded in the run folder's settings.json)",
    )

    check = command(
        "check", _check, "CI gate: re-plan the baseline's models; fail if a plan got worse."
    )
    check.add_argument("--baseline", default="benchmarks/baseline.json")
    check.add_argument(
        "--tolerance", type=float, help="allowed relative worsening (default: the baseline's, 1%%)"
    )
    check.add_argument(
        "--update", action="store_true", help="rewrite the baseline with today's plans"
    )
    check.add_argument(
        "--case-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how long a case may take to plan before it fails (default: 600)",
    )
    check.add_argument(
        "--measure",
        metavar="PROFILE",
        help="also train the demo GPT on 2 CPU ranks under every plan "
        "kind and fail where PROFILE's prediction misses (memory ±10%%, step time 0.7-1.3x)",
    )

    command(
        "calibrate",
        None,
        "Measure this machine and write a hardware profile (see calibrate --help).",
    )

    demo = command(
        "demo",
        _demo,
        "Plan a GPT and train it with the plan on CPU ranks; compare with the prediction.",
    )
    demo.add_argument("--world-size", type=int, default=2)
    demo.add_argument("--steps", type=int, default=5)
    demo.add_argument(
        "--hardware",
        help="a profile name or JSON path (default: a medium calibration here, 20 s to 1.5 minutes)",
    )
    demo.add_argument(
        "--memory-budget", help="bytes per rank, e.g. 300MiB (default: 60%% of the fastest plan's)"
    )

    train = command(
        "train",
        _train,
        "Train under torchrun, elastic: on every (re)start re-plan for the world there "
        "is and resume the newest checkpoint (run on every rank).",
    )
    train.add_argument(
        "model",
        help="a zoo name, package.module:factory, or a Hugging Face config JSON; its "
        "forward returns the loss",
    )
    train.add_argument(
        "data",
        help="a .pt file of token ids (samples x sequence length; each row the input and the "
        "labels), or package.module:factory returning a dataset: len() and dataset[i], a tensor, "
        "a tuple or a dict of tensors (the model's arguments, by position or name)",
    )
    train.add_argument(
        "--directory", required=True, help="checkpoints, progress.json and events.jsonl"
    )
    train.add_argument(
        "--steps", type=int, required=True, help="optimizer steps in all, over every restart"
    )
    batch = train.add_mutually_exclusive_group(required=True)
    batch.add_argument("--global-batch", type=int, help="samples a step, kept at every world size")
    batch.add_argument(
        "--batch", type=int, help="samples a step per rank: the global batch scales with the world"
    )
    train.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints (default: 100)"
    )
    train.add_argument(
        "--seed", type=int, default=0, help="of the initialization and the sample order"
    )
    train.add_argument(
        "--lr", type=float, default=1e-3, help="AdamW's learning rate (default: 1e-3)"
    )
    train.add_argument("--eps", type=float, default=1e-8, help="AdamW's eps (default: 1e-8)")
    train.add_argument(
        "--weight-decay", type=float, default=0.01, help="AdamW's weight decay (default: 0.01)"
    )
    train.add_argument("--clip", type=float, help="clip the gradients' global norm to this")
    train.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="process-group timeout in seconds: how long ranks wait on a rank that died silently",
    )
    train.add_argument(
        "--adopt-checkpoint",
        action="store_true",
        help="resume a checkpoint another run saved (copied into --directory to continue it)",
    )
    train.add_argument(
        "--param-dtype",
        choices=FLOAT_DTYPES,
        help="mixed precision: the dtype parameters are gathered and computed in (e.g. bfloat16), "
        "the model kept in float32 (fp32 master weights)",
    )
    train.add_argument(
        "--reduce-dtype",
        choices=FLOAT_DTYPES,
        help="mixed precision: the dtype gradients are reduced in (default float32 with "
        "--param-dtype)",
    )
    train.add_argument(
        "--lr-schedule",
        choices=("constant", "linear", "cosine"),
        default="constant",
        help="the learning rate after the warmup: constant, or falling to 0 at --steps linearly "
        "or along half a cosine (default: constant)",
    )
    train.add_argument(
        "--warmup-steps",
        type=int,
        default=0,
        help="steps over which the learning rate rises linearly to --lr (default: 0)",
    )
    train.add_argument(
        "--eval-every",
        type=int,
        metavar="N",
        help="every N steps and at the end, log the loss on the held-out samples (--eval-samples)",
    )
    train.add_argument(
        "--eval-samples",
        type=int,
        metavar="K",
        help="the data's last K samples, never trained on, for --eval-every (default: 5%% of the "
        "data, at least 1)",
    )
    plan_flags.hardware_options(train)
    return parser


_NOT_CASE_FLAGS = {
    "--world-size",
    "--hardware",
    "--memory-budget",
    "-o",
    "--output",
    "--emit",
    "--add-to-baseline",
}
"""plan's flags a baseline case does not keep among its flags: its own fields, or what only writes files."""


def _case_flags(argv: list[str]) -> tuple[str, ...]:
    """The flags of a `plan` command line a baseline case keeps: all but SPEC, --debug and _NOT_CASE_FLAGS
    (with their values)."""
    kept: list[str] = []
    index, positional = 1, False  # argv[0] is "plan"
    while index < len(argv):
        word = argv[index]
        name = word.split("=", 1)[0]
        if name in _NOT_CASE_FLAGS:
            index += 1 if "=" in word else 2
            continue
        if word == "--debug":
            index += 1
            continue
        if not word.startswith("-") and not positional and (not kept or not _takes_value(kept[-1])):
            positional = True  # SPEC
            index += 1
            continue
        kept.append(word)
        index += 1
    return tuple(kept)


def _takes_value(flag: str) -> bool:
    """Whether `flag` (a plan flag, without "=") is followed by a value."""
    if "=" in flag or not flag.startswith("-"):
        return False
    action = next((a for a in _parser_plan_actions() if flag in a.option_strings), None)
    return action is not None and action.nargs != 0


def _parser_plan_actions():
    parser = argparse.ArgumentParser(add_help=False)
    plan_flags.add_plan_arguments(parser)
    return parser._actions


def _plan(options) -> int:
    from shardplan.cli.model_spec import load_model
    from shardplan.compile import compile as compile_plan

    options_of_plan = plan_flags.plan_options(options)
    if options.memory_budget is not None:  # refused now, before minutes of capture
        from shardplan.common.sizes import parse_bytes

        parse_bytes(options.memory_budget)
    if os.path.isdir(options.output):
        raise ShardplanError(
            f"cannot write {options.output!r}: it is a folder; give a file path inside it "
            f"(e.g. {os.path.join(options.output, 'plan.json')})"
        )
    entry = load_model(
        options.spec,
        batch=options.batch,
        seq=options.seq,
        fp32_params=options_of_plan["mixed_precision"] is not None,
        warn=_warn,
        # with --global-batch each data-parallel rank's batch is global / ranks, whatever --batch
        shape_flags=("--seq",) if options.global_batch_size else ("--batch", "--seq"),
    )
    with _progress(f"capturing and planning {options.spec} for {options.world_size} ranks"):
        plan = compile_plan(
            entry.model, options.world_size, entry.args, entry.kwargs, **options_of_plan
        )
    plan.save(options.output)
    sizes = {name: parameter.numel() for name, parameter in entry.model.named_parameters()}
    print(plan.summary(sizes))
    print(f"wrote {options.output}")
    if options.add_to_baseline:
        from shardplan.cli.quality import Case, add_case

        case = Case(
            model=options.spec,
            world_size=options.world_size,
            hardware=options.hardware,
            memory_budget=options.memory_budget,
            flags=_case_flags(getattr(options, "argv", None) or []),
            step_time_s=plan.predicted.step_time_s,
            peak_bytes=plan.predicted.peak_bytes,
        )
        replaced = add_case(options.add_to_baseline, case)
        print(
            f"{'replaced the case in' if replaced else 'added a case to'} {options.add_to_baseline}"
        )
    if options.emit:
        from shardplan.cli.emit import SUFFIXES, emit
        from shardplan.common.files import write_text_atomically

        classes = {path: type(module).__name__ for path, module in entry.model.named_modules()}
        for stack in dict.fromkeys(options.emit):
            path = os.path.splitext(options.output)[0] + SUFFIXES[stack]
            write_text_atomically(path, emit(plan, stack, classes, sizes))
            print(f"wrote {path}")
    return 0


PROGRESS_FIRST_S, PROGRESS_EVERY_S = 5.0, 10.0
"""Where stderr is no terminal (a log, CI): seconds before the first line saying a plan is being made,
then between lines. A plan made (or refused) sooner prints none, so an error stays one line."""


@contextlib.contextmanager
def _progress(doing: str):
    """A spinner on a terminal; elsewhere a line after PROGRESS_FIRST_S, one every PROGRESS_EVERY_S
    after it, and one at the end if any was printed."""
    if sys.stderr.isatty():
        with Console(stderr=True).status(doing):
            yield
        return
    started = time.monotonic()
    done, said = threading.Event(), []

    def beat() -> None:
        wait = PROGRESS_FIRST_S
        while not done.wait(wait):
            print(
                f"shardplan: {doing}: {time.monotonic() - started:.0f} s so far",
                file=sys.stderr,
                flush=True,
            )
            said.append(True)
            wait = PROGRESS_EVERY_S

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
    if said:
        print(
            f"shardplan: {doing}: done in {time.monotonic() - started:.1f} s",
            file=sys.stderr,
            flush=True,
        )


def _warn(text: str) -> None:
    print(f"shardplan: warning: {text}", file=sys.stderr)


def _read_plan(path: str):
    """(the plan, parameter name -> elements or None) of a plan JSON, a checkpoint's shardplan.json
    (the plan under its "plan" key, beside the parameters' shapes) or a checkpoint's folder."""
    from shardplan.common.files import parse_json, read_text
    from shardplan.errors import PlanError
    from shardplan.plan import Plan, load_plan

    file = os.path.join(path, "shardplan.json") if os.path.isdir(path) else path
    if os.path.isdir(path) and not os.path.isfile(file):
        raise ShardplanError(
            f"{path} is a folder without shardplan.json: give a plan JSON or a checkpoint folder"
        )
    text = read_text(file, "plan file", PlanError)
    data = parse_json(text, f"plan file {file!r}", PlanError)
    if (
        isinstance(data, dict)
        and "schema" not in data
        and str(data.get("format", "")).startswith("shardplan.checkpoint/")
    ):
        if not isinstance(data.get("plan"), dict):
            raise ShardplanError(
                f"checkpoint metadata {file} holds no plan: it is damaged; restore it from a copy"
            )
        sizes = None
        if isinstance(data.get("parameters"), list):
            with contextlib.suppress(TypeError, KeyError, ValueError):
                sizes = {entry["name"]: _elements(entry["shape"]) for entry in data["parameters"]}
        try:
            return Plan.from_json(json.dumps(data["plan"])), sizes
        except PlanError as error:
            raise PlanError(f"the plan of checkpoint metadata {file!r}: {error}") from None
    return load_plan(file), None


def _elements(shape: list) -> int:
    count = 1
    for size in shape:
        count *= int(size)
    return count


def _explain(options) -> int:
    from shardplan.cli import report

    plan, sizes = _read_plan(options.plan)
    console = Console()
    console.print(report.setup_table(plan))
    console.print(report.units_table(plan, sizes))
    console.print(report.prediction_table(plan))
    console.print(f"binding constraint: {plan.reasoning.binding_constraint}", markup=False)
    if plan.sequence_limits:
        console.print(report.sequence_limits_line(plan), markup=False)
    if plan.reasoning.runner_ups:
        console.print(report.runner_ups_table(plan))
    if options.pictures:
        folder = options.pictures
    elif os.path.isdir(options.plan) or os.path.basename(options.plan) == "shardplan.json":
        # never into a checkpoint's folder, which a save must find holding only what it wrote
        checkpoint = options.plan if os.path.isdir(options.plan) else os.path.dirname(options.plan)
        folder = os.path.abspath(checkpoint).rstrip(os.sep) + "-pictures"
    else:
        folder = os.path.splitext(options.plan)[0] + "-pictures"
    for path in report.draw(plan, folder):
        console.print(f"wrote {path}")
    return 0


def _diff(options) -> int:
    from shardplan.plan_changes import plan_changes

    (old, _), (new, _) = _read_plan(options.old), _read_plan(options.new)
    changes = plan_changes(old, new)
    print("\n".join(changes) if changes else "the plans are the same")
    return 0


def _export(options) -> int:
    from shardplan.cli.export import export

    written = export(options.checkpoint, options.output, options.model, warn=_warn)
    print(f"wrote {written}")
    return 0


def _check(options) -> int:
    from shardplan.cli.quality import check_baseline

    outcomes = check_baseline(
        options.baseline,
        tolerance=options.tolerance,
        update=options.update,
        report=lambda outcome: print(outcome.line(), flush=True),
        debug=options.debug,
        case_timeout_s=options.case_timeout,
    )
    failed = sum(1 for outcome in outcomes if outcome.failures)
    print(
        f"{len(outcomes)} case(s): {len(outcomes) - failed} passed, {failed} failed"
        + (f"; wrote {options.baseline}" if options.update else "")
    )
    if options.measure:
        from shardplan.calibration.accuracy import accuracy_table, measure_accuracy
        from shardplan.costmodel.hardware import get_hardware

        rows = measure_accuracy(get_hardware(options.measure))
        Console(width=120).print(
            accuracy_table(
                rows, f"predicted ({options.measure}) vs measured, demo GPT, 2 CPU ranks"
            )
        )
        misses = [miss for row in rows for miss in row.misses()]
        for miss in misses:
            print(f"FAIL {miss}", file=sys.stderr)
        failed += len(misses)
    return 1 if failed else 0


def _demo(options) -> int:
    from rich.table import Table

    from shardplan.cli import demo
    from shardplan.common.sizes import format_bytes
    from shardplan.models import zoo
    from shardplan.runtime.launch import check_local_world

    if options.steps < 1:  # before the calibration and the plan, which would be for nothing
        raise ShardplanError(
            f"--steps {options.steps} trains no step to compare with the prediction: give 1 or more"
        )
    check_local_world(options.world_size)
    console = Console()
    hardware = demo.resolve_hardware(options.hardware, options.world_size)
    plan, budget = demo.plan_demo(options.world_size, hardware, options.memory_budget)
    console.print(
        f"GPT {zoo.DEMO_GPT.n_layer} layers, d_model {zoo.DEMO_GPT.d_model}, seq {zoo.DEMO_GPT.seq_len}, "
        f"batch {zoo.DEMO_BATCH} per replica; world {options.world_size}; budget {format_bytes(budget)} "
        f"per rank; hardware: {hardware.name}"
    )
    # plain text: rich would rewrap its columns to the terminal
    print(plan.summary(), flush=True)
    measured = demo.train_with_plan(plan, options.world_size, options.steps)
    table = Table(
        title=f"predicted vs measured (CPU, gloo, {options.world_size} ranks, {options.steps} steps)"
    )
    for column in ("", "predicted", "measured", "predicted / measured"):
        table.add_column(column, justify="right")
    for row in demo.comparison_rows(plan, measured):
        table.add_row(*row)
    console.print(table)
    console.print(demo.load_note(measured), markup=False)
    console.print("loss by step: " + ", ".join(f"{loss:.3f}" for loss in measured.losses))
    return 0


class TokenFile:
    """A `.pt` file of token ids, samples × sequence length (torch.save of a 2-D integer tensor), as
    a language model's dataset: each row is its input and its labels, as keywords (input_ids, labels)
    for a Hugging Face config's model, else as two positional arguments."""

    def __init__(self, path: str, keywords: bool):
        import torch

        try:
            tokens = torch.load(path, weights_only=True)
        except (OSError, RuntimeError, ValueError) as error:
            cause = getattr(error, "strerror", None) or str(error).splitlines()[0][:200]
            raise ShardplanError(
                f"cannot read the token file {path!r} ({cause}): give a file torch.save wrote"
            ) from None
        if not (
            isinstance(tokens, torch.Tensor)
            and tokens.dim() == 2
            and not tokens.is_floating_point()
            and not tokens.is_complex()
            and tokens.numel()
        ):
            shown = (
                f"a {tokens.dim()}-D {tokens.dtype} tensor"
                if isinstance(tokens, torch.Tensor)
                else f"a {type(tokens).__name__}"
            )
            raise ShardplanError(
                f"the token file {path!r} holds {shown}: save a 2-D integer tensor of token ids, "
                "samples x sequence length (torch.save(ids.long(), path))"
            )
        self.tokens, self.keywords = tokens.long(), keywords

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int):
        row = self.tokens[index]
        return {"input_ids": row, "labels": row} if self.keywords else (row, row)


TRAIN_SETTINGS_FIXED = ("model", "data", "seed", "eval_samples")
"""The train settings a resumed run may not change: they fix the model and the data order of its
checkpoints. Every other flag may change at a restart; the log names each change, and the new value
is used ([Note: changed settings] in runtime/elastic.py)."""
STOPPED_EXIT_CODE = 128 + 15
"""`shardplan train`'s exit status when SIGTERM stopped it before --steps (the shell's for SIGTERM)."""


def _train(options) -> int:
    import importlib

    import torch

    from shardplan.cli.model_spec import load_model
    from shardplan.common.files import is_finite_number
    from shardplan.runtime.elastic import ElasticOptions, train

    for flag, value, low in (
        ("--lr", options.lr, "above 0"),
        ("--eps", options.eps, "0 or more"),
        ("--weight-decay", options.weight_decay, "0 or more"),
    ):
        if not (is_finite_number(value) and (value > 0 if low == "above 0" else value >= 0)):
            raise ShardplanError(f"{flag} {value}: give a finite number, {low}")
    if options.eval_samples is not None and options.eval_every is None:
        raise ShardplanError(
            "--eval-samples holds out samples for --eval-every: give --eval-every N too"
        )
    precision = None
    if options.param_dtype or options.reduce_dtype:
        precision = MixedPrecision(
            param_dtype=options.param_dtype or "float32",
            reduce_dtype=options.reduce_dtype or "float32",
        )
    settings = {
        "model": options.model,
        "data": options.data,
        "cwd": os.getcwd(),
        "seed": options.seed,
        "eval_samples": options.eval_samples or 0,
        **{
            name: getattr(options, name)
            for name in (
                "steps",
                "global_batch",
                "batch",
                "checkpoint_every",
                "lr",
                "eps",
                "weight_decay",
                "clip",
                "lr_schedule",
                "warmup_steps",
                "eval_every",
                "param_dtype",
                "reduce_dtype",
                "hardware",
                "memory_budget",
            )
        },
    }
    elastic = ElasticOptions(
        directory=options.directory,
        steps=options.steps,
        global_batch_size=options.global_batch,
        replica_batch_size=options.batch,
        checkpoint_every=options.checkpoint_every,
        seed=options.seed,
        clip_grad_norm=options.clip,
        timeout_s=options.timeout,
        plan_options={
            "hardware": options.hardware,
            "memory_budget": options.memory_budget,
            "mixed_precision": precision,
        },
        adopt_checkpoint=options.adopt_checkpoint,
        lr_schedule=options.lr_schedule,
        warmup_steps=options.warmup_steps,
        eval_every=options.eval_every,
        eval_samples=options.eval_samples or (1 if options.eval_every else 0),
        settings=settings,
        fixed_settings=TRAIN_SETTINGS_FIXED,
    )  # checks the numbers before the data loads
    if options.data.endswith(".pt"):
        dataset = TokenFile(options.data, keywords=options.model.endswith(".json"))
    else:
        module_name, _, factory_name = options.data.partition(":")
        try:
            dataset = getattr(importlib.import_module(module_name), factory_name)()
        except (ImportError, AttributeError, ValueError) as error:
            raise ShardplanError(
                f"cannot load the data {options.data!r} ({error}): write package.module:function, "
                "importable from here (set PYTHONPATH), or give a .pt file of token ids"
            ) from None
    eval_samples = 0
    if options.eval_every is not None:
        eval_samples = options.eval_samples
        if eval_samples is None:
            try:
                eval_samples = max(1, len(dataset) // 20)
            except TypeError:
                eval_samples = 1  # train() says the dataset has no len()
    if eval_samples != elastic.eval_samples:
        elastic = dataclasses.replace(
            elastic, eval_samples=eval_samples, settings={**settings, "eval_samples": eval_samples}
        )
    outcome = train(
        # the data gives the shapes: no example batch or sequence length to warn of
        lambda: (
            load_model(
                options.model, fp32_params=precision is not None, warn=_warn, shape_flags=()
            ).model
        ),
        dataset,
        elastic,
        optimizer_factory=lambda parameters: torch.optim.AdamW(
            parameters, lr=options.lr, eps=options.eps, weight_decay=options.weight_decay
        ),
        log=lambda text: print(text, flush=True),
    )
    # Stopped by SIGTERM short of --steps, its last step saved: not a success, so that torchrun
    # restarts the workers a stopped worker or node left, and a scheduler requeues a preempted job.
    return STOPPED_EXIT_CODE if outcome.stopped else 0


def _calibrate(argv: list[str] | None = None) -> int:
    """`shardplan calibrate [-o profile.json] [--world-size N] [--backend gloo|nccl] [--mode quick|medium|full]`."""
    from shardplan.calibration.calibrate import MODES, calibrate, partial_path, summary
    from shardplan.common.files import write_text_atomically

    parser = argparse.ArgumentParser(
        prog="shardplan calibrate",
        description="Measure this machine and write a hardware profile.",
        epilog="examples:\n  " + EXAMPLES["calibrate"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-o", "--output", default="profile.json", help="where to write the profile JSON"
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks to spawn on this machine")
    parser.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default=None,
        help="default: nccl when CUDA is present, else gloo",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--mode",
        choices=MODES,
        default="full",
        help="quick: every figure roughly, for tests; medium: what a small model's step time reads "
        "(matmuls to n=1024, collectives to 48 MB, 5 rounds; under a minute on 2 idle cores); "
        "full: the whole sweep (default)",
    )
    mode.add_argument(
        "--quick", dest="mode", action="store_const", const="quick", help="--mode quick"
    )
    mode.add_argument(
        "--medium", dest="mode", action="store_const", const="medium", help="--mode medium"
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    args = parser.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.access(folder, os.W_OK):  # fail now, not after minutes of measuring
        parser.error(
            f"cannot write {args.output}: folder {folder} does not exist or is not writable"
        )
    if os.path.isdir(args.output):
        parser.error(
            f"cannot write {args.output}: it is a folder; give a file path inside it "
            f"(e.g. {os.path.join(args.output, 'profile.json')})"
        )
    partial = partial_path(args.output)
    profile = calibrate(
        world_size=args.world_size, backend=args.backend, mode=args.mode, partial_path=partial
    )
    write_text_atomically(args.output, profile.to_json())
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {args.output}: {summary(profile)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
