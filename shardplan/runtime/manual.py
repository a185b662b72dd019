"""A plan written by hand: units named by their modules, decisions given directly.

This is FSDP's manual wrapping in plan form, for tests, benchmarks, and users
who know their units; `shardplan.compile` is the planner that chooses them.
"""

from collections.abc import Sequence

import torch.nn as nn

from shardplan.errors import PlanError
from shardplan.frontend.passes import fingerprint_of, input_specs, tensor_parallel_candidates
from shardplan.frontend.sharded_loss import sharded_loss_head
from shardplan.frontend.signature import model_signature
from shardplan.plan import (
    Checkpoint,
    Mesh,
    MixedPrecision,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardStrategy,
    Stage,
    TensorParallel,
    Unit,
)
from shardplan.runtime.tensor_parallel import sharded_modules


def manual_plan(
    model: nn.Module,
    groups: Sequence[Sequence[str]],
    *,
    dp: int,
    strategies: Sequence[ShardStrategy] = (ShardStrategy.FULL_SHARD,),
    checkpoints: Sequence[Checkpoint] = (Checkpoint.NONE,),
    offload: Sequence[bool] = (False,),
    prefetch: Sequence[bool] = (True,),
    micro_batches: int = 1,
    precision: MixedPrecision = MixedPrecision(),
    pp: int = 1,
    schedule: str = "gpipe",
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    dp_replicate: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    loss_parallel: bool = True,
    cp: int = 1,
    ep: int = 1,
) -> Plan:
    """One unit per group of module paths; unit i takes decision i modulo each sequence's length.

    A unit's parameters are those under its modules, in model.named_parameters() order; with
    pp > 1 the units are cut into pp stages of counts as equal as can be, run by `schedule` ("gpipe" or "1f1b").
    Example inputs (one replica's batch) are recorded with the graph's fingerprint, as compile
    records them: a pipelined plan needs them to cut its stages, a tensor-parallel one to find its layout.
    The model's structural signature is recorded with or without them: parallelize refuses the plan
    for a model of other modules or parameters.

    The mesh is pp × dp_replicate × dp × cp × tp: `dp` ranks shard each unit (dp_shard), `dp_replicate`
    groups of them hold the same shards (HSDP), and with tp > 1 the pairs the captured graph offers
    at that degree are sliced over tp ranks (passes/tensor_parallel.py), with `sequence_parallel` and
    `vocab_parallel` as its layout takes them; with `loss_parallel` the loss runs on the vocab-parallel
    head's slices of the logits where the model's loss allows it (frontend/sharded_loss.py), else they
    are gathered whole before it. With cp > 1 each sequence is split over cp ranks
    ([Note: context parallelism] in plan.py), which shard the units with the dp ranks. With ep > 1 the
    routed experts are split over ep of those ranks ([Note: expert parallelism] in plan.py).

    >>> plan = manual_plan(gpt, [("wte", "wpe"), ("h.0",), ("h.1",), ("ln_f", "lm_head")], dp=2)  # doctest: +SKIP
    """
    names = [name for name, _ in model.named_parameters()]
    units = []
    for index, modules in enumerate(groups):
        params = tuple(
            name for name in names if any(name.startswith(module + ".") for module in modules)
        )
        units.append(
            Unit(
                name="..".join(modules),
                modules=tuple(modules),
                params=params,
                strategy=strategies[index % len(strategies)],
                checkpoint=checkpoints[index % len(checkpoints)],
                offload=offload[index % len(offload)],
                prefetch=prefetch[index % len(prefetch)],
            )
        )
    count = len(units)
    stages = tuple(
        Stage(
            index=index,
            units=tuple(
                unit.name for unit in units[index * count // pp : (index + 1) * count // pp]
            ),
        )
        for index in range(pp)
    )
    inputs = input_specs(tuple(example_inputs), dict(example_kwargs or {}))
    mesh = Mesh(dp_shard=dp, dp_replicate=dp_replicate, tp=tp, pp=pp, cp=cp, ep=ep)
    return Plan(
        fingerprint=fingerprint_of(model, inputs) if inputs else "manual",
        signature=model_signature(model),
        model=type(model).__name__,
        world_size=mesh.size,
        hardware="unknown",
        inputs=inputs,
        mesh=mesh,
        tensor_parallel=_tensor_parallel(
            model,
            tp,
            sequence_parallel,
            vocab_parallel,
            loss_parallel,
            example_inputs,
            example_kwargs,
        ),
        schedule=Schedule(num_micro_batches=micro_batches, name="none" if pp == 1 else schedule),
        mixed_precision=precision,
        units=tuple(units),
        stages=stages,
        predicted=Predicted(peak_bytes=0, step_time_s=0.0),
        reasoning=Reasoning(budget_bytes=0, binding_constraint="none: written by hand"),
    )


def _tensor_parallel(
    model: nn.Module,
    tp: int,
    sequence_parallel: bool,
    vocab_parallel: bool,
    loss_parallel: bool,
    example_inputs: tuple,
    example_kwargs: dict | None,
) -> TensorParallel:
    """What the captured graph slices over `tp` ranks, as a plan says it."""
    if tp == 1:
        return TensorParallel()
    if not example_inputs and not example_kwargs:
        raise PlanError(
            f"a plan with tp={tp} needs example_inputs: the tensor-parallel layout is found in the "
            "graph they capture"
        )
    layout = tensor_parallel_candidates(model, tuple(example_inputs), example_kwargs).layout(
        tp, sequence_parallel=sequence_parallel, vocab_parallel=vocab_parallel
    )
    return TensorParallel(
        sequence_parallel=sequence_parallel,
        vocab_parallel=vocab_parallel,
        loss_parallel=loss_parallel
        and layout.head is not None
        and layout.head == sharded_loss_head(model),
        sharded=sharded_modules(layout),
        kept_whole=layout.rejected + layout.deferred,
    )
