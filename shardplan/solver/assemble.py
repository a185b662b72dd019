"""The chosen candidate written as a Plan's parts: its units and stages, what its tp ranks slice, the inputs
one replica takes, and the predicted terms of its stages."""

import dataclasses
from collections.abc import Sequence
from dataclasses import replace

from shardplan.costmodel import cost
from shardplan.costmodel.hardware import HardwareModel
from shardplan.frontend.chain import Block, BlockChain, InputSpec
from shardplan.plan import (
    KeptWhole,
    Mesh,
    Predicted,
    ShardedModule,
    Stage,
    TensorParallel,
    Unit,
)
from shardplan.solver.search import Candidate, Configuration, Setting, walk_stage


def example_batch(chain: BlockChain) -> int:
    return chain.inputs[0].shape[0] if chain.inputs and chain.inputs[0].shape else 1


def replica_inputs(chain: BlockChain, replica_batch: int) -> tuple[InputSpec, ...]:
    """The chain's example inputs with one replica's batch along dim 0 (the example's own without a
    global batch). A plan `solve` makes from the chain alone keeps the chain's fingerprint, which
    then names the example's shapes: `compile` fingerprints the replica's."""
    batch = example_batch(chain)
    return tuple(
        replace(spec, shape=(replica_batch, *spec.shape[1:]))
        if spec.shape and spec.shape[0] == batch
        else spec
        for spec in chain.inputs
    )


def _unit_name(blocks: Sequence[Block]) -> str:
    first, last = blocks[0].name or "<root>", blocks[-1].name or "<root>"
    return first if len(blocks) == 1 else f"{first}..{last}"


def units_and_stages(
    chain: BlockChain, candidate: Candidate
) -> tuple[tuple[Unit, ...], tuple[Stage, ...]]:
    units, stages, taken = [], [], set()
    for index, cut in enumerate(candidate.stages):
        names = []
        ends = cut.solution.bounds[1:] + (cut.end,)
        for start, end, decision in zip(cut.solution.bounds, ends, cut.solution.decisions):
            blocks = chain.blocks[start:end]
            name = _unit_name(blocks)
            if name in taken:  # blocks of the model's root share the name "<root>"
                name = f"{name}#{start}"
            taken.add(name)
            names.append(name)
            modules = tuple(m for b in blocks for m in (b.modules or (b.name,)))
            units.append(
                Unit(
                    name=name,
                    modules=modules,
                    params=tuple(p for b in blocks for p in b.param_names),
                    **dataclasses.asdict(decision),
                )
            )
        stages.append(Stage(index=index, units=tuple(names)))
    return tuple(units), tuple(stages)


def tensor_parallel_section(chain: BlockChain, configuration: Configuration) -> TensorParallel:
    """What the plan's tp ranks slice (TensorParallelFacts.sharded of each block that slices at tp),
    and the blocks that could slice and stay whole, with the reason."""
    tp = configuration.mesh.tp
    facts = [(b, b.tensor_parallel) for b in chain.blocks if b.tensor_parallel is not None]
    if tp == 1:
        return TensorParallel()
    sharded = tuple(
        ShardedModule(path=path, style=style)
        for _, f in facts
        if f.slices_at(tp)
        for path, style in f.sharded
    )
    return TensorParallel(
        sequence_parallel=configuration.sequence_parallel,
        vocab_parallel=any(m.style.startswith("vocab") for m in sharded),
        loss_parallel=any(f.sharded_loss for _, f in facts if f.slices_at(tp)),
        sharded=sharded,
        kept_whole=tuple(
            KeptWhole(module=b.name, reason=str(f.refusal(tp)))
            for b, f in facts
            if not f.slices_at(tp)
        ),
    )


def stage_costs(
    chain: BlockChain, candidate: Candidate, setting: Setting, hw: HardwareModel
) -> list[cost.StepCost]:
    """Every stage's StepCost, walked event by event (cost.evaluate_stage)."""
    return [
        walk_stage(
            chain.blocks,
            index,
            cut.start,
            cut.end,
            tuple(b - cut.start for b in cut.solution.bounds),
            cut.solution.decisions,
            setting,
            candidate.configuration,
            hw,
        )
        for index, cut in enumerate(candidate.stages)
    ]


def predict(
    chain: BlockChain, candidate: Candidate, setting: Setting, hw: HardwareModel
) -> Predicted:
    """The peak stage's memory terms and the slowest stage's time terms."""
    costs = stage_costs(chain, candidate, setting, hw)
    names = [unit.name for unit in units_and_stages(chain, candidate)[0]]
    return predicted_terms(chain, costs, names, candidate.configuration.mesh, setting, hw)


def predicted_terms(
    chain: BlockChain,
    costs: list[cost.StepCost],
    unit_names: list[str],
    mesh: Mesh,
    setting: Setting,
    hw: HardwareModel,
) -> Predicted:
    ranks = cost.pipeline_ranks(costs)  # a rank may run several (virtual) stages
    peak = max(ranks, key=lambda c: c.peak_bytes)
    slowest = max(ranks, key=lambda c: c.step_time_s)
    samples = setting.replica_batch(mesh.dp) * mesh.dp
    samples_per_s = samples / slowest.step_time_s if slowest.step_time_s else 0.0
    # Peak FLOP/s is read from the profile's matmul table where it has one (MFU is for people only). The FLOPs
    # keep a causal mask's masked ones, which a profile may not time: the convention is Predicted.mfu's.
    matmul = getattr(hw, "matmul", {}).get(setting.mixed_precision.param_dtype)
    peak_flops = getattr(matmul, "peak_flops_per_s", 0.0)
    model_flops = (chain.fwd_flops + chain.bwd_flops) * samples / setting.batch_size
    mfu = (
        model_flops / (slowest.step_time_s * setting.world_size * peak_flops)
        if peak_flops and slowest.step_time_s
        else 0.0
    )
    return Predicted(
        peak_bytes=peak.peak_bytes,
        step_time_s=slowest.step_time_s,
        memory_bytes=dict(peak.memory_bytes),
        time_s=dict(slowest.time_s),
        samples_per_s=samples_per_s,
        mfu=mfu,
        units=tuple(
            replace(unit, unit=name)
            for name, unit in zip(unit_names, (u for c in costs for u in c.units), strict=True)
        ),
    )
