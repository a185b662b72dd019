"""pp > 1: the plan's stages run by torch.distributed.pipelining, on either backend.

Rank r is pipeline rank r // (dp · tp) (plan.Mesh, [Note: rank layout]) and holds
its stage, or with v virtual stages per rank stages r // (dp · tp) + k · pp. Its
stages are cut out of the captured graph (see [Note: stage graphs] in stage_split.py);
a GPipe or 1F1B schedule runs the stage (interleaved 1F1B or the zero-bubble
schedule its stages, on backend="shardplan") and sends activations and their
gradients to the neighbouring stages of the same replica and tp index
(StagedProgram, for both backends). On backend="shardplan" (PipelinedProgram) the stage's units are
built as without pipelining, but sharded over the stage's data-parallel group;
backend="fsdp2" shards them with fully_shard ([Note: FSDP2 stages] in fsdp2.py).

[Note: tensor parallel stages] With tp > 1 the model is sliced over this rank's
tp group (tp consecutive ranks of one stage, as at pp = 1: tensor_parallel.py)
before the stages are cut, so each stage runs the sliced model's graph: this
rank's widths, and tensor parallelism's exchanges as nodes of it (a custom op
that runs the collective over the tp group: [Note: exchanges in captured graphs]).
Each tp rank sends to and receives from the rank of the same tp index on the
neighbouring stages what its own graph holds at the cut: the whole residual
stream (the same on every tp rank), or, under sequence parallelism and at a cut
between the first and the last sequence-parallel layer, this rank's part of the
sequence: 1/tp of the activations, as the cost model prices a cut. The
embeddings (vocab-parallel, where the plan says) run on the first stage, the
head on the last, whose logits are gathered whole before the model's own loss,
or read as this rank's slice by the loss on sharded logits (loss_parallel): either
way every tp rank of the last stage computes the same loss.

[Note: tied weights across stages] A parameter two stages read (an LM head tied to the
input embedding) lives in its plan unit on its own stage; each other stage reading it
holds a copy of that unit, built from the same spec, so it is laid out and sharded alike
(as Megatron-LM's embedding group). Each step, before the schedule runs, the owner's
values are broadcast to the copies (a checkpoint loaded or an optimizer step changes only
the owner); after backward the copies' sharded gradients are summed into the owner's over
the ranks of those stages that share a replica and tp index. Only the owner is stepped,
saved and counted in the gradient norm, so a checkpoint holds the weight once.

[Note: pipelined step] `step` means what it means at pp == 1: the loss
averaged over micro-batches and ranks, and gradients of that average. Each
micro-batch's loss is divided by their number (so the schedule is told not to
scale gradients), and a micro-batch's backward reduces gradients only when it
is the last micro-batch, decided when its forward runs (scheduler._GatherFlat):
the schedule interleaves forwards and backwards of different micro-batches.
A step that fails on any stage leaves the ranks out of step (see [Note:
failed steps] in program.py): every later call refuses.

[Note: smaller pipelined batches] A batch smaller than planned along dim 0 (an
epoch's last, an evaluation batch) is taken when it splits into the plan's
number of equal micro-batches, so each micro-batch's loss is still divided by
their number (see [Note: smaller batches] in program.py for pp == 1, where
they may differ). The stages cannot run it as planned: the captured graph
bakes the micro-batch's sizes into its reshapes, and what crosses a cut need
not scale with the batch (a Llama's rotary tables are (1, T, d)). So the first
step at a new batch size captures the model again at its micro-batch and cuts
this rank's stage out of it (about as long as the capture at start-up: 0.3 s
for the tests' GPT and Llama), and a second schedule runs it over the same
units: no parameter is copied, and only that schedule's receive buffers are
new. Every rank of a step must pass the same batch size, as they must at pp == 1.
"""

import contextlib
import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.capture import put_stand_ins
from shardplan.frontend.passes.blocks import attribute_of
from shardplan.plan import MULTI_STAGE_SCHEDULES, SCHEDULE_NAMES, Checkpoint, Plan
from shardplan.runtime import collectives
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.program import (
    Program,
    check_batch,
    check_micro_batches,
    refuse_optimizers_over,
)
from shardplan.runtime.scheduler import Scheduler
from shardplan.runtime.sharded import (
    UnitProgram,
    apply_plan_tensor_parallel,
    build_units,
    unit_place,
)
from shardplan.runtime.stage_split import (
    BlockCall,
    StageGraph,
    StageModule,
    block_runner,
    run_blocks,
    split_stages,
)


def schedule_class(name: str) -> Callable:
    """What makes schedule `name`, called as torch.distributed.pipelining's schedule classes are: 1F1B over
    any number of micro-batches (see [Note: 1F1B over fewer micro-batches than stages] in pipeline_schedules.py);
    a schedule of MULTI_STAGE_SCHEDULES takes the list of this rank's stages."""
    from shardplan.runtime.pipeline_schedules import SCHEDULES

    if name not in SCHEDULES:
        raise PlanError(
            f"the plan pipelines with schedule {name!r}: a plan with pp > 1 runs one of "
            f"{', '.join(SCHEDULES)}; re-plan with shardplan.compile"
        )
    return SCHEDULES[name]


class StagedProgram(Program):
    """What a pipelined program is on either backend: this rank's stage, cut from the captured graph, run
    by a GPipe or 1F1B schedule of torch.distributed.pipelining, one schedule per replica batch size
    stepped (see [Note: pipelined step] and [Note: smaller pipelined batches]). A backend supplies the
    module the schedule runs and what happens around a schedule's run."""

    graph: StageGraph
    """This rank's (first) stage at the planned batch."""
    runs_schedules: tuple[str, ...] = ("gpipe", "1f1b")
    """The schedules the backend runs: one stage per rank, each backward whole."""
    _device: torch.device
    _pipeline: collectives.Group
    """This rank's replica and tp index on every stage: activations flow between them."""
    ties: "list[_Tie]" = []
    """This rank's part of each tie across stages it holds (see [Note: tied weights across stages])."""

    def _graphs(self) -> tuple[StageGraph, ...]:
        """This rank's stages at the planned batch, in order: one, or its virtual stages."""
        return (self.graph,)

    def _start_schedules(self) -> None:
        if self.plan.schedule.name not in self.runs_schedules:
            raise PlanError(
                f"schedule {self.plan.schedule.name!r} runs on backend='shardplan' only: this backend "
                "builds one stage per rank and reduces gradients in one whole backward (virtual stages "
                "need several, the zero-bubble schedule splits the backward); use backend='shardplan', "
                f"or a plan with {' or '.join(self.runs_schedules)}"
            )
        self._schedules = {
            self.plan.batch_per_replica: self._schedule(self._graphs(), self.plan.batch_per_replica)
        }
        """This rank's torch.distributed.pipelining schedule for each replica batch size stepped, its stage
        cut from a capture at that size (see [Note: smaller pipelined batches])."""

    def _stage_module(self, graph: StageGraph, batch: int) -> nn.Module:
        """The module running `graph`, this rank's stage at a replica batch of `batch` samples."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _running(self, batch: int):
        """The context the schedule for `batch` runs in."""
        self._copy_tied_values()
        yield

    def _gradients_done(self, planned: bool) -> None:
        """After a step's schedule: the gradients complete (`planned`: the step took the planned batch)."""
        self._sum_tied_gradients()
        self._gradients_reduced(planned)

    def _copy_tied_values(self) -> None:
        """The owners' values into their copies on other stages (see [Note: tied weights across stages])."""
        with torch.no_grad():
            for tie in self.ties:
                for parameter in tie.parameters:
                    if tie.is_copy:
                        parameter.grad = None  # what a failed step left
                    collectives.broadcast_from(_local(parameter.detach()), tie.source, tie.group)

    def _sum_tied_gradients(self) -> None:
        """The copies' gradients summed into their owners' (see [Note: tied weights across stages])."""
        for tie in self.ties:
            for parameter in tie.parameters:
                grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
                collectives.all_reduce_sum(_local(grad), tie.group)
                parameter.grad = None if tie.is_copy else grad

    def _stage_class(self, graph: StageGraph) -> Callable:
        """What makes the PipelineStage of `graph`, called as torch's PipelineStage is."""
        from torch.distributed.pipelining import PipelineStage

        return PipelineStage

    def _pipeline_stage(self, graph: StageGraph, batch: int):
        """torch's PipelineStage running `graph` at a replica batch of `batch` samples."""
        return self._stage_class(graph)(
            self._stage_module(graph, batch),
            graph.index,
            len(self.plan.stages),
            self._device,
            group=self._pipeline,
            input_args=tuple(graph.examples[name] for name in graph.inbound),
            output_args=tuple(graph.examples[name] for name in graph.outbound),
        )

    def _schedule(self, graphs: tuple[StageGraph, ...], batch: int):
        """A schedule running this rank's stages, `graphs`, over the parameters built at start-up."""
        stages = [self._pipeline_stage(graph, batch) for graph in graphs]
        name = self.plan.schedule.name
        return schedule_class(name)(
            stages if name in MULTI_STAGE_SCHEDULES else stages[0],
            n_microbatches=self.plan.schedule.num_micro_batches,
            loss_fn=self._micro_batch_loss,
            scale_grads=False,
        )

    def _schedule_for(self, batch: int):
        """The schedule for a replica batch of `batch` samples, made at its first step (see [Note: smaller
        pipelined batches])."""
        if batch not in self._schedules:
            every = split_stages(self.module, self.plan, self._device, batch)
            graphs = tuple(every[graph.index] for graph in self._graphs())
            if [(call.node, call.unit) for graph in graphs for call in graph.calls] != [
                (call.node, call.unit) for graph in self._graphs() for call in graph.calls
            ]:
                raise ShardplanError(
                    f"the model captured at {batch} samples splits into other blocks than at the "
                    f"planned {self.plan.batch_per_replica}: pass batches of the planned size, or "
                    "plan with pp=1"
                )
            self._schedules[batch] = self._schedule(graphs, batch)
        return self._schedules[batch]

    @property
    def keeps_export_copies(self) -> bool:
        return all(
            index == 0
            for dim, index in self.plan.mesh.coordinates(collectives.world().rank).items()
            if dim != "pp"
        )  # one per stage

    def __call__(self, *args, **kwargs) -> Any:
        raise ShardplanError(
            "a pipelined program runs whole training steps, each stage on its own ranks: call "
            "program.step(...); to run the model's forward alone, plan with pp=1"
        )

    def step(self, *args, **kwargs) -> torch.Tensor:
        """As Program.step (see [Note: pipelined step]): call on every rank with its replica's batch."""
        with self._recording_stats():
            return self._run_schedule("step", args, kwargs)

    def evaluate(self, *args, **kwargs) -> torch.Tensor:
        """As Program.evaluate: the schedule's forwards alone, without gradients."""
        with torch.no_grad():
            return self._run_schedule("eval", args, kwargs)

    def _run_schedule(self, method: str, args: tuple, kwargs: dict) -> torch.Tensor:
        self.check_in_step()
        check_batch(self.plan, args, kwargs)
        args, target = self.split_target(args)
        count = self.plan.schedule.num_micro_batches
        check_micro_batches(args, kwargs, count)
        batch = _batch_size(args, kwargs)
        run = getattr(self._schedule_for(batch), method)
        indices = [graph.index for graph in self._graphs()]
        first, last = 0 in indices, len(self.plan.stages) - 1 in indices
        inputs = fx_pytree.tree_flatten_spec((args, kwargs), self.graph.input_spec) if first else ()
        if last and target is None:  # the schedule computes a loss only given a target to split
            target = torch.zeros(count)
        losses: list[torch.Tensor] = []
        with self._transaction():
            with self._running(batch):
                run(*inputs, target=target if last else None, losses=losses, return_outputs=False)
            if torch.is_grad_enabled():  # a step, not an evaluation
                self._gradients_done(
                    planned=batch == self.plan.batch_per_replica
                )  # as Program.step says
            mine = (
                torch.stack([loss.detach().float().cpu() for loss in losses]).sum()
                if last
                else torch.zeros(())
            )
            # every tp rank of the last stage computed the same losses (see [Note: tensor parallel stages])
            return collectives.all_reduce_sum(mine) / (self.plan.mesh.dp * self.plan.mesh.tp)

    def _micro_batch_loss(self, outputs: tuple[torch.Tensor, ...], target: Any) -> torch.Tensor:
        output = pytree.tree_unflatten(list(outputs), self.graph.output_spec)
        loss = self.loss_of(output, target if self.loss_fn is not None else None)
        return loss / self.plan.schedule.num_micro_batches


class PipelinedProgram(StagedProgram, UnitProgram):
    """The units of this rank's stage, sharded over the stage's dp group, run by a pipeline schedule."""

    def __init__(
        self, module: nn.Module, plan: Plan, loss_fn: Callable | None, device: torch.device
    ):
        super().__init__(module, plan, loss_fn)
        self.groups = collectives.mesh_groups(device.type, plan.mesh)
        self._pipeline = self.groups.pipeline
        # sliced before the stages are cut: they run the sliced model's graph (see [Note: tensor parallel stages])
        cuts, partial = apply_plan_tensor_parallel(module, plan, self.groups.tensor_parallel)
        stages = split_stages(module, plan, device)
        reads = units_read(module, plan, stages)  # before the units replace the parameters
        self._stage_graphs = tuple(
            stages[index]
            for index in plan.schedule.stages_of_rank(self.groups.coordinates["pp"], plan.mesh.pp)
        )
        self.graph = self._stage_graphs[0]
        index = self.graph.index
        specs = {unit.name: unit for unit in plan.units}
        tied = tied_stages(plan, stages, reads)
        if tied and plan.schedule.virtual_stages > 1:
            raise PlanError(
                f"units {sorted(tied)} are read on other stages (tied weights), which the runtime "
                "shares between stages of one per rank only: re-plan with virtual_stages=1"
            )
        if plan.schedule.name == "zero_bubble" and any(
            unit.checkpoint is Checkpoint.SELECTIVE for unit in plan.units
        ):
            raise PlanError(
                "the zero-bubble schedule runs each backward in two passes, which torch's selective "
                "checkpointing refuses: re-plan, or checkpoint those units 'full' or 'none'"
            )
        own = tuple(name for graph in self._stage_graphs for name in plan.stages[graph.index].units)
        copied = copied_units(plan, tied, index)
        drop_other_stages(module, plan, own + copied)
        built = build_units(
            module,
            plan,
            device,
            unit_place(plan.mesh, self.groups),
            units=tuple(specs[name] for name in own + copied),
            cuts=cuts,
            partial=partial,
        )
        self.units = built[: len(own)]
        self._by_name = {unit.name: unit for unit in built}
        self.ties = make_ties(plan, tied, index, lambda name: (self._by_name[name].shard,))
        self._reads = reads
        self._device = device
        # the scheduler counts a unit's distinct module paths done (a module called twice counts once)
        calls = [call for graph in self._stage_graphs for call in graph.calls]
        self.scheduler = Scheduler(
            built,
            {unit: len({call.name for call in calls if call.unit == unit.name}) for unit in built},
        )
        self._forwards_this_step = {graph.index: 0 for graph in self._stage_graphs}
        """Micro-batches each of this rank's stages has run forward this step."""
        self._start_schedules()

    runs_schedules = SCHEDULE_NAMES[1:]

    def _graphs(self) -> tuple[StageGraph, ...]:
        return self._stage_graphs

    def _stage_class(self, graph: StageGraph) -> Callable:
        if self.plan.schedule.name != "zero_bubble":
            return super()._stage_class(graph)
        from shardplan.runtime.pipeline_schedules import FlatUnitStage

        # its weights, whose gradients the deferred pass makes: the shards of the units it runs
        shards = tuple(self._by_name[name].shard for name in self.plan.stages[graph.index].units)
        return functools.partial(FlatUnitStage, shards=shards)

    def _stage_module(self, graph: StageGraph, batch: int) -> nn.Module:
        specs = {unit.name: unit for unit in self.plan.units}

        def run_block(call: BlockCall) -> Callable:
            run = self.scheduler.wrap(
                block_runner(call, self.module, graph.constants),
                tuple(self._by_name[name] for name in self._reads[call.node]),
                call.name,
                self._by_name[call.unit],
            )
            return checkpointed(run, specs[call.unit].checkpoint)

        def run_segment(calls: tuple[BlockCall, ...]) -> Callable[[dict], dict]:
            return functools.partial(run_blocks, [(call, run_block(call)) for call in calls])

        return StageModule(
            graph, run_segment, functools.partial(self._micro_batch_forward, graph.index)
        )

    @contextlib.contextmanager
    def _running(self, batch: int):
        self._forwards_this_step = dict.fromkeys(self._forwards_this_step, 0)
        try:
            with super()._running(batch):
                yield
        finally:
            self.scheduler.communicate = True

    def _stopped_together(self) -> bool:
        # a stage that fails leaves its neighbours waiting on activations or gradients it never sends
        # (torch.distributed.pipelining's send and receive, which cannot be drained from here): they
        # fail at the process group's timeout, out of step with it
        return False

    @contextlib.contextmanager
    def _micro_batch_forward(self, stage: int):
        """One micro-batch's forward of stage `stage`: its backward reduces when it is the stage's last."""
        self.scheduler.communicate = (
            self._forwards_this_step[stage] == self.plan.schedule.num_micro_batches - 1
        )
        self._forwards_this_step[stage] += 1
        with self.scheduler.forward_pass():
            yield


def _batch_size(args: tuple, kwargs: dict) -> int:
    """Dim 0 of the batch's first tensor that has one (check_micro_batches made them all equal when the
    plan splits the batch into micro-batches)."""
    return next(
        leaf.shape[0]
        for leaf in pytree.tree_leaves((args, kwargs))
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
    )


class _Tie(NamedTuple):
    """A unit of this rank that a tie across stages shares (see [Note: tied weights across stages])."""

    parameters: tuple[nn.Parameter, ...]
    """What this rank holds of the unit: its flat shard (backend="shardplan"), its parameters' shards (fsdp2)."""
    group: collectives.Group
    """The ranks of the stages holding the unit, of this rank's replica and tp index."""
    source: int
    """The world rank of the group holding the plan's unit, whose values the copies take."""
    is_copy: bool


def copied_units(plan: Plan, tied: dict[str, tuple[int, ...]], index: int) -> tuple[str, ...]:
    """The units of other stages that stage `index` holds a copy of (`tied`: from tied_stages)."""
    own = plan.stages[index].units
    return tuple(name for name, holders in tied.items() if index in holders and name not in own)


def make_ties(
    plan: Plan,
    tied: dict[str, tuple[int, ...]],
    index: int,
    held: Callable[[str], tuple[nn.Parameter, ...]],
) -> "list[_Tie]":
    """Stage `index`'s ties (`tied`: from tied_stages), each with what `held(unit)` says this rank holds of
    the unit; makes every tie's group, so call it on every rank alike."""
    groups = {name: collectives.stages_group(plan.mesh, holders) for name, holders in tied.items()}
    step = plan.mesh.stride("pp")
    return [
        _Tie(
            parameters=held(name),
            group=groups[name],
            is_copy=name not in plan.stages[index].units,
            source=collectives.world().rank + (plan.stage_of_unit[name] - index) * step,
        )
        for name in sorted(tied)
        if index in tied[name]
    ]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a DTensor's local shard, which writes reach)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def units_read(model: nn.Module, plan: Plan, stages: list[StageGraph]) -> dict[str, list[str]]:
    """The units each block needs gathered: its own, and the owners of every parameter it reads (tied
    weights), which another stage may hold (see [Note: tied weights across stages])."""
    unit_of_param = {
        id(model.get_parameter(name)): unit.name for unit in plan.units for name in unit.params
    }
    reads = {}
    for call in (call for graph in stages for call in graph.calls):
        owners = [
            unit_of_param[id(value)]
            for value in map(functools.partial(attribute_of, model), call.attributes)
            if id(value) in unit_of_param
        ]
        reads[call.node] = list(dict.fromkeys([call.unit] + owners))
    return reads


def tied_stages(
    plan: Plan, stages: list[StageGraph], reads: dict[str, list[str]]
) -> dict[str, tuple[int, ...]]:
    """Each unit that a block of another stage reads → every stage holding it (its own and the readers'),
    in name order (every rank makes the groups of ties in the same order)."""
    holders: dict[str, set[int]] = {}
    for graph, call in ((graph, call) for graph in stages for call in graph.calls):
        for name in reads[call.node]:
            if plan.stage_of_unit[name] != graph.index:
                holders.setdefault(name, {plan.stage_of_unit[name]}).add(graph.index)
    return {name: tuple(sorted(holders[name])) for name in sorted(holders)}


def drop_other_stages(model: nn.Module, plan: Plan, units: tuple[str, ...]) -> None:
    """Free the parameters of units this rank does not hold, which it never reads (meta stand-ins keep
    their shapes)."""
    kept = {name for unit in plan.units if unit.name in units for name in unit.params}
    canonical = {id(parameter): name for name, parameter in model.named_parameters()}
    dropped = put_stand_ins(
        model, lambda parameter: not parameter.is_meta and canonical[id(parameter)] not in kept
    )
    refuse_optimizers_over(original for _, _, original in dropped)
