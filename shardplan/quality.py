"""The CI gate on plan quality: re-plan a set of models and compare with a committed baseline.

A case fails when its predicted step time or peak memory got worse than the
baseline by more than the tolerance, or when planning it twice does not give
byte-identical JSON. `update` rewrites the baseline with today's plans.
"""
import json
import os
from dataclasses import asdict, dataclass

from .errors import ShardplanError
from .files import parse_json, read_text, write_text_atomically

SCHEMA = "shardplan.baseline/1"
DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    model: str
    """A zoo name."""
    world_size: int
    hardware: str = "h100-80g"
    memory_budget: str | None = None
    step_time_s: float = 0.0
    """Predicted at the last --update."""
    peak_bytes: int = 0


def check_baseline(path: str, tolerance: float | None = None, update: bool = False) -> list[str]:
    """Failures, one line each (empty: the gate passes)."""
    cases, saved_tolerance = _read(path)
    tolerance = saved_tolerance if tolerance is None else tolerance
    failures, measured = [], []
    for case in cases:
        plan, again = _plan(case), _plan(case)
        if plan.to_json() != again.to_json():
            failures.append(f"{_name(case)}: planning twice gave different JSON (the solver is not deterministic)")
        now = Case(model=case.model, world_size=case.world_size, hardware=case.hardware,
                   memory_budget=case.memory_budget, step_time_s=plan.predicted.step_time_s,
                   peak_bytes=plan.predicted.peak_bytes)
        measured.append(now)
        if not update:
            failures += _regressions(case, now, tolerance)
    if update:
        _write(path, measured, tolerance)
    return failures


def _regressions(old: Case, new: Case, tolerance: float) -> list[str]:
    failures = []
    for metric, before, after in (("step_time_s", old.step_time_s, new.step_time_s),
                                  ("peak_bytes", old.peak_bytes, new.peak_bytes)):
        if after > before * (1 + tolerance):
            failures.append(f"{_name(old)}: predicted {metric} got worse: {before:.6g} -> {after:.6g} "
                            f"(+{after / before - 1:.2%}, tolerance {tolerance:.2%}); if this is intended, "
                            "run `shardplan check --update` and commit the baseline")
    return failures


def _plan(case: Case):
    from . import zoo
    from .compile import compile as compile_plan

    entry = zoo.build(case.model)
    return compile_plan(entry.model, case.world_size, entry.args, entry.kwargs, hardware=case.hardware,
                        memory_budget=case.memory_budget)


def _name(case: Case) -> str:
    budget = f", budget {case.memory_budget}" if case.memory_budget else ""
    return f"{case.model} at world {case.world_size} on {case.hardware}{budget}"


def _read(path: str) -> tuple[list[Case], float]:
    if not os.path.exists(path):
        raise ShardplanError(f"cannot read baseline {path!r}: it does not exist; create one with "
                             "`shardplan check --baseline PATH --update` after listing cases in it")
    data = parse_json(read_text(path, "baseline"), f"baseline {path!r}")
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ShardplanError(f"baseline {path!r} is not a {SCHEMA} file")
    try:
        cases = [Case(**case) for case in data["cases"]]
    except (KeyError, TypeError) as error:
        raise ShardplanError(f"baseline {path!r} has a malformed case: {error}") from None
    return cases, float(data.get("tolerance", DEFAULT_TOLERANCE))


def _write(path: str, cases: list[Case], tolerance: float) -> None:
    text = json.dumps({"schema": SCHEMA, "tolerance": tolerance, "cases": [asdict(c) for c in cases]},
                      indent=2, sort_keys=True) + "\n"
    write_text_atomically(path, text)
