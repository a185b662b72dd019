"""Plans for people: a table of what was decided and predicted, and pictures of it."""
import os

from rich.table import Table

from .plan import Checkpoint, Plan, ShardStrategy
from .sizes import format_bytes

STRATEGY_COLORS = {ShardStrategy.FULL_SHARD: "#4C72B0", ShardStrategy.SHARD_GRAD_OP: "#55A868",
                   ShardStrategy.SHARD_OPTIMIZER: "#C44E52", ShardStrategy.REPLICATE: "#8172B2"}
CHECKPOINT_HATCH = {Checkpoint.NONE: "", Checkpoint.FULL: "//", Checkpoint.SELECTIVE: ".."}


def setup_table(plan: Plan) -> Table:
    """What one step trains on and where: the mesh, the example inputs, the replica and global batch, micro-batches."""
    table = Table(title=f"{plan.model}: the training step planned for {plan.world_size} ranks")
    table.add_column("")
    table.add_column("value")
    mesh = plan.mesh
    table.add_row("mesh", f"{mesh.describe()} (dp={mesh.dp} replicas, pp={mesh.pp} stages, tp={mesh.tp})")
    for spec in plan.inputs:
        table.add_row(f"input {spec.name}", f"{' x '.join(map(str, spec.shape)) or 'scalar'} {spec.dtype}")
    replica = plan.batch_per_replica
    table.add_row("batch per replica", f"{replica} (dim 0 of input {plan.inputs[0].name})" if plan.inputs else "1")
    table.add_row("global batch", f"{mesh.dp * replica} = dp {mesh.dp} x {replica} per replica")
    micro = plan.schedule.num_micro_batches
    table.add_row("micro-batches", f"{micro} of {replica / micro:g} per replica; runs as {plan.schedule.runs_as(mesh.pp)}")
    table.add_row("precision", f"params {plan.mixed_precision.param_dtype}, "
                               f"grads reduced in {plan.mixed_precision.reduce_dtype}; optimizer {plan.optimizer}")
    return table


def units_table(plan: Plan) -> Table:
    table = Table(title=f"{plan.model}: {len(plan.units)} units, dp={plan.mesh.dp} pp={plan.mesh.pp}, "
                        f"{plan.schedule.num_micro_batches} micro-batch(es)")
    for column in ("unit", "modules", "params", "strategy", "checkpoint", "offload", "stage"):
        table.add_column(column)
    stage_of = {unit: stage.index for stage in plan.stages for unit in stage.units}
    for unit in plan.units:
        table.add_row(unit.name, str(len(unit.modules)), str(len(unit.params)), unit.strategy.value,
                      unit.checkpoint.value, "yes" if unit.offload else "", str(stage_of.get(unit.name, "")))
    return table


def prediction_table(plan: Plan) -> Table:
    predicted = plan.predicted
    table = Table(title=f"predicted per rank on {plan.hardware} (budget {format_bytes(plan.reasoning.budget_bytes)}; "
                        f"binding: {plan.reasoning.binding_constraint})")
    table.add_column("term")
    table.add_column("value", justify="right")
    table.add_row("[b]peak memory[/b]", f"[b]{format_bytes(predicted.peak_bytes)}[/b]")
    for category, size in sorted(predicted.memory_bytes.items()):
        table.add_row(f"  {category}", format_bytes(size))
    table.add_row("[b]step time[/b]", f"[b]{predicted.step_time_s * 1e3:.2f} ms[/b]")
    for component, seconds in sorted(predicted.time_s.items()):
        table.add_row(f"  {component}", f"{seconds * 1e3:.2f} ms")
    if predicted.samples_per_s:
        table.add_row("samples / s", f"{predicted.samples_per_s:.1f}")
    if predicted.mfu:
        table.add_row("MFU", f"{predicted.mfu:.1%}")
    return table


def runner_ups_table(plan: Plan) -> Table:
    table = Table(title="runner-up plans")
    for column in ("plan", "peak memory", "step time"):
        table.add_column(column)
    for alternative in plan.reasoning.runner_ups:
        table.add_row(alternative.description, format_bytes(alternative.peak_bytes),
                      f"{alternative.step_time_s * 1e3:.2f} ms")
    return table


_SHOWN_APART = ("mesh", "schedule", "units", "stages", "predicted", "reasoning")
"""Top-level plan fields plan_changes words itself; every other field's changes are Plan.diff's lines."""


def plan_changes(old: Plan, new: Plan) -> list[str]:
    """What changes from `old` to `new`, one line each: sizes in KiB-GiB, times in ms, units named by
    their modules ([] if the plans are the same)."""
    lines = [line for line in old.diff(new) if line.split(".", 1)[0].split(":", 1)[0] not in _SHOWN_APART]
    if old.mesh != new.mesh:
        lines.append(f"mesh: {old.mesh.describe()} -> {new.mesh.describe()}")
    if old.schedule != new.schedule:
        lines.append(f"schedule: {old.schedule.runs_as(old.mesh.pp)} -> {new.schedule.runs_as(new.mesh.pp)}")
    lines += _unit_changes(old, new)
    lines += _changed("peak memory", old.predicted.peak_bytes, new.predicted.peak_bytes, format_bytes)
    for category in sorted(set(old.predicted.memory_bytes) | set(new.predicted.memory_bytes)):
        lines += _changed(f"  memory {category}", old.predicted.memory_bytes.get(category, 0),
                          new.predicted.memory_bytes.get(category, 0), format_bytes)
    lines += _changed("step time", old.predicted.step_time_s, new.predicted.step_time_s, _ms)
    for component in sorted(set(old.predicted.time_s) | set(new.predicted.time_s)):
        lines += _changed(f"  time {component}", old.predicted.time_s.get(component, 0.0),
                          new.predicted.time_s.get(component, 0.0), _ms)
    lines += _changed("samples / s", old.predicted.samples_per_s, new.predicted.samples_per_s, "{:.1f}".format)
    lines += _changed("MFU", old.predicted.mfu, new.predicted.mfu, "{:.1%}".format)
    lines += _changed("budget", old.reasoning.budget_bytes, new.reasoning.budget_bytes, format_bytes)
    if old.reasoning.binding_constraint != new.reasoning.binding_constraint:
        lines.append(f"binding: {old.reasoning.binding_constraint} -> {new.reasoning.binding_constraint}")
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
        held_by = list(dict.fromkeys(unit_of_module[m] for m in unit.modules if m in unit_of_module))
        was = "; ".join(f"in {name} ({before[name]})" for name in held_by) or "new modules"
        lines.append(f"unit {unit.name}: {was} -> {now}")
    kept = {module for unit in new.units for module in unit.modules}
    lines += [f"unit {unit.name}: removed ({', '.join(unit.modules)} no longer planned)"
              for unit in old.units if not kept & set(unit.modules)]
    return lines


def _unit_words(plan: Plan, unit) -> str:
    stage = next((stage.index for stage in plan.stages if unit.name in stage.units), 0)
    words = [unit.strategy.value, f"checkpoint {unit.checkpoint.value}", f"stage {stage}"]
    return ", ".join(words + (["offload"] if unit.offload else []) + ([] if unit.prefetch else ["no prefetch"]))


def _changed(what: str, before: float, after: float, shown) -> list[str]:
    if abs(after - before) <= 1e-9 * max(abs(before), abs(after)):
        return []  # the same figure summed in another order
    change = f" ({after / before - 1:+.1%})" if before else ""
    return [f"{what}: {shown(before)} -> {shown(after)}{change}"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def draw(plan: Plan, folder: str) -> list[str]:
    """Write the pictures of `plan` into `folder` as PNG; return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    os.makedirs(folder, exist_ok=True)
    paths = []

    figure, axis = plt.subplots(figsize=(8, 1.2 + 0.25 * len(plan.stages)))
    stage_of = {unit: stage.index for stage in plan.stages for unit in stage.units}
    for position, unit in enumerate(plan.units):
        axis.barh(stage_of.get(unit.name, 0), 1, left=position, color=STRATEGY_COLORS[unit.strategy],
                  hatch=CHECKPOINT_HATCH[unit.checkpoint], edgecolor="white")
        axis.text(position + 0.5, stage_of.get(unit.name, 0), unit.name, ha="center", va="center",
                  rotation=90 if len(plan.units) > 8 else 0, fontsize=7, color="white")
    axis.set_yticks(range(len(plan.stages)), [f"stage {s.index}" for s in plan.stages])
    axis.set_xlabel("unit, in execution order")
    axis.set_title(f"{plan.model}: units and stages (colour: strategy, hatch: checkpointing)")
    axis.legend(handles=[Patch(color=c, label=s.value) for s, c in STRATEGY_COLORS.items()]
                + [Patch(facecolor="grey", hatch=h, label=f"checkpoint {k.value}") for k, h in CHECKPOINT_HATCH.items()
                   if h], fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    paths.append(_save(figure, os.path.join(folder, "units.png")))

    figure, axis = plt.subplots(figsize=(6, 4))
    bottom = 0.0
    for category, size in sorted(plan.predicted.memory_bytes.items()):
        axis.bar(0, size / 2**30, bottom=bottom, label=category)
        bottom += size / 2**30
    axis.axhline(plan.reasoning.budget_bytes / 2**30, color="black", linestyle="--", label="budget")
    axis.set_xticks([])
    axis.set_ylabel("GiB per rank at the peak")
    axis.set_title(f"predicted peak memory: {format_bytes(plan.predicted.peak_bytes)}")
    axis.legend(fontsize=8)
    paths.append(_save(figure, os.path.join(folder, "memory.png")))
    return paths


def _save(figure, path: str) -> str:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
