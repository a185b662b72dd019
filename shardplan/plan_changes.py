"""What changed from one plan to another, one line each, in the units people read: what `shardplan diff`
prints, and what an elastic restart logs when it re-plans for a new world."""

import re

from shardplan.common.sizes import format_bytes
from shardplan.plan import Plan

_SHOWN_APART = ("mesh", "schedule", "units", "stages", "predicted", "reasoning")
"""Top-level plan fields plan_changes words itself; every other field's changes are Plan.diff's lines."""


def plan_changes(old: Plan, new: Plan) -> list[str]:
    """What changes from `old` to `new`, one line each: sizes in KiB-GiB, times in ms, units named by
    their modules ([] if the plans are the same)."""
    # Plan.diff's line names its field first: "units['h.1'].strategy: ..." is a unit's, said below
    lines = [
        line for line in old.diff(new) if re.split(r"\W", line, maxsplit=1)[0] not in _SHOWN_APART
    ]
    if old.mesh != new.mesh:
        lines.append(f"mesh: {old.mesh.describe()} -> {new.mesh.describe()}")
    if old.schedule != new.schedule:
        lines.append(
            f"schedule: {old.schedule.runs_as(old.mesh.pp)} -> {new.schedule.runs_as(new.mesh.pp)}"
        )
    lines += _unit_changes(old, new)
    lines += _changed(
        "peak memory", old.predicted.peak_bytes, new.predicted.peak_bytes, format_bytes
    )
    for category in sorted(set(old.predicted.memory_bytes) | set(new.predicted.memory_bytes)):
        lines += _changed(
            f"  memory {category}",
            old.predicted.memory_bytes.get(category, 0),
            new.predicted.memory_bytes.get(category, 0),
            format_bytes,
        )
    lines += _changed("step time", old.predicted.step_time_s, new.predicted.step_time_s, _ms)
    for component in sorted(set(old.predicted.time_s) | set(new.predicted.time_s)):
        lines += _changed(
            f"  time {component}",
            old.predicted.time_s.get(component, 0.0),
            new.predicted.time_s.get(component, 0.0),
            _ms,
        )
    lines += _changed(
        "samples / s", old.predicted.samples_per_s, new.predicted.samples_per_s, "{:.1f}".format
    )
    lines += _changed("MFU", old.predicted.mfu, new.predicted.mfu, "{:.1%}".format)
    lines += _changed(
        "budget", old.reasoning.budget_bytes, new.reasoning.budget_bytes, format_bytes
    )
    if old.reasoning.binding_constraint != new.reasoning.binding_constraint:
        lines.append(
            f"binding: {old.reasoning.binding_constraint} -> {new.reasoning.binding_constraint}"
        )
    return lines


def _unit_changes(old: Plan, new: Plan) -> list[str]:
    """One line per unit of `new` that is not the same unit, decided alike on the same stage, in `old`:
    what held its modules before."""
    before = {unit.name: _unit_words(old, unit) for unit in old.units}
    unit_of_module = {module: unit.name for unit in old.units for module in unit.modules}
    lines = []
    for unit in new.units:
        now = _unit_words(new, unit)
        if before.get(unit.name) == now:
            continue
        held_by = list(
            dict.fromkeys(unit_of_module[m] for m in unit.modules if m in unit_of_module)
        )
        was = "; ".join(f"in {name} ({before[name]})" for name in held_by) or "new modules"
        lines.append(f"unit {unit.name}: {was} -> {now}")
    kept = {module for unit in new.units for module in unit.modules}
    lines += [
        f"unit {unit.name}: removed ({', '.join(unit.modules)} no longer planned)"
        for unit in old.units
        if not kept & set(unit.modules)
    ]
    return lines


def _unit_words(plan: Plan, unit) -> str:
    stage = next((stage.index for stage in plan.stages if unit.name in stage.units), 0)
    words = [unit.strategy.value, f"checkpoint {unit.checkpoint.value}", f"stage {stage}"]
    return ", ".join(
        words + (["offload"] if unit.offload else []) + ([] if unit.prefetch else ["no prefetch"])
    )


def _changed(what: str, before: float, after: float, shown) -> list[str]:
    if abs(after - before) <= 1e-9 * max(abs(before), abs(after)):
        return []  # the same figure summed in another order
    change = f" ({after / before - 1:+.1%})" if before else ""
    return [f"{what}: {shown(before)} -> {shown(after)}{change}"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
