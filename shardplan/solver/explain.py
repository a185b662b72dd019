"""Why the plan is what it is, and why no plan fits: the binding constraint, the runner-ups (the best of
every other tp degree and the expert defaults a person would write), and the infeasibility message that
names the smallest budget and each option that would fit."""

import dataclasses
from dataclasses import replace
from typing import Any

from shardplan.common.sizes import format_bytes
from shardplan.costmodel import cost
from shardplan.costmodel.cost import evaluate_stage
from shardplan.costmodel.hardware import HardwareModel
from shardplan.errors import EMPTY_BATCH
from shardplan.frontend.chain import BlockChain
from shardplan.plan import Alternative, Checkpoint, Decision, Mesh, Reasoning, Schedule
from shardplan.solver.chain_dp import ROUNDING
from shardplan.solver.search import (
    Candidate,
    Configuration,
    SearchMemo,
    Setting,
    configurations,
    context,
    samples_per_step,
    search,
    smallest_peak,
)
from shardplan.solver.space import (
    BlockRule,
    Constraints,
    SearchSpace,
    block_rules,
    constraint_patterns,
)

RUNNER_UPS = 4
"""Other configurations listed in Plan.reasoning, besides the expert defaults."""


def expert_defaults(
    chain: BlockChain, setting: Setting, hw: HardwareModel, budget: int | None = None
) -> list[tuple[str, cost.StepCost]]:
    """What a person would write by hand: every block its own FULL_SHARD unit, dp = world,
    without and with full checkpointing (the baselines the solver must never lose to); none where a
    global batch does not split over the world's ranks. With a `budget`, each accumulates over the
    fewest micro-batches that fit it (the most, one sample each, where none does), as a person
    meeting an out-of-memory error would; without, one micro-batch."""
    replica_batch = setting.replica_batch(setting.world_size)
    if replica_batch % 1:
        return []
    counts = [m for m in range(1, int(replica_batch) + 1) if replica_batch % m == 0]
    bounds = tuple(range(len(chain.blocks)))
    found = []
    for label, checkpoint in (
        ("expert default: FULL_SHARD per block", Checkpoint.NONE),
        ("expert default: FULL_SHARD per block + full checkpointing", Checkpoint.FULL),
    ):
        decisions = tuple(Decision(checkpoint=checkpoint) for _ in bounds)
        for m in counts if budget is not None else counts[:1]:
            configuration = Configuration(
                mesh=Mesh(dp_shard=setting.world_size), schedule=Schedule(num_micro_batches=m)
            )
            step = evaluate_stage(
                chain.blocks, bounds, decisions, context(setting, configuration, hw, 0)
            )
            if budget is None or step.peak_bytes <= budget:
                break
        found.append((f"{label}, {m} micro-batch(es)" if budget is not None else label, step))
    return found


def reasoning(
    chain: BlockChain,
    best: Candidate,
    candidates: list[Candidate],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
    memo: SearchMemo,
    near_tie: float,
) -> Reasoning:
    share = best.peak_bytes / budget
    per_sample = best.step_time_s / samples_per_step(setting, best.configuration)
    faster = search(
        chain.blocks,
        rules,
        setting,
        hw,
        float("inf"),
        space,
        time_bound_s=per_sample,
        memo=memo,
        runner_ups=False,
    )
    if faster and (
        faster[0].step_time_s / samples_per_step(setting, faster[0].configuration)
        < per_sample * (1 - ROUNDING)
    ):
        unconstrained = faster[0]
        binding = (
            f"memory: peak {format_bytes(best.peak_bytes)} is {share:.0%} of the budget; with no budget "
            f"the step would take {unconstrained.step_time_s:.4g} s instead of {best.step_time_s:.4g} s "
            f"({unconstrained.configuration.describe()}, peak {format_bytes(unconstrained.peak_bytes)})"
        )
    else:
        binding = f"none: the fastest plan fits (peak {format_bytes(best.peak_bytes)}, {share:.0%} of the budget)"
    listed = candidates[1 : 1 + RUNNER_UPS]
    for c in best_of_each_degree(chain, best, candidates, rules, setting, hw, budget, space, memo):
        if c not in listed:  # one plan may be the best of its tp degree and of its cp degree
            listed.append(c)

    def tie(step_time_s: float, samples: float) -> str:
        """What a runner-up within `near_tie` of the plan is ([Note: near ties] in search.py)."""
        slower = step_time_s / samples / per_sample - 1
        if slower < 0:
            return f"; {-slower:.1%} faster a sample, a near tie: the simpler plan was chosen"
        return f"; near tie: {slower:.1%} slower a sample" if slower <= near_tie else ""

    runner_ups = [
        Alternative(
            description=f"{c.configuration.describe()}, {samples:g} samples a step"
            + tie(c.step_time_s, samples),
            peak_bytes=c.peak_bytes,
            step_time_s=c.step_time_s,
        )
        for c in listed
        for samples in (samples_per_step(setting, c.configuration),)
    ]
    for label, step in expert_defaults(chain, setting, hw, budget):
        fits = budget >= step.peak_bytes
        runner_ups.append(
            Alternative(
                description=f"{label} ({'fits' if fits else 'over budget'}"
                + (
                    tie(
                        step.step_time_s,
                        setting.replica_batch(setting.world_size) * setting.world_size,
                    )
                    if fits
                    else ""
                )
                + ")",
                peak_bytes=step.peak_bytes,
                step_time_s=step.step_time_s,
            )
        )
    return Reasoning(budget_bytes=budget, binding_constraint=binding, runner_ups=tuple(runner_ups))


SEARCHED_DEGREES = (
    ("tp", "tensor_parallel", lambda option: option[0]),
    ("cp", "context_parallel", lambda option: option),
    ("ep", "expert_parallel", lambda option: option),
)
"""The mesh dimensions whose every searched degree the reasoning shows: (Mesh field, Setting field of the
options searched, the degree an option sets; a tp option also says whether it is sequence parallel)."""


def best_of_each_degree(
    chain: BlockChain,
    best: Candidate,
    candidates: list[Candidate],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
    memo: SearchMemo,
) -> list[Candidate]:
    """The fastest plan of each tp, cp and ep degree searched other than the best's: from the candidates
    when one is among them, else searched at that degree alone."""
    found: list[Candidate] = []
    for dimension, options, degree_of in SEARCHED_DEGREES:
        chosen = getattr(best.configuration.mesh, dimension)
        for option in getattr(setting, options):
            degree = degree_of(option)
            if degree == chosen:
                continue
            mine = [c for c in candidates if getattr(c.configuration.mesh, dimension) == degree]
            only: dict[str, Any] = {options: (option,)}
            found += (
                mine[:1]
                or search(
                    chain.blocks,
                    rules,
                    replace(setting, **only),
                    hw,
                    budget,
                    space,
                    memo=memo,
                    runner_ups=False,
                )[:1]
            )
    return found


def constraints_blamed(
    chain: BlockChain,
    constraints: Constraints | None,
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
) -> str | None:
    """When the constraints alone make the plan infeasible, say which of them to relax."""
    if constraints is None or not constraint_patterns(constraints):
        return None
    if smallest_peak(chain.blocks, block_rules(chain, None), setting, hw, space, budget) is None:
        return None
    blamed = [
        f"{field.name}={getattr(constraints, field.name)!r}"
        for field in dataclasses.fields(constraints)
        if getattr(constraints, field.name)
        and smallest_peak(
            chain.blocks,
            block_rules(chain, replace(constraints, **{field.name: ()})),
            setting,
            hw,
            space,
            budget,
        )
        is not None
    ]
    return (
        f"no plan fits {format_bytes(budget)} per rank at world_size={setting.world_size} under the constraints, "
        "and one fits without them: relax "
        + (" or ".join(blamed) if blamed else "them (no one alone is to blame)")
    )


def infeasible_message(
    chain: BlockChain,
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
    memo: SearchMemo | None = None,
) -> str:
    """Name the smallest budget that fits and each option that would make the plan fit; or, where no mesh
    takes the batch at all, that cause. `memo`: the failed search's, whose setting and space the
    smallest peak searches again (the other options change them)."""
    least = smallest_peak(chain.blocks, rules, setting, hw, space, memo=memo)
    if least is None and not configurations(setting, len(chain.blocks)):
        return _batch_taken_by_no_mesh(setting, len(chain.blocks))
    head = f"no plan fits {format_bytes(budget)} per rank at world_size={setting.world_size}" + (
        f": the smallest peak any plan reaches is {format_bytes(least)}, so a budget of "
        f"{least / 2**30:.3g} GiB would fit"
        if least is not None
        else ""
    )
    options = []

    def fits_with(label: str, new_setting: Setting, new_space: SearchSpace) -> bool:
        peak = smallest_peak(chain.blocks, rules, new_setting, hw, new_space, budget)
        if peak is not None:
            options.append(f"{label} (needs {format_bytes(peak)})")
            return True
        return False

    if not space.allow_offload:
        fits_with("allow_offload=True", setting, replace(space, allow_offload=True))
    if not setting.allow_pipeline:
        fits_with("allow_pipeline=True", replace(setting, allow_pipeline=True), space)
    for factor in (2, 4, 8, 16, 32, 64):
        if fits_with(
            f"world_size={setting.world_size * factor}",
            replace(setting, world_size=setting.world_size * factor),
            space,
        ):
            break
    fits_with(
        "a smaller micro-batch (halve the per-replica batch or sequence)",
        replace(
            setting, batch_size=setting.batch_size * 2, max_micro_batches=2 * setting.batch_size
        ),
        space,
    )
    if not options:
        return head + (
            "; neither offload, a pipeline, 64x the ranks nor half the micro-batch would fit: "
            "raise memory_budget or use a smaller model"
        )
    return head + "; it would fit with " + ", or with ".join(options)


def _batch_taken_by_no_mesh(setting: Setting, n_blocks: int) -> str:
    """Why no mesh of the world was searched: an empty example batch, or a global batch that no mesh's
    data-parallel degree divides; memory has nothing to do with it."""
    if setting.batch_size < 1:  # else the example's batch fits a mesh of dp = world at least
        return EMPTY_BATCH
    batch = int(setting.global_batch_size or 0)
    degrees = sorted(
        {c.mesh.dp for c in configurations(replace(setting, global_batch_size=None), n_blocks)}
    )
    fits = min(dp * (batch // dp + 1) for dp in degrees)  # the next batch one of them divides
    pipeline = (
        "; or allow_pipeline=True, whose stages leave fewer replicas"
        if not setting.allow_pipeline
        and configurations(replace(setting, allow_pipeline=True), n_blocks)
        else ""
    )
    return (
        f"the global batch of {batch} samples splits evenly over none of the data-parallel degrees searched at "
        f"world_size={setting.world_size} ({', '.join(map(str, degrees))}): give a global batch one of them "
        f"divides (e.g. {fits}){pipeline}"
    )
