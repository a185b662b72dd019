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

[Note: pipelined shapes] A pipelined plan takes the batches a plan without a
pipeline takes (see [Note: admitted shapes] in program.py): any batch size and
sequence length whose predicted peak fits, refused or warned of as there. The
stages cannot run another shape as planned: the captured graph bakes a
micro-batch's sizes into its reshapes, the schedule's receive buffers are
sized to what crosses a cut, and that need not scale with the batch (a
Llama's rotary tables are (1, T, d)). So the first step (or evaluation) at a
new micro-batch shape captures the model again at that shape and cuts this
rank's stages out of it (about as long as the capture at start-up: 0.3 s for
the tests' GPT and Llama), and a new schedule runs them over the same units:
no parameter is copied. The cut is kept for the next batch of that shape, up
to KEPT_CUTS of them, the least recently run dropped first. A kept cut holds
torch's receive buffers, a replica batch of the values crossing its cuts
(each micro-batch's inputs and output gradients) at its shape, which the
plan prices once: each other kept cut adds its own beside the prediction. So
pad sequences to a multiple (a collator's pad_to_multiple_of) so that few
shapes recur: with more than KEPT_CUTS in turn, every change of shape
captures again.
A schedule runs micro-batches of one shape, so a batch must split into the
plan's number of equal micro-batches (admit_input refuses one that does not,
rather than weigh unequal ones as `step` at pp == 1 does), and each
micro-batch's loss is divided by their number, as planned. Every rank of a
pipeline (the stages of one replica and tp index) must pass the same shape:
they compare it each step, over a gloo group of their own (two all-reduces of
a few integers, on the host), and refuse a step they disagree on before any
stage runs; replicas may differ, as they may at pp == 1.
"""

import collections
import contextlib
import functools
from typing import Any, Callable, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.fx import _pytree as fx_pytree
from torch.utils import _pytree as pytree

from shardplan.errors import PlanError, RuntimeMismatchError, ShardplanError
from shardplan.frontend.capture import put_stand_ins
from shardplan.frontend.chain import InputSpec
from shardplan.frontend.passes.blocks import attribute_of
from shardplan.plan import MULTI_STAGE_SCHEDULES, SCHEDULE_NAMES, Plan
from shardplan.runtime import collectives
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.program import Program, admit_input, batch_inputs, refuse_optimizers_over
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
    micro_batch_of,
    run_blocks,
    split_stages,
)

KEPT_CUTS = 4
"""The most micro-batch shapes a pipelined program keeps its stages cut at (see [Note: pipelined
shapes])."""


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
    by a GPipe or 1F1B schedule of torch.distributed.pipelining, one schedule per micro-batch shape
    stepped (see [Note: pipelined step] and [Note: pipelined shapes]). A backend supplies the module the
    schedule runs and what happens around a schedule's run."""

    graph: StageGraph
    """This rank's (first) stage at the planned shape."""
    runs_schedules: tuple[str, ...] = ("gpipe", "1f1b")
    """The schedules the backend runs: one stage per rank, each backward whole."""
    _device: torch.device
    _pipeline: collectives.Group
    """This rank's replica and tp index on every stage: activations flow between them."""
    ties: "list[_Tie]" = []
    """This rank's part of each tie across stages it holds (see [Note: tied weights across stages])."""

    def _graphs(self) -> tuple[StageGraph, ...]:
        """This rank's stages at the planned shape, in order: one, or its virtual stages."""
        return (self.graph,)

    def _start_schedules(self) -> None:
        if self.plan.schedule.name not in self.runs_schedules:
            raise PlanError(
                f"schedule {self.plan.schedule.name!r} runs on backend='shardplan' only: this backend "
                "builds one stage per rank and reduces gradients in one whole backward (virtual stages "
                "need several, the zero-bubble schedule splits the backward); use backend='shardplan', "
                f"or a plan with {' or '.join(self.runs_schedules)}"
            )
        self._planned = micro_batch_of(self.plan.inputs, self.plan.schedule.num_micro_batches)
        self._cuts = collections.OrderedDict(
            [(self._planned, self._schedule(self._graphs(), self._planned))]
        )
        """This rank's torch.distributed.pipelining schedule at each micro-batch shape kept, the least
        recently run first (see [Note: pipelined shapes])."""
        self._shape_peers = collectives.stages_group(
            self.plan.mesh, tuple(range(self.plan.mesh.pp)), backend="gloo"
        )
        """This rank's pipeline, on the host: where its ranks compare the shape of each step."""

    def _stage_module(self, graph: StageGraph, shape: tuple[InputSpec, ...]) -> nn.Module:
        """The module running `graph`, this rank's stage cut at micro-batch `shape`."""
        raise NotImplementedError

    def _forget(self, shape: tuple[InputSpec, ...]) -> None:
        """Drop what the backend keeps of the cut at `shape`, no longer kept (see [Note: pipelined shapes])."""

    @contextlib.contextmanager
    def _running(self, shape: tuple[InputSpec, ...]):
        """The context the schedule for micro-batch `shape` runs in."""
        self._copy_tied_values()
        yield

    def _gradients_done(self, planned: bool) -> None:
        """After a step's schedule: the gradients complete (`planned`: the step took the planned shape)."""
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

    def _pipeline_stage(self, graph: StageGraph, shape: tuple[InputSpec, ...]):
        """torch's PipelineStage running `graph`, cut at micro-batch `shape`."""
        return self._stage_class(graph)(
            self._stage_module(graph, shape),
            graph.index,
            len(self.plan.stages),
            self._device,
            group=self._pipeline,
            input_args=tuple(graph.examples[name] for name in graph.inbound),
            output_args=tuple(graph.examples[name] for name in graph.outbound),
        )

    def _schedule(self, graphs: tuple[StageGraph, ...], shape: tuple[InputSpec, ...]):
        """A schedule running this rank's stages, `graphs`, over the parameters built at start-up."""
        stages = [self._pipeline_stage(graph, shape) for graph in graphs]
        name = self.plan.schedule.name
        return schedule_class(name)(
            stages if name in MULTI_STAGE_SCHEDULES else stages[0],
            n_microbatches=self.plan.schedule.num_micro_batches,
            loss_fn=self._micro_batch_loss,
            scale_grads=False,
        )

    def _schedule_for(self, shape: tuple[InputSpec, ...]):
        """The schedule for micro-batches of `shape`, cut at its first step and kept (see [Note: pipelined
        shapes])."""
        if shape in self._cuts:
            self._cuts.move_to_end(shape)
            return self._cuts[shape]
        every = split_stages(self.module, self.plan, self._device, shape)
        graphs = tuple(every[graph.index] for graph in self._graphs())
        if [(call.node, call.unit) for graph in graphs for call in graph.calls] != [
            (call.node, call.unit) for graph in self._graphs() for call in graph.calls
        ]:
            raise ShardplanError(
                f"the model captured at micro-batch {_shown(shape)} splits into other blocks than "
                f"at the planned {_shown(self._planned)}: pass batches of the planned shape, or "
                "plan with pp=1"
            )
        self._cuts[shape] = self._schedule(graphs, shape)
        if len(self._cuts) > KEPT_CUTS:
            self._forget(self._cuts.popitem(last=False)[0])
        return self._cuts[shape]

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
        count = self.plan.schedule.num_micro_batches
        admit_input(
            self.plan,
            args,
            kwargs,
            micro_batches=count,
            trains=method == "step",
            over_budget=self.over_budget,
        )
        args, target = self.split_target(args)
        shape = micro_batch_of(batch_inputs(self.plan, args, kwargs), count)
        self._check_same_shape(shape)
        run = getattr(self._schedule_for(shape), method)
        indices = [graph.index for graph in self._graphs()]
        first, last = 0 in indices, len(self.plan.stages) - 1 in indices
        inputs = fx_pytree.tree_flatten_spec((args, kwargs), self.graph.input_spec) if first else ()
        if last and target is None:  # the schedule computes a loss only given a target to split
            target = torch.zeros(count)
        losses: list[torch.Tensor] = []
        with self._transaction():
            with self._running(shape):
                run(*inputs, target=target if last else None, losses=losses, return_outputs=False)
            if torch.is_grad_enabled():  # a step, not an evaluation
                self._gradients_done(planned=shape == self._planned)  # as Program.step says
            mine = (
                torch.stack([loss.detach().float().cpu() for loss in losses]).sum()
                if last
                else torch.zeros(())
            )
            # every tp rank of the last stage computed the same losses (see [Note: tensor parallel stages])
            return collectives.all_reduce_sum(mine) / (self.plan.mesh.dp * self.plan.mesh.tp)

    def _check_same_shape(self, shape: tuple[InputSpec, ...]) -> None:
        """Refuse, on every rank of this pipeline, a step whose ranks were given micro-batches of different
        shapes, before any stage runs (see [Note: pipelined shapes])."""
        sizes = [size for spec in shape for size in spec.shape]
        if not collectives.same_on_all_ranks(sizes, self._shape_peers):
            raise RuntimeMismatchError(
                f"the ranks of a pipeline (the stages of one replica) were given batches of different "
                f"shapes (rank {collectives.world().rank}: micro-batches {_shown(shape)}): give every "
                "rank of a replica the same batch (Mesh.replica_of(rank) names the replica)"
            )

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
            unit.checkpoint.selective for unit in plan.units
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

    def _stage_module(self, graph: StageGraph, shape: tuple[InputSpec, ...]) -> nn.Module:
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
    def _running(self, shape: tuple[InputSpec, ...]):
        self._forwards_this_step = dict.fromkeys(self._forwards_this_step, 0)
        try:
            with super()._running(shape):
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


def _shown(shape: tuple[InputSpec, ...]) -> str:
    """A micro-batch's shape as messages show it: each input's name and sizes."""
    return ", ".join(f"{spec.name} {list(spec.shape)}" for spec in shape)


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
