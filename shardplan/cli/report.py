"""Plans for people: a table of what was decided and predicted, and pictures of it."""

import os

from rich.table import Table

from shardplan.common.sizes import format_bytes
from shardplan.errors import ShardplanError
from shardplan.plan import (
    Checkpoint,
    Plan,
    ShardStrategy,
    format_count,
    input_label,
    input_shape,
    mesh_words,
    parameter_counts,
    unit_labels,
)

STRATEGY_COLORS = {
    ShardStrategy.FULL_SHARD: "#4C72B0",
    ShardStrategy.SHARD_GRAD_OP: "#55A868",
    ShardStrategy.SHARD_OPTIMIZER: "#C44E52",
    ShardStrategy.REPLICATE: "#8172B2",
}
CHECKPOINT_HATCH = {
    Checkpoint.NONE: "",
    Checkpoint.FULL: "//",
    Checkpoint.SELECTIVE: "..",
    Checkpoint.SELECTIVE_ALTERNATE: "oo",
}
OFFLOAD_COLOR = "#DD8452"


def setup_table(plan: Plan) -> Table:
    """What one step trains on and where: the mesh, the example inputs, the batch per data-parallel
    rank and the global batch, micro-batches."""
    table = Table(title=f"{plan.model}: the training step planned for {plan.world_size} ranks")
    table.add_column("")
    table.add_column("value")
    mesh = plan.mesh
    table.add_row("mesh", mesh_words(plan))
    for spec in plan.inputs:
        table.add_row(input_label(spec), input_shape(spec))
    batch = plan.batch_per_replica
    table.add_row(
        "batch per data-parallel rank",
        f"{batch} (dim 0 of {input_label(plan.inputs[0])})" if plan.inputs else "1",
    )
    table.add_row("global batch", f"{mesh.dp * batch} = {mesh.dp} data-parallel ranks x {batch}")
    micro = plan.schedule.num_micro_batches
    table.add_row(
        "micro-batches",
        f"{micro} of {batch / micro:g} per data-parallel rank; runs as "
        f"{plan.schedule.runs_as(mesh.pp)}",
    )
    table.add_row(
        "precision",
        f"params {plan.mixed_precision.param_dtype}, "
        f"grads reduced in {plan.mixed_precision.reduce_dtype}; optimizer {plan.optimizer}",
    )
    return table


def units_table(plan: Plan, sizes: dict[str, int] | None = None) -> Table:
    """The units, each named by what tells it apart (unit_labels); `sizes` (parameter name ->
    elements) counts each unit's parameters, without it the column counts parameter tensors."""
    counts = parameter_counts(plan, sizes)
    labels = unit_labels([unit.name for unit in plan.units])
    offloads = any(unit.offload for unit in plan.units)
    # at 80 columns every column stays whole: no edge, and no offload or stage column with nothing in it
    table = Table(
        title=f"{plan.model}: {len(plan.units)} units, {plan.mesh.describe()}, "
        f"{plan.schedule.num_micro_batches} micro-batch(es)",
        show_edge=False,
    )
    table.add_column("unit", no_wrap=True, min_width=min(40, max(map(len, labels.values()))))
    for column in ("blocks", "params" if counts else "tensors"):
        table.add_column(column, justify="right", no_wrap=True)
    for column in (
        "strategy",
        "checkpoint",
        *(["offload"] if offloads else []),
        *(["stage"] if plan.mesh.pp > 1 else []),
    ):
        table.add_column(column, no_wrap=True)
    stage_of = {unit: stage.index for stage in plan.stages for unit in stage.units}
    for unit in plan.units:
        table.add_row(
            labels[unit.name],
            str(len(unit.modules)),
            format_count(counts[unit.name]) if counts else str(len(unit.params)),
            unit.strategy.value,
            unit.checkpoint.value,
            *(["yes" if unit.offload else ""] if offloads else []),
            *([str(stage_of.get(unit.name, ""))] if plan.mesh.pp > 1 else []),
        )
    return table


def prediction_table(plan: Plan) -> Table:
    predicted = plan.predicted
    # the binding constraint is a sentence: a title wraps it into a column as narrow as the table, so
    # explain prints it on a line of its own
    table = Table(
        title=f"predicted per rank on {plan.hardware} (budget {format_bytes(plan.reasoning.budget_bytes)})"
    )
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


def sequence_limits_line(plan: Plan) -> str:
    """The longest sequence each micro-batch size fits ("" where the plan records none)."""
    from shardplan.solver.shapes import priced_lengths

    if not plan.sequence_limits:
        return ""
    searched = priced_lengths(plan)
    shown = ", ".join(
        f"{r.micro_batch}: {'>= ' if r.longest >= searched else ''}{r.longest}"
        for r in plan.sequence_limits
    )
    return f"longest sequence that fits, by micro-batch size: {shown}"


def runner_ups_table(plan: Plan) -> Table:
    table = Table(title="runner-up plans")
    for column in ("plan", "peak memory", "step time"):
        table.add_column(column)
    for alternative in plan.reasoning.runner_ups:
        table.add_row(
            alternative.description,
            format_bytes(alternative.peak_bytes),
            f"{alternative.step_time_s * 1e3:.2f} ms",
        )
    return table


def draw(plan: Plan, folder: str) -> list[str]:
    """Write the pictures of `plan` into `folder` as PNG (units.png, memory.png); return their paths."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    predicted = {unit.unit: unit for unit in plan.predicted.units}
    try:
        os.makedirs(folder, exist_ok=True)
        return [
            _draw_units(plan, predicted, os.path.join(folder, "units.png")),
            _draw_memory(plan, predicted, os.path.join(folder, "memory.png")),
        ]
    except (
        OSError
    ) as error:  # a file of that name, a folder this process may not write, a full disk
        cause = (
            "a file has that name"
            if isinstance(error, FileExistsError)
            else error.strerror or str(error)
        )
        raise ShardplanError(
            f"cannot write pictures to {folder!r}: {cause}; pass --pictures DIR, a folder this "
            "process may write"
        ) from None


MAX_LABELS = 40
"""Unit names written on a stage's row (units.png) or axis (memory.png) at most; past it, evenly spaced ones."""


def label_spots(count: int, most: int = MAX_LABELS) -> list[int]:
    """Which of `count` units in a row are named: every one up to `most`, else `most` evenly spaced,
    the first and the last among them."""
    if count <= most:
        return list(range(count))
    return sorted({round(k * (count - 1) / (most - 1)) for k in range(most)})


def _draw_units(plan: Plan, predicted: dict, path: str) -> str:
    """Each stage a row of its units, each as wide as its compute time (equal widths for a plan without
    per-unit predictions): colour the strategy, hatch the checkpointing, a dashed edge the offload."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    units = {unit.name: unit for unit in plan.units}
    labels_of = unit_labels(list(units))
    timed = all(name in predicted for name in units)
    crowded = any(
        len(stage.units) > 12 for stage in plan.stages
    )  # names stand upright: taller rows
    figure, axis = plt.subplots(figsize=(10, 1.6 + (1.4 if crowded else 0.5) * len(plan.stages)))
    for stage in plan.stages:
        widths = [predicted[name].compute_s * 1e3 if timed else 1.0 for name in stage.units]
        total = sum(widths) or 1.0
        labelled = set(label_spots(len(widths)))
        left = 0.0
        for index, (name, width) in enumerate(zip(stage.units, widths)):
            unit = units[name]
            axis.barh(
                stage.index,
                width,
                left=left,
                height=0.7,
                color=STRATEGY_COLORS[unit.strategy],
                hatch=CHECKPOINT_HATCH[unit.checkpoint],
                edgecolor=OFFLOAD_COLOR if unit.offload else "white",
                linestyle="--" if unit.offload else "-",
                linewidth=2 if unit.offload else 0.5,
            )
            if index in labelled:
                # on a box of the unit's colour: a checkpoint's hatching never runs through the name
                axis.text(
                    left + width / 2,
                    stage.index,
                    labels_of[name],
                    ha="center",
                    va="center",
                    color="white",
                    fontsize=6 if len(widths) > MAX_LABELS // 2 else 7,
                    rotation=90 if width / total < 0.12 else 0,
                    clip_on=True,
                    bbox={
                        "facecolor": STRATEGY_COLORS[unit.strategy],
                        "edgecolor": "none",
                        "pad": 0.6,
                    },
                )
            left += width
    axis.set_yticks([s.index for s in plan.stages], [f"stage {s.index}" for s in plan.stages])
    axis.invert_yaxis()
    axis.set_xlabel(
        "forward + backward compute per micro-batch (ms)" if timed else "unit, in execution order"
    )
    axis.set_title(
        f"{plan.model}: {len(plan.units)} units on {plan.mesh.describe()}; width: compute time"
    )
    legend = (
        [Patch(color=color, label=strategy.value) for strategy, color in STRATEGY_COLORS.items()]
        + [
            Patch(facecolor="grey", hatch=hatch, label=f"checkpoint {mode.value}")
            for mode, hatch in CHECKPOINT_HATCH.items()
            if hatch
        ]
        + [
            Patch(
                facecolor="white",
                edgecolor=OFFLOAD_COLOR,
                linestyle="--",
                linewidth=2,
                label="offloaded",
            )
        ]
    )
    axis.legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _save(figure, path)


def _draw_memory(plan: Plan, predicted: dict, path: str) -> str:
    """Memory on one rank over the step: the forward of every unit, then the backward in reverse,
    against the budget; the peak named; an offloaded unit's events hatched (its state is in host
    memory, not under the line). Each pipeline stage has an axis of its own, its x-axis its own units
    (stages run on different ranks), its peak named apart. A plan without per-unit predictions: its
    peak's terms."""
    import matplotlib.pyplot as plt

    timeline = all(unit.name in predicted for unit in plan.units)
    stages = list(plan.stages) if timeline else []
    rows = max(1, len(stages))
    figure, axes = plt.subplots(
        rows, 1, figsize=(10, 4.5 if rows == 1 else 1.0 + 3.2 * rows), squeeze=False
    )
    for row, axis in enumerate(axes[:, 0]):
        _draw_memory_axis(plan, predicted, axis, stages[row] if stages else None, rows > 1)
    axes[0, 0].set_title(
        f"{plan.model}: predicted memory over one micro-batch's forward and backward "
        f"(peak {format_bytes(plan.predicted.peak_bytes)})"
        + (f"\nstage {stages[0].index}" if rows > 1 else "")
    )
    return _save(figure, path)


def _draw_memory_axis(plan: Plan, predicted: dict, axis, stage, several: bool) -> None:
    """One stage's memory over its step on `axis` (`stage` None: the peak's terms); `several`: the plan
    has other stages, drawn on axes of their own."""
    scale, unit_name = (2**30, "GiB") if plan.predicted.peak_bytes >= 2**30 else (2**20, "MiB")
    budget = plan.reasoning.budget_bytes / scale
    offloaded = {unit.name for unit in plan.units if unit.offload}
    offload_label = (
        f"offloaded ({len(offloaded)} of {len(plan.units)} units):\nparameter, gradient and "
        "optimizer\nshards in host memory"
    )
    labels_of = unit_labels([unit.name for unit in plan.units])
    if stage is None:
        bottom = 0.0
        for category, size in sorted(plan.predicted.memory_bytes.items()):
            axis.bar(0, size / scale, bottom=bottom, label=category)
            bottom += size / scale
        axis.set_xticks([])
        axis.set_ylabel(f"{unit_name} per rank at the peak")
        if offloaded:
            axis.plot([], [], " ", label=offload_label)
    else:
        names = list(stage.units)
        count = len(names)
        events = [(f"F {labels_of[name]}", predicted[name].forward_bytes) for name in names] + [
            (f"B {labels_of[name]}", predicted[name].backward_bytes) for name in reversed(names)
        ]
        heights = [size / scale for _, size in events]
        xs = list(range(2 * count))
        axis.step(xs, heights, where="mid", marker="o", markersize=3, label="predicted")
        spots = [i for i, name in enumerate(names + names[::-1]) if name in offloaded]
        if spots:
            axis.bar(
                [xs[i] for i in spots],
                [heights[i] for i in spots],
                width=1.0,
                fill=False,
                hatch="//",
                edgecolor=OFFLOAD_COLOR,
                linewidth=0,
                label=offload_label,
            )
        highest = max(range(len(events)), key=heights.__getitem__)
        axis.annotate(
            f"peak {format_bytes(events[highest][1])}\n{events[highest][0]}",
            (xs[highest], heights[highest]),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=7,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "none", "alpha": 0.85},
        )
        axis.axvspan(-0.5, count - 0.5, color="#4C72B0", alpha=0.06, label="forward")
        axis.axvspan(count - 0.5, 2 * count - 0.5, color="#C44E52", alpha=0.06, label="backward")
        ticks = sorted(
            set(range(0, 2 * count, max(1, -(-2 * count // MAX_LABELS)))) | {2 * count - 1}
        )
        axis.set_xticks(ticks, [events[t][0] for t in ticks], rotation=45, ha="right", fontsize=7)
        axis.set_ylabel(
            f"{unit_name} on a stage {stage.index} rank" if several else f"{unit_name} on the rank"
        )
        if several and stage.index:
            axis.set_title(f"stage {stage.index}", fontsize=9)
    peak = plan.predicted.peak_bytes / scale
    shown_budget = f"budget {format_bytes(plan.reasoning.budget_bytes)}"
    if budget <= 2 * peak:  # a loose budget would flatten the step to the axis: name it instead
        axis.axhline(budget, color="black", linestyle="--", label=shown_budget)
    else:
        axis.plot(
            [],
            [],
            " ",
            label=f"{shown_budget} (off the chart: the peak uses {100 * peak / budget:.2g}%)",
        )
    axis.set_ylim(0, max(peak, budget if budget <= 2 * peak else 0) * 1.2)
    axis.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def _save(figure, path: str) -> str:
    import matplotlib.pyplot as plt

    try:
        figure.savefig(path, dpi=120, bbox_inches="tight")  # legends outside the axes included
    finally:
        plt.close(figure)
    return path
