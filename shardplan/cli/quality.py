"""The CI gate on plan quality: re-plan a set of models and compare with a committed baseline.

A case fails when its predicted step time or peak memory got worse than the
baseline by more than the tolerance, when planning it twice does not give
byte-identical JSON, when it has no recorded figures yet, or when it cannot be
planned. `update` rewrites the baseline with today's plans.

Each case is planned in a process of its own: a model's code that ends its process (sys.exit, os.abort),
crashes it or never returns fails that case, with the reason, and the gate goes on to the next; a case
is never reported PASS unless a plan of it came back.
"""

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass, replace
from typing import TypeGuard

from shardplan.common.files import is_finite_number, parse_json, read_text, write_text_atomically
from shardplan.common.forkserver import forkserver_context
from shardplan.common.sizes import format_bytes
from shardplan.errors import ShardplanError

SCHEMA = "shardplan.baseline/1"
DEFAULT_TOLERANCE = 0.01
DEFAULT_CASE_TIMEOUT_S = 600.0
"""Seconds a case may take to be planned twice: the baseline's plan in seconds, LLaMA-70B shapes in under a minute."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    model: str
    """What `shardplan plan` takes: a zoo name, package.module:factory, or a Hugging Face config JSON
    (a relative path is read from the baseline's folder)."""
    world_size: int
    hardware: str = "h100-80g"
    memory_budget: str | None = None
    flags: tuple[str, ...] = ()
    """Any other flags of `shardplan plan`, as on its command line (--seq 4096 --global-batch 256
    --param-dtype bfloat16 --wrap REGEX ...): the case is planned as `shardplan plan` plans with them."""
    step_time_s: float = 0.0
    """Predicted at the last --update (0: not recorded yet)."""
    peak_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """One case checked: today's figures (None when it could not be planned) and why it fails."""

    case: Case
    now: Case | None
    failures: tuple[str, ...]
    """One line each, without the case's name."""

    def line(self) -> str:
        """PASS/FAIL, the case and its figures against the baseline's on one line; below it, indented, why it fails."""
        figures = ""
        if self.now is not None:
            figures = (
                f": step {_against(self.now.step_time_s, self.case.step_time_s, _ms)}, "
                f"peak {_against(self.now.peak_bytes, self.case.peak_bytes, format_bytes)}"
            )
        return "\n    ".join(
            [f"{'FAIL' if self.failures else 'PASS'} {_name(self.case)}{figures}", *self.failures]
        )


def check_baseline(
    path: str,
    tolerance: float | None = None,
    update: bool = False,
    report=lambda outcome: None,
    debug: bool = False,
    case_timeout_s: float = DEFAULT_CASE_TIMEOUT_S,
) -> list[Outcome]:
    """Every case's Outcome, each also given to `report` as soon as it is known; `debug`: a case that
    cannot be planned raises instead of failing (planned in this process, so the traceback is its own)."""
    cases, saved_tolerance = _read(path)
    tolerance = saved_tolerance if tolerance is None else _tolerance(tolerance, "--tolerance")
    if not _is_finite(case_timeout_s) or case_timeout_s <= 0:
        raise ShardplanError(
            f"--case-timeout is {case_timeout_s!r}: give the seconds a case may take, a finite "
            "number above 0"
        )
    outcomes = []
    for case in cases:
        outcome = _check(
            case, os.path.dirname(os.path.abspath(path)), tolerance, update, debug, case_timeout_s
        )
        report(outcome)
        outcomes.append(outcome)
    if update:  # the baseline keeps its own tolerance: one loose run must not loosen the gate
        _write(path, [outcome.now or outcome.case for outcome in outcomes], saved_tolerance)
    return outcomes


def _check(
    case: Case, folder: str, tolerance: float, update: bool, debug: bool, timeout_s: float
) -> Outcome:
    planned = (
        _plan_twice(case, folder, debug) if debug else _plan_twice_apart(case, folder, timeout_s)
    )
    if isinstance(planned, str):
        return Outcome(case=case, now=None, failures=(f"cannot be planned: {planned}",))
    same_json, step_time_s, peak_bytes = planned
    failures = []
    if not same_json:
        failures.append("planning twice gave different JSON (the solver is not deterministic)")
    now = Case(
        model=case.model,
        world_size=case.world_size,
        hardware=case.hardware,
        memory_budget=case.memory_budget,
        flags=case.flags,
        step_time_s=step_time_s,
        peak_bytes=peak_bytes,
    )
    if not update:
        failures += _regressions(case, now, tolerance)
    return Outcome(case=case, now=now, failures=tuple(failures))


_Planned = tuple[bool, float, int]
"""A case planned twice: (the same JSON both times, predicted step time, predicted peak bytes)."""


def _plan_twice(case: Case, folder: str, debug: bool = False) -> _Planned | str:
    """The case planned twice, or why it cannot be (one line)."""
    from shardplan.cli.model_spec import summary

    try:
        plan, again = _plan(case, folder), _plan(case, folder)
    except (
        Exception
    ) as error:  # a gate reports every case: one that cannot be planned is one failure
        if debug:
            raise
        return (
            str(error)
            if isinstance(error, ShardplanError)
            else f"{type(error).__name__}: {summary(error)}"
        )
    return plan.to_json() == again.to_json(), plan.predicted.step_time_s, plan.predicted.peak_bytes


def _plan_twice_apart(case: Case, folder: str, timeout_s: float) -> _Planned | str:
    """_plan_twice in a process of its own (see the module's docstring), or why no plan came back."""
    context = forkserver_context()  # forks of one process that imported torch once
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_plan_twice_and_send, args=(case, folder, sys.path, sender), daemon=True
    )
    process.start()
    sender.close()  # the child's end alone stays open: its exit is then an end of file here
    try:
        if not receiver.poll(timeout_s):
            return (
                f"planning took more than {timeout_s:g} s and was stopped: a model whose code waits or loops "
                "never plans; give --case-timeout more seconds if it is only slow"
            )
        try:
            return receiver.recv()
        except EOFError:  # the process ended without a word
            process.join()
            return _ended(process.exitcode)
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join()


def _plan_twice_and_send(case: Case, folder: str, path: list[str], sender) -> None:
    sys.path[:] = path  # the gate's, where package.module:factory cases are imported from
    sender.send(_plan_twice(case, folder))


def _ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = (
            signal.Signals(-exitcode).name
            if -exitcode in signal.valid_signals()
            else f"signal {-exitcode}"
        )
        return (
            f"the planning process was killed by {name} before it planned: the model's code (or a crash "
            "under it) ended it; run `shardplan plan` on the case to see where"
        )
    return (
        f"the planning process exited with status {exitcode} before it planned: the model's code ended it "
        "(sys.exit, quit, os._exit); a model factory must return the model"
    )


def _regressions(old: Case, new: Case, tolerance: float) -> list[str]:
    if not old.step_time_s or not old.peak_bytes:
        return [
            "the baseline has no recorded figures for this case: run `shardplan check "
            "--update` to record them, and commit the baseline"
        ]
    failures = []
    for metric, before, after in (
        ("step_time_s", old.step_time_s, new.step_time_s),
        ("peak_bytes", old.peak_bytes, new.peak_bytes),
    ):
        if after > before * (1 + tolerance):
            failures.append(
                f"predicted {metric} got worse: {before:.6g} -> {after:.6g} "
                f"(+{after / before - 1:.2%}, tolerance {tolerance:.2%}); if this is intended, "
                "run `shardplan check --update` and commit the baseline"
            )
    return failures


def _plan(case: Case, folder: str):
    from shardplan.cli.model_spec import load_model
    from shardplan.cli.plan_flags import plan_options
    from shardplan.compile import compile as compile_plan

    spec = case.model
    if spec.endswith(".json") and not os.path.isabs(spec):
        spec = os.path.join(folder, spec)
    options = plan_flags(case)
    options_of_plan = plan_options(options)
    entry = load_model(
        spec,
        batch=options.batch,
        seq=options.seq,
        fp32_params=options_of_plan["mixed_precision"] is not None,
    )
    return compile_plan(entry.model, case.world_size, entry.args, entry.kwargs, **options_of_plan)


_CASE_FIELDS = {
    "--world-size": "world_size",
    "--hardware": "hardware",
    "--memory-budget": "memory_budget",
    "-o": None,
    "--output": None,
    "--emit": None,
    "--add-to-baseline": None,
    "--debug": None,
}
"""Flags of `shardplan plan` a case holds as fields of its own (or has no use for: -o)."""


def plan_flags(case: Case, where: str = ""):
    """`shardplan plan`'s options for `case`: its fields, then its flags; a flag plan does not take, or
    one the case holds as a field, is a one-line error naming the case (`where`)."""
    import contextlib
    import io

    from shardplan.cli.plan_flags import add_plan_arguments

    where = where or f"case {case.model!r:.80}"
    for flag in case.flags:
        name = flag.split("=", 1)[0]
        if name in _CASE_FIELDS:
            field = _CASE_FIELDS[name]
            raise ShardplanError(
                f"{where} flag {name} "
                + (
                    f"is the case's field {field}: set that field"
                    if field
                    else "has no use in a case"
                )
                + ", and leave the flag out"
            )
    parser = argparse.ArgumentParser(prog="shardplan plan", add_help=False)
    add_plan_arguments(parser)
    argv = [case.model, "--world-size", str(case.world_size), "--hardware", case.hardware]
    argv += ["--memory-budget", case.memory_budget] if case.memory_budget is not None else []
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return parser.parse_args([*argv, *case.flags])
    except SystemExit:
        message = (said.getvalue().strip().splitlines() or ["unreadable flags"])[-1]
        raise ShardplanError(
            f"{where} flags {' '.join(case.flags)[:200]!r}: {message.removeprefix('shardplan plan: error: ')}; "
            "give flags `shardplan plan` takes"
        ) from None


def _name(case: Case) -> str:
    budget = f", budget {case.memory_budget}" if case.memory_budget else ""
    flags = f", {' '.join(case.flags)}" if case.flags else ""
    return f"{case.model} at world {case.world_size} on {case.hardware}{budget}{flags}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _against(now: float, before: float, shown) -> str:
    """`now` beside the baseline's `before`, with the relative change."""
    if not before:
        return f"{shown(now)} (baseline: not recorded)"
    return f"{shown(now)} (baseline {shown(before)}, {now / before - 1:+.1%})"


def _read(path: str) -> tuple[list[Case], float]:
    if not os.path.exists(path):
        raise ShardplanError(
            f"cannot read baseline {path!r}: it does not exist; create one with "
            "`shardplan check --baseline PATH --update` after listing cases in it"
        )
    data = parse_json(read_text(path, "baseline"), f"baseline {path!r}")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ShardplanError(f"baseline {path!r} is not a {SCHEMA} file")
    if not isinstance(data.get("cases"), list) or not data["cases"]:
        # a gate of no cases would pass whatever the planner does
        raise ShardplanError(
            f'baseline {path!r} has no cases: give "cases": [{{"model": ..., '
            '"world_size": ...}, ...]'
        )
    cases = [
        _case(case, f"baseline {path!r} case {index}") for index, case in enumerate(data["cases"])
    ]
    tolerance = _tolerance(
        data.get("tolerance", DEFAULT_TOLERANCE), f"baseline {path!r} field tolerance"
    )
    _check_schema(data, path)
    for index, case in enumerate(cases):
        plan_flags(case, f"baseline {path!r} case {index} ({case.model!r:.80})")
    return cases, tolerance


SCHEMA_PATH = os.path.join(
    os.path.dirname(os.path.dirname(__file__)), "schemas", "baseline.schema.json"
)


def _check_schema(data: dict, path: str) -> None:
    """Refuse a baseline that does not match schemas/baseline.schema.json, naming the first field."""
    import jsonschema

    with open(SCHEMA_PATH) as handle:
        schema = json.load(handle)
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if errors:
        error = jsonschema.exceptions.best_match(errors)
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
        raise ShardplanError(
            f"baseline {path!r} field {where or '(top)'} does not match the baseline schema: "
            f"{error.message[:200]}: fix it (docs/usage.md, 'The baseline')"
        )


def _case(data: object, where: str) -> Case:
    """A case as the baseline holds it, each field of the type Case declares (`where` names the case)."""
    if not isinstance(data, dict):
        raise ShardplanError(
            f"{where} is {data!r:.80}: make it an object with model and world_size"
        )
    try:
        case = Case(**data)
    except TypeError as error:  # a field missing or unknown
        raise ShardplanError(
            f"{where} is malformed ({error}): give model and world_size, and only Case's fields"
        ) from None
    if not isinstance(case.flags, (list, tuple)) or not all(
        isinstance(flag, str) for flag in case.flags
    ):
        raise ShardplanError(
            f"{where} ({case.model!r:.80}) field flags is {case.flags!r:.80}: make it a list of "
            'strings, e.g. ["--seq", "4096", "--param-dtype", "bfloat16"]'
        )
    case = replace(case, flags=tuple(case.flags))
    for field, wanted, fits in (
        ("model", "a string", isinstance(case.model, str)),
        (
            "world_size",
            "a whole number from 1",
            _is_count(case.world_size) and case.world_size >= 1,
        ),
        ("hardware", "a string", isinstance(case.hardware, str)),
        (
            "memory_budget",
            'a string such as "40GiB", or null',
            case.memory_budget is None or isinstance(case.memory_budget, str),
        ),
        ("step_time_s", "a finite number, 0 or more", _is_finite(case.step_time_s)),
        ("peak_bytes", "a whole number, 0 or more", _is_count(case.peak_bytes)),
    ):
        if not fits:
            raise ShardplanError(
                f"{where} ({case.model!r:.80}) field {field} is {getattr(case, field)!r:.80}: "
                f"make it {wanted}, or run `shardplan check --update` to record the figures again"
            )
    return case


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_finite(value: object) -> TypeGuard[int | float]:
    """A finite number, 0 or more (NaN and infinity, which no JSON holds, are not)."""
    return is_finite_number(value) and value >= 0


def _tolerance(value: object, where: str) -> float:
    """A tolerance as `where` gives it, if it is one: a finite number, 0 or more (NaN would pass every case)."""
    if not _is_finite(value):
        raise ShardplanError(
            f"{where} is {value!r:.80}: give the allowed relative worsening as a finite number, "
            "0 or more (0.01 allows 1%)"
        )
    return float(value)


def _write(path: str, cases: list[Case], tolerance: float) -> None:
    text = (
        json.dumps(
            {"schema": SCHEMA, "tolerance": tolerance, "cases": [_written(c) for c in cases]},
            indent=2,
            sort_keys=True,
            allow_nan=False,
        )
        + "\n"
    )
    write_text_atomically(path, text)


def _written(case: Case) -> dict:
    """A case as the baseline holds it: flags only where it has some."""
    fields = asdict(case)
    if case.flags:
        fields["flags"] = list(case.flags)
    else:
        del fields["flags"]
    return fields


def add_case(path: str, case: Case) -> bool:
    """Put `case` into the baseline at `path` (made if missing), in place of a case of the same model,
    world size, hardware, budget and flags; whether one was replaced. The model's path, where it is a
    config file, is written relative to the baseline's folder (as check reads it)."""
    if case.model.endswith(".json") and os.path.exists(case.model):
        folder = os.path.dirname(os.path.abspath(path))
        case = replace(case, model=os.path.relpath(os.path.abspath(case.model), folder))
    cases, tolerance = _read(path) if os.path.exists(path) else ([], DEFAULT_TOLERANCE)
    same = [
        index
        for index, old in enumerate(cases)
        if replace(old, step_time_s=0.0, peak_bytes=0)
        == replace(case, step_time_s=0.0, peak_bytes=0)
    ]
    if same:
        cases[same[0]] = case
    else:
        cases.append(case)
    _write(path, cases, tolerance)
    return bool(same)
