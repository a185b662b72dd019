"""The runtime: run a Plan on every rank (see docs/design.md, "The runtime").

flat_param.py    where each parameter sits in a unit's flat padded buffer
collectives.py   every torch.distributed call (all_gather, reduce_scatter, all_reduce, broadcast) and
                 the process groups of the plan's mesh
unit.py          one unit's state machine: shard, gathered buffer, gradient reduction
scheduler.py     when units are gathered, presented, released, prefetched and reduced
activation_checkpoint.py  recomputing a unit's activations in backward (both backends)
program.py       Program: called as the model, the gradient-sync switch, admit_input (the shapes a plan
                 takes), step / micro-batches / loss / clip_grad_norm_, backend-independent
sharded.py       backend="shardplan": tensor parallelism, then the units over the local slices
tensor_parallel.py  Megatron-style slices of a TensorParallelLayout's pairs, on an eager model
context_parallel.py  cp > 1: this rank's chunks of each sequence, attention over keys and values
                 gathered over the cp group (backend="shardplan")
expert_parallel.py  ep > 1: this rank's routed experts, tokens dispatched to them and combined back
                 by all-to-all over the ep group (backend="shardplan")
stage_split.py   the captured graph split into the plan's stages, and the module that runs one
pipelined.py     pp > 1: this rank's stage under GPipe / 1F1B (both backends); backend="shardplan"'s units
                 of the stage (tp-sliced if tp > 1)
pipeline_schedules.py  torch's GPipe / 1F1B as a plan names them (1F1B over fewer micro-batches than stages)
fsdp2.py         backend="fsdp2": the same plan through torch.distributed.fsdp.fully_shard (and DTensor TP),
                 pipelined plans as torchtitan composes them
manual.py        manual_plan: a plan written by hand (FSDP-style manual wrapping)
model_check.py   whether a plan is for this model: its structural signature, its graph where captured
adascale.py      AdaScale: the learning rate scaled by the gradient's noise, measured where units reduce
checkpoint.py    save / load (any plan, world size, backend) and export_full_state_dict
chunks.py        which chunk of each flattened parameter a rank holds, for checkpoints
measure.py       peak tensor memory and step time of a training step on this rank
launch.py        spawn a world of ranks on this machine and run a job on each (demo, calibration)
host_memory.py   CPU ranks keep the memory they free (no page faults a step)
elastic.py       training under torchrun's elastic launch: re-plan and resume on every (re)start
"""

from typing import Callable

import torch
import torch.nn as nn

from shardplan.errors import PlanError, ShardplanError
from shardplan.plan import Plan
from shardplan.runtime.collectives import shutdown
from shardplan.runtime.host_memory import keep_freed_host_memory
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.model_check import check_model
from shardplan.runtime.program import Program

BACKENDS = ("shardplan", "fsdp2")


def parallelize(
    model: nn.Module,
    plan: Plan,
    *,
    loss_fn: Callable | None = None,
    backend: str = "shardplan",
    device: torch.device | str | None = None,
    verify_graph: bool = False,
    over_budget: str = "refuse",
) -> Program:
    """Shard `model` as `plan` says and return the Program that trains it; call on every rank.

    Call after torch.distributed.init_process_group, with the same plan on every rank. The model
    may live on the meta device: each unit is then initialized by its modules' reset_parameters()
    and only this rank's shard is kept. `device` defaults to the current CUDA device under NCCL,
    else CPU.

    A plan made for another model is refused by its structural signature (module classes, parameter
    names, shapes, dtypes); `verify_graph=True` also captures the model (torch.export, seconds) and
    compares the graph's fingerprint, which refuses the same parameters computed another way. With
    tp > 1 the graph is captured for the layout anyway and always compared.

    A training batch whose shape the plan predicts over its memory budget (Plan.sequence_limits) is
    refused in one line naming the longest sequence that fits; `over_budget="warn"` warns instead.

    >>> program = parallelize(model, plan)                          # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(program.parameters(), lr=3e-4)  # doctest: +SKIP
    >>> program(input_ids=ids, labels=ids).loss.backward()          # as under FSDP2; doctest: +SKIP
    >>> optimizer.step(); optimizer.zero_grad()                      # doctest: +SKIP
    >>> loss = program.step(ids, labels=ids)                         # or: micro-batches, averaged loss; doctest: +SKIP
    """
    from shardplan.runtime import collectives

    world = collectives.world()  # first: without a process group, this is the error to give
    collectives.check_same_on_all_ranks(plan.to_json(), "plans")
    _check_mesh(plan, world.size)
    check_model(model, plan, verify_graph=verify_graph)
    _check_coverage(
        plan, dict(model.named_parameters())
    )  # every backend: FSDP2 would train the rest unplanned
    device = torch.device(device) if device is not None else collectives.default_device()
    if device.type == "cpu":
        keep_freed_host_memory()  # see [Note: freed host memory]
    if over_budget not in ("refuse", "warn"):
        raise ShardplanError(f"over_budget={over_budget!r}: choose 'refuse' or 'warn'")
    program = _program(model, plan, loss_fn, backend, device)
    program.over_budget = over_budget
    return program


def _program(
    model: nn.Module, plan: Plan, loss_fn: Callable | None, backend: str, device: torch.device
) -> Program:
    if plan.mesh.cp > 1:
        _check_context_parallel(plan, loss_fn, backend)
    if plan.mesh.ep > 1:
        _check_expert_parallel(plan, backend)
    if backend == "shardplan" and plan.mesh.pp > 1:
        from shardplan.runtime.pipelined import PipelinedProgram

        return PipelinedProgram(model, plan, loss_fn, device)
    if backend == "shardplan":
        from shardplan.runtime.sharded import ShardedProgram

        return ShardedProgram(model, plan, loss_fn, device)
    if backend == "fsdp2" and plan.mesh.pp > 1:
        from shardplan.runtime.fsdp2 import Fsdp2PipelinedProgram

        return Fsdp2PipelinedProgram(model, plan, loss_fn, device)
    if backend == "fsdp2":
        from shardplan.runtime.fsdp2 import Fsdp2Program

        return Fsdp2Program(model, plan, loss_fn, device)
    raise ShardplanError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")


def _check_context_parallel(plan: Plan, loss_fn: Callable | None, backend: str) -> None:
    """What runs a sequence split over cp ranks today (see context_parallel.py)."""
    cp = plan.mesh.cp
    if backend == "fsdp2":
        raise ShardplanError(
            f"backend='fsdp2' does not run context parallelism (cp={cp}): it would need attention "
            "over sequence shards, which shardplan builds on its own units only; use "
            "backend='shardplan', or re-plan with cp=1"
        )
    if plan.mesh.pp > 1:
        raise ShardplanError(
            f"context parallelism (cp={cp}) does not run under a pipeline (pp={plan.mesh.pp}) yet: "
            "re-plan with pp=1 or cp=1"
        )
    if loss_fn is not None:
        raise ShardplanError(
            f"context parallelism (cp={cp}) computes the loss inside the model from labels=..., "
            "shifted over the whole sequence; a loss_fn would see one rank's tokens: drop loss_fn "
            "and pass labels=..., or re-plan with cp=1"
        )


def _check_expert_parallel(plan: Plan, backend: str) -> None:
    """What runs routed experts split over ep ranks today (see expert_parallel.py)."""
    mesh = plan.mesh
    if backend == "fsdp2":
        raise ShardplanError(
            f"backend='fsdp2' does not run expert parallelism (ep={mesh.ep}): it would need the "
            "experts' tokens dispatched by all-to-all, which shardplan builds on its own units only; "
            "use backend='shardplan', or re-plan with ep=1"
        )
    for dim in ("pp", "tp"):
        if getattr(mesh, dim) > 1:
            raise ShardplanError(
                f"expert parallelism (ep={mesh.ep}) does not run with {dim}={getattr(mesh, dim)} "
                f"yet: re-plan with {dim}=1 or ep=1"
            )


def _check_mesh(plan: Plan, world_size: int) -> None:
    mesh = plan.mesh
    if mesh.size != world_size:
        raise ShardplanError(
            f"the plan is for {mesh.describe()} = {mesh.size} ranks but the process group has "
            f"{world_size}: launch {mesh.size} ranks, or re-plan for world_size={world_size}"
        )


def _check_coverage(plan: Plan, named: dict[str, nn.Parameter]) -> None:
    """Every parameter of the model in exactly one unit of the plan, and no other (after check_model: a
    plan with a signature or recorded inputs is for this model, so a mismatch is the plan's own)."""
    source = (
        "the plan's file was edited, or it was made by an older shardplan"
        if plan.signature or plan.inputs
        else "the plan was made for another model"
    )
    listed = set()  # a parameter in two units is a PlanError when the Plan is built
    for unit in plan.units:
        for name in unit.params:
            if name not in named:
                raise PlanError(
                    f"unit {unit.name!r} lists parameter {name!r}, which model.named_parameters() does "
                    f"not list: {source}; re-plan with shardplan.compile for this model"
                )
            listed.add(name)
    missing = sorted(set(named) - listed)
    if missing:
        raise PlanError(
            f"{len(missing)} parameters of the model are in no unit of the plan (first: {missing[:3]}): "
            "the plan is incomplete (its file was edited, or it was written by hand); add them to "
            "units, or re-plan with shardplan.compile"
        )


__all__ = ["parallelize", "shutdown", "manual_plan", "Program", "BACKENDS"]
