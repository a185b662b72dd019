"""A plan's own decisions priced on a chain: how a plan written by hand (runtime.manual_plan), or one a
solve made, is checked against what the runtime measures."""

import os
from dataclasses import replace

from shardplan.costmodel import cost
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.errors import PlanError
from shardplan.frontend.chain import BlockChain, TensorParallelFacts
from shardplan.plan import MixedPrecision, Plan, Predicted
from shardplan.solver.assemble import example_batch, predicted_terms
from shardplan.solver.search import Configuration, Setting, walk_stage


def evaluate(
    chain: BlockChain,
    plan: Plan,
    hardware: str | os.PathLike | HardwareProfile | None = None,
    *,
    runtime: cost.Runtime | None = None,
) -> Predicted:
    """What the cost model predicts for `plan`'s own decisions on `chain`, a plan written by hand
    (runtime.manual_plan) included. `runtime`: the kernels another runtime runs around its collectives,
    priced in place of shardplan's runtime's (cost.CostContext.runtime)."""
    return evaluate_stages(chain, plan, hardware, runtime=runtime)[0]


def check_computes_in(chain: BlockChain, precision: MixedPrecision) -> None:
    """The chain's activations are priced in the dtype the plan computes in: a chain analyzed in another
    dtype would price every activation byte at that dtype's size (twice bf16's in float32)."""
    if chain.computes_in != precision.param_dtype:
        raise PlanError(
            f"the model was analyzed computing in {chain.computes_in}, and the plan computes in "
            f"{precision.param_dtype} (mixed precision's param_dtype): analyze it with "
            f"analyze(model, ..., compute_dtype={precision.param_dtype!r}) (compile does so itself)"
        )


def _check_tensor_parallel(chain: BlockChain, plan: Plan) -> None:
    """A plan may slice a block's modules over tp only where the block's sizes divide by tp."""
    tp, named = plan.mesh.tp, {m.path for m in plan.tensor_parallel.sharded}
    for block in chain.blocks:
        facts = block.tensor_parallel
        refusal = facts.refusal(tp) if facts is not None else None
        if refusal and named.intersection(path for path, _ in facts.sharded):  # type: ignore[union-attr]
            raise PlanError(
                f"the plan slices {block.name!r} over tp={tp}, but {refusal}: choose such a tp, or "
                "list its modules as kept whole"
            )


def _sliced_as_planned(chain: BlockChain, plan: Plan) -> BlockChain:
    """`chain` with tensor-parallel facts on the blocks whose modules the plan slices only: a block it
    keeps whole (an embedding of a plan without vocab_parallel) is priced whole, and a head whose loss
    could run on its vocabulary slices is priced with its logits gathered unless the plan says loss_parallel."""
    named = {m.path for m in plan.tensor_parallel.sharded}

    def planned(facts: TensorParallelFacts | None) -> TensorParallelFacts | None:
        if facts is None or not named.intersection(path for path, _ in facts.sharded):
            return None
        if facts.gathered_loss is not None and not plan.tensor_parallel.loss_parallel:
            return facts.gathered_loss
        return facts

    return replace(
        chain,
        blocks=tuple(replace(b, tensor_parallel=planned(b.tensor_parallel)) for b in chain.blocks),
    )


def evaluate_stages(
    chain: BlockChain,
    plan: Plan,
    hardware: str | os.PathLike | HardwareProfile | None = None,
    *,
    runtime: cost.Runtime | None = None,
) -> tuple[Predicted, tuple[cost.StepCost, ...]]:
    """evaluate's prediction and each pipeline stage's own cost, in stage order: a runtime that holds more than
    the plan on some stages (another framework's state) may have its peak on a stage that is not the plan's."""
    hw = get_hardware(hardware or plan.hardware)
    check_computes_in(chain, plan.mixed_precision)
    _check_tensor_parallel(chain, plan)
    chain = _sliced_as_planned(chain, plan)
    unit_of = {param: index for index, unit in enumerate(plan.units) for param in unit.params}
    owners: list[int] = []
    for block in chain.blocks:
        owned = [unit_of[p] for p in block.param_names if p in unit_of]
        if len(set(owned)) > 1 or (not owned and not owners):
            raise PlanError(
                f"block {block.name!r} is not inside one unit of the plan: units must be runs of "
                "whole blocks (see shardplan.frontend.passes.analyze) for the cost model to price them"
            )
        owners.append(owned[0] if owned else owners[-1])
    if owners != sorted(owners):
        raise PlanError(
            "the plan's units do not follow the model's execution order: list them in that order"
        )
    stage_of_unit = plan.stage_of_unit
    setting = Setting(
        world_size=plan.world_size,
        batch_size=example_batch(chain),
        mixed_precision=plan.mixed_precision,
        optimizer=plan.optimizer,
        skip_edges=chain.skip_edges,
        tied_edges=chain.tied_edges,
        global_batch_size=plan.mesh.dp * plan.batch_per_replica if plan.inputs else None,
        runtime=runtime,
    )
    configuration = Configuration(
        mesh=plan.mesh,
        schedule=plan.schedule,
        sequence_parallel=plan.tensor_parallel.sequence_parallel,
    )
    steps, names = [], []
    for stage in range(len(plan.stages)):
        blocks = [
            i for i, owner in enumerate(owners) if stage_of_unit[plan.units[owner].name] == stage
        ]
        start, end = blocks[0], blocks[-1] + 1
        unit_starts = [i for i in blocks if i == start or owners[i] != owners[i - 1]]
        decisions = tuple(plan.units[owners[i]] for i in unit_starts)  # a Unit is its Decision
        names += [unit.name for unit in decisions]
        steps.append(
            walk_stage(
                chain.blocks,
                stage,
                start,
                end,
                tuple(i - start for i in unit_starts),
                decisions,
                setting,
                configuration,
                hw,
            )
        )
    return predicted_terms(chain, steps, names, plan.mesh, setting, hw), tuple(steps)
