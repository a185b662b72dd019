"""backend="fsdp2": the same plan applied with PyTorch's FSDP2 (`fully_shard`) on the unit boundaries.

It is the reference the shardplan runtime is measured against, and a real
option. Units map onto fully_shard groups by their modules (a unit of several
modules is one group); parameters owned by no unit module go to the root's
group. FSDP2 has no ZeRO-1 or DDP mode inside fully_shard: SHARD_OPTIMIZER and
REPLICATE units run as SHARD_GRAD_OP (the same arithmetic, with gradients and
optimizer state sharded too), which this backend states rather than hides.

[Note: FSDP2 stages] With pp > 1 this backend is torchtitan's composition on
the stages backend="shardplan" runs: this rank's stage is cut out of the
captured graph (stage_split.py) and run by the plan's GPipe or 1F1B schedule
(pipelined.StagedProgram, shared by both backends, so `step` and batches of
other shapes mean the same: [Note: pipelined step], [Note: pipelined
shapes]). A stage runs its blocks' graph partitions, not its modules'
forwards, so fully_shard is applied to a _UnitGroup per unit (per units
sharing a parameter) holding the unit's modules, and each run of consecutive
blocks of one unit is that group's forward: FSDP2's own hooks gather the unit
before its blocks, reshard it after them as the unit decides, and gather it
again for their backward (and for recomputing them, inside the group's
forward, where the unit checkpoints). The groups sit under one _StageRoot,
the module the schedule runs, so FSDP2 sees the stage as one model and the
schedule drives its gradient accumulation: gradients stay unreduced through
every micro-batch's backward and are reduce-scattered (all-reduced over
replica groups, HSDP) once after the last. With tp > 1 the model is sliced
over the stage's tp group by backend="shardplan"'s tensor parallelism before
the cut (tensor_parallel.py; [Note: tensor parallel stages] in pipelined.py),
not by parallelize_module: DTensor's styles act in the hooks of the modules
they wrap, which a graph partition never calls, while the sliced model's graph
holds tp's exchanges as nodes. FSDP2 then shards the slices over dp; whole
parameters that see one tp rank's tokens (sequence parallelism) have their
gradients summed over tp after the reduction. A unit that blocks of another
stage read (a head tied to the embedding) is copied there as on backend
"shardplan" ([Note: tied weights across stages] in pipelined.py): on the
reading stage its copy joins the reading unit's group (FSDP2 gathers a tied
parameter in one group), its shards take the owner's values before each step
and give their gradients to the owner's after it.
"""

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Any, Callable, Iterator, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardplan.common.caller import warn_at_caller
from shardplan.common.dtypes import torch_dtype
from shardplan.errors import PlanError, RuntimeMismatchError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.frontend.passes.tensor_parallel import Style, TensorParallelLayout, VocabKind
from shardplan.plan import Plan, Unit
from shardplan.runtime import collectives
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.chunks import DTensorHolder, Holder, dtensor_holders
from shardplan.runtime.pipelined import (
    StagedProgram,
    copied_units,
    drop_other_stages,
    make_ties,
    tied_stages,
    units_read,
)
from shardplan.runtime.program import Program, grad_norm_term, refuse_optimizers_over
from shardplan.runtime.sharded import apply_plan_tensor_parallel, initialize_module
from shardplan.runtime.stage_split import (
    BlockCall,
    StageGraph,
    StageModule,
    block_runner,
    run_blocks,
    split_stages,
)
from shardplan.runtime.tensor_parallel import (
    ParameterSlice,
    full_parameter,
    map_pair_input,
    plan_layout,
)
from shardplan.runtime.vocab_parallel_loss import shard_loss


class Fsdp2Program(Program):
    fused: dict[str, int]
    """Fused projections' parameters sliced over tp: their chunks (see full_parameter)."""
    _sliced: dict[str, ParameterSlice]
    """Parameters backend="shardplan"'s tensor parallelism sliced (a pipelined stage's: [Note: FSDP2 stages])."""

    def __init__(
        self, module: nn.Module, plan: Plan, loss_fn: Callable | None, device: torch.device
    ):
        super().__init__(module, plan, loss_fn)
        whole_mesh = self._meshes(device)
        modules = dict(module.named_modules())
        on_meta = any(parameter.is_meta for parameter in module.parameters())
        refuse_optimizers_over(list(module.parameters()))  # fully_shard replaces them with DTensors
        if plan.mesh.tp > 1:
            layout = plan_layout(module, plan)
            parallelize_tensor_parallel(module, layout, whole_mesh["tp"])
            if layout.sharded_loss:
                shard_loss(module, whole_mesh["tp"].get_group())
            self.fused = _fused_chunks(layout)
            self._sliced = _dtensor_slices(module, self.fused)
        for unit in plan.units:
            for path in _unit_modules(unit, modules):
                modules[path].forward = checkpointed(modules[path].forward, unit.checkpoint)
        for units in _groups_of_ties(module, plan.units):
            targets = [modules[path] for unit in units for path in unit.modules]
            self._shard(targets if len(targets) > 1 else targets[0], units[0], device)
        self._root = fully_shard(
            module, mesh=self._mesh, reshard_after_forward=False, mp_policy=self._precision
        )
        if on_meta:
            _initialize(module, [module], device)

    def _meshes(self, device: torch.device) -> DeviceMesh:
        """Set the data-parallel mesh FSDP2 shards over, its group and the mixed precision; return the plan's
        whole mesh."""
        whole_mesh = collectives.device_mesh(device.type, self.plan.mesh)
        self._mesh = data_parallel_mesh(whole_mesh)
        self._data_parallel = (
            self._mesh._flatten("dp").get_group() if self._mesh.ndim > 1 else self._mesh.get_group()
        )
        """The replicas, for averaging running statistics (see [Note: running statistics] in program.py)."""
        self.fused = {}
        self._sliced = {}
        param_dtype = torch_dtype(self.plan.mixed_precision.param_dtype)
        reduce_dtype = torch_dtype(self.plan.mixed_precision.reduce_dtype)
        self._precision = MixedPrecisionPolicy(
            param_dtype=None if param_dtype is torch.float32 else param_dtype,
            reduce_dtype=None if reduce_dtype is torch.float32 else reduce_dtype,
        )
        return whole_mesh

    def _shard(
        self, target: nn.Module | list[nn.Module], unit: Unit, device: torch.device, **options: Any
    ) -> None:
        """fully_shard `target` over the data-parallel mesh as `unit` decides."""
        offload = (
            unit.offload and device.type != "cpu"
        )  # on CPU the shard already lives in CPU memory
        fully_shard(
            target,
            mesh=self._mesh,
            reshard_after_forward=unit.reshard_after_forward,
            mp_policy=self._precision,
            offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy(),
            **options,
        )

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @property
    def data_parallel_group(self) -> collectives.Group:
        return self._data_parallel

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's parameters (DTensors), by model name."""
        return list(self.module.named_parameters())

    def holders(self) -> list[Holder]:
        names = {name for name, _ in self._named_parameters()}
        return [
            holder for holder in dtensor_holders(self, self._sliced) if holder.names[0] in names
        ]

    def parameters(self) -> list[nn.Parameter]:
        return [parameter for _, parameter in self._named_parameters()]

    def evaluate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            # units not resharded after forward (and the root) keep parameters gathered when no backward follows
            for module in self._fsdp_modules():
                module.reshard()

    def _fsdp_modules(self) -> list[FSDPModule]:
        return [module for module in self.module.modules() if isinstance(module, FSDPModule)]

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, parameter in self._named_parameters():
                if name not in state:
                    raise ShardplanError(
                        f"the state dict lacks parameter {name!r}: load one saved from this model"
                    )
                whole = state[name].to(parameter.device, parameter.dtype)
                sharded = cast(DTensor, parameter)  # fully_shard made every parameter a DTensor
                parameter.copy_(distribute_tensor(whole, sharded.device_mesh, sharded.placements))

    def _set_gradient_sync(self, enabled: bool) -> None:
        self._root.set_requires_gradient_sync(enabled)

    def _grad_norm_terms(self, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        # every gradient a DTensor: its local parts summed over the world at once, each divided by the number
        # of ranks holding it again (replica groups; tp ranks, for a parameter tensor parallelism left whole)
        terms = [
            grad_norm_term([grad.to_local()], norm_type)
            / (1 if math.isinf(norm_type) else self._copies(name, grad))
            for name, grad in (
                (name, cast(DTensor, parameter.grad))
                for name, parameter in self._named_parameters()
                if parameter.grad is not None
            )
        ]
        zero = torch.zeros((), dtype=torch.float32)
        if not terms:
            return zero, zero
        return (
            torch.stack(terms).max() if math.isinf(norm_type) else torch.stack(terms).sum()
        ), zero

    def _copies(self, name: str, grad: DTensor) -> int:
        """How many ranks hold this rank's part of parameter `name`'s gradient `grad`."""
        mesh = grad.device_mesh
        replicated = math.prod(
            mesh.size(dim)
            for dim, placement in enumerate(grad.placements)
            if placement.is_replicate()
        )
        over_tp = "tp" in (mesh.mesh_dim_names or ()) or name in self._sliced
        return replicated * (1 if over_tp else self.plan.mesh.tp)


class Fsdp2PipelinedProgram(Fsdp2Program, StagedProgram):
    """backend="fsdp2" with pp > 1, the torchtitan composition (see [Note: FSDP2 stages])."""

    def __init__(
        self, module: nn.Module, plan: Plan, loss_fn: Callable | None, device: torch.device
    ):
        Program.__init__(
            self, module, plan, loss_fn
        )  # not Fsdp2Program's, which shards the whole model
        whole_mesh = self._meshes(device)
        self._pipeline = whole_mesh.get_group("pp")
        self._device = device
        self._tensor_parallel = whole_mesh.get_group("tp")
        # sliced before the stages are cut, as backend="shardplan" slices them (see [Note: FSDP2 stages])
        self._sliced, self._partial = apply_plan_tensor_parallel(
            module, plan, self._tensor_parallel
        )
        stages = split_stages(module, plan, device)
        self.graph = stages[plan.mesh.coordinates(collectives.world().rank)["pp"]]
        tied = tied_stages(plan, stages, units_read(module, plan, stages))
        copied = copied_units(plan, tied, self.graph.index)
        specs = {unit.name: unit for unit in plan.units}
        held_here = tuple(specs[name] for name in plan.stages[self.graph.index].units + copied)
        modules = dict(module.named_modules())
        on_meta = any(parameter.is_meta for parameter in module.parameters())
        drop_other_stages(module, plan, tuple(unit.name for unit in held_here))
        refuse_optimizers_over(
            list(module.parameters())
        )  # fully_shard replaces this stage's with DTensors
        self._groups: dict[str, _UnitGroup] = {}
        """Each unit of this stage → the FSDP2 group its blocks run in."""
        for units in _groups_of_ties(module, held_here):
            group = _UnitGroup([modules[path] for path in _group_modules(units, modules)])
            held = {id(module.get_parameter(name)) for unit in units for name in unit.params}
            # a unit module above another unit's keeps its own parameters only
            others = {parameter for parameter in group.parameters() if id(parameter) not in held}
            self._shard(group, units[0], device, ignored_params=others or None)
            self._groups.update((unit.name, group) for unit in units)
        self._stage_root = _StageRoot(list(dict.fromkeys(self._groups.values())))
        self._root = fully_shard(
            self._stage_root,
            mesh=self._mesh,
            reshard_after_forward=False,
            mp_policy=self._precision,
        )
        if on_meta:
            _initialize(module, list(self._stage_root.groups), device)
        self._copied = {
            id(module.get_parameter(name)) for unit in copied for name in specs[unit].params
        }
        """This rank's copies of other stages' units (see [Note: tied weights across stages] in pipelined.py)."""
        self.ties = make_ties(
            plan,
            tied,
            self.graph.index,
            lambda unit: tuple(module.get_parameter(name) for name in specs[unit].params),
        )
        self._start_schedules()

    __call__ = StagedProgram.__call__

    def _named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [
            (name, parameter)
            for name, parameter in self.module.named_parameters()
            if not parameter.is_meta and id(parameter) not in self._copied
        ]

    def _fsdp_modules(self) -> list[FSDPModule]:
        return [module for module in self._stage_root.modules() if isinstance(module, FSDPModule)]

    def holders(self) -> list[Holder]:
        return [
            _SlicedHolder(cast(DTensorHolder, holder), self._tensor_parallel)
            if holder.names[0] in self._sliced
            else holder
            for holder in super().holders()
        ]

    def _gradients_done(self, planned: bool) -> None:
        # whole parameters that saw this tp rank's tokens alone (sequence parallelism): their gradients summed
        parameters = dict(self._named_parameters())  # this stage's
        for name in self._partial:
            grad = parameters[name].grad if name in parameters else None
            if grad is not None:
                collectives.all_reduce_sum(cast(DTensor, grad).to_local(), self._tensor_parallel)
        super()._gradients_done(planned)

    def _stage_module(self, graph: StageGraph, shape: tuple[InputSpec, ...]) -> nn.Module:
        specs = {unit.name: unit for unit in self.plan.units}

        def run_segment(calls: tuple[BlockCall, ...]) -> Callable[[dict], dict]:
            # each block checkpointed on its own, as backend="shardplan" does: SELECTIVE_ALTERNATE counts
            # its matmuls per checkpointed call
            run = functools.partial(
                run_blocks,
                [
                    (
                        call,
                        checkpointed(
                            block_runner(call, self.module, graph.constants),
                            specs[call.unit].checkpoint,
                        ),
                    )
                    for call in calls
                ],
            )
            return functools.partial(self._groups[calls[0].unit], run)

        self._stage_root.stages[shape] = StageModule(graph, run_segment, contextlib.nullcontext)
        return self._stage_root

    def _forget(self, shape: tuple[InputSpec, ...]) -> None:
        del self._stage_root.stages[shape]

    @contextlib.contextmanager
    def _running(self, shape: tuple[InputSpec, ...]) -> Iterator[None]:
        self._stage_root.shape = shape
        with super()._running(shape):
            yield


class _SlicedHolder(DTensorHolder):
    """An FSDP2 parameter that a stage's tensor parallelism sliced: its slice sharded over dp, gathered whole
    over tp too."""

    def __init__(self, holder: DTensorHolder, group: collectives.Group):
        super().__init__(
            holder.names[0],
            cast(nn.Parameter, holder.parameter),
            holder.slots,
            holder.program,
            holder.cut,
        )
        self.group = group

    def gather(self) -> list[torch.Tensor]:
        return [
            cast(ParameterSlice, self.cut).gather(local, self.group) for local in super().gather()
        ]


class _UnitGroup(nn.Module):
    """The modules of one FSDP2 group of a pipelined stage (a unit's, or units' sharing a parameter). Its
    forward runs a segment of their blocks (see [Note: FSDP2 stages])."""

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.held = nn.ModuleList(modules)

    def forward(self, run: Callable[[dict], dict], values: dict) -> dict:
        return run(values)


class _StageRoot(nn.Module):
    """The FSDP2 root of a pipelined stage: its unit groups below it, and as its forward the StageModule
    for the micro-batch shape running (see [Note: FSDP2 stages])."""

    def __init__(self, groups: list[_UnitGroup]):
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.stages: dict[tuple[InputSpec, ...], StageModule] = {}
        """This stage's module at each micro-batch shape kept (see [Note: pipelined shapes] in
        pipelined.py)."""
        self.shape: tuple[InputSpec, ...] = ()
        """The micro-batch shape running."""

    def forward(self, *inbound: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with warnings.catch_warnings():
            # a group returning a view (a block's reshape) would lose FSDP2's gather for backward only under an
            # in-place op on it, and the captured graph, functional, has none
            warnings.filterwarnings(
                "ignore", message="FSDP2-wrapped module .* returned a view tensor"
            )
            return self.stages[self.shape](*inbound)


def _group_modules(units: tuple[Unit, ...], modules: dict[str, nn.Module]) -> list[str]:
    """The paths of `units`' modules, and of the modules holding their parameters outside those (the root's
    group takes them at pp = 1)."""
    paths = [path for unit in units for path in _unit_modules(unit, modules)]
    holding = [name.rpartition(".")[0] for unit in units for name in unit.params]
    return list(
        dict.fromkeys(
            paths
            + [
                path
                for path in holding
                if not any(path == top or path.startswith(top + ".") for top in paths)
            ]
        )
    )


def _unit_modules(unit: Unit, modules: dict[str, nn.Module]) -> tuple[str, ...]:
    missing = [path for path in unit.modules if path not in modules]
    if missing:
        raise PlanError(
            f"unit {unit.name!r} names modules {missing} the model does not have: re-plan with this model"
        )
    return unit.modules


def _groups_of_ties(model: nn.Module, units: tuple[Unit, ...]) -> list[tuple[Unit, ...]]:
    """The plan's units, those sharing a parameter (a head tied to the embedding) merged into one FSDP2
    group with the first one's decisions, as torchtitan groups tied modules: FSDP2 shards a parameter in
    one group. Modules of no unit holding a tied parameter (RoBERTa's `lm_head` holds its decoder's bias,
    BART's `model.shared` the embedding) join the group, as modules of its first unit. Warns with what
    merging changes."""
    merged = {unit.name: [unit] for unit in units}
    for name, owners, loose in _tied_across_units(model, units):
        into = merged[owners[0]]
        for other in owners[1:]:
            if merged[other] is not into:
                into.extend(merged[other])
                for unit in merged[other]:
                    merged[unit.name] = into
        joining = tuple(path for path in loose if path not in into[0].modules)
        into[0] = dataclasses.replace(into[0], modules=into[0].modules + joining)
        beside = f" and modules {loose} of no unit" if loose else ""
        warn_at_caller(
            f"parameter {name!r} is tied across units {owners}{beside}: backend='fsdp2' shards them as "
            "one group, gathered together with the first unit's decisions (the plan priced them apart; "
            "backend='shardplan' runs the plan as priced)"
        )
    groups = list({id(group): tuple(group) for group in merged.values()}.values())
    return sorted(groups, key=lambda group: _modules_below(group, groups))


def _modules_below(group: tuple[Unit, ...], groups: list[tuple[Unit, ...]]) -> int:
    """How many modules of the other groups lie below `group`'s modules: sharding groups in that order
    shards a module (a loose `lm_head` a tie joined) after the units inside it, as fully_shard needs."""
    mine = [path for unit in group for path in unit.modules]
    return sum(
        any(path.startswith(above + ".") for above in mine)
        for other in groups
        if other is not group
        for unit in other
        for path in unit.modules
    )


def _tied_across_units(
    model: nn.Module, units: tuple[Unit, ...]
) -> list[tuple[str, list[str], list[str]]]:
    """(a parameter name, the units its owners belong to in plan order, the paths of its owners in none of
    `units`) for each parameter shared across units, or between a unit and modules of none."""
    unit_of_module = {path: unit.name for unit in units for path in unit.modules}

    def unit_of(path: str) -> str | None:  # the unit of the nearest unit module at or above `path`
        parts = path.split(".") if path else []
        for length in range(len(parts), -1, -1):
            if ".".join(parts[:length]) in unit_of_module:
                return unit_of_module[".".join(parts[:length])]
        return None

    owners: dict[int, tuple[str, set[str], list[str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                name, owning, loose = owners.setdefault(
                    id(parameter), (f"{path}.{attribute}".lstrip("."), set(), [])
                )
                unit = unit_of(path)
                if unit is None:
                    loose.append(path)
                else:
                    owning.add(unit)
    order = {unit.name: index for index, unit in enumerate(units)}
    return [
        (name, sorted(owning, key=order.__getitem__), loose)
        for name, owning, loose in owners.values()
        if owning and len(owning) + len(loose) > 1
    ]


def _initialize(model: nn.Module, held: list[nn.Module], device: torch.device) -> None:
    """Meta-device model: allocate the shards of the `held` modules and run each of their modules' own
    initialization on them."""
    found = list(dict.fromkeys(inner for top in held for inner in top.modules()))
    for module in found:
        module.to_empty(device=device, recurse=False)
    for module in found:
        if (
            next(module.parameters(recurse=False), None) is not None
            or next(module.buffers(recurse=False), None) is not None
        ):
            initialize_module(model, module)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 shards over in collectives.device_mesh's `mesh`: 2-D (dp_replicate, dp_shard), HSDP, when
    there are replica groups, else dp_shard."""
    return mesh["dp_replicate", "dp_shard"] if mesh["dp_replicate"].size() > 1 else mesh["dp_shard"]


def apply_tensor_parallel_fsdp2(
    model: nn.Module, layout: TensorParallelLayout, mesh: DeviceMesh
) -> None:
    """The torchtitan composition: parallelize_tensor_parallel on mesh["tp"], then fully_shard on the
    data-parallel mesh for each layer holding pairs and for the root.

    `mesh` is collectives.device_mesh(device_type, plan mesh); a plan runs as Fsdp2Program instead,
    with its own units."""
    parallelize_tensor_parallel(model, layout, mesh["tp"])
    for layer in layout.sequence_layers:
        fully_shard(model.get_submodule(layer), mesh=data_parallel_mesh(mesh))
    fully_shard(model, mesh=data_parallel_mesh(mesh))


def parallelize_tensor_parallel(
    model: nn.Module, layout: TensorParallelLayout, mesh: DeviceMesh
) -> None:
    """`layout` applied with DTensor on the 1-D tp `mesh` (parallelize_module: ColwiseParallel /
    RowwiseParallel per pair, SequenceParallel on the layers' norms with `layout.sequence_parallel`,
    vocab-parallel embedding and head with `layout.vocab`; the head's logits left sliced with
    `layout.sharded_loss`, for vocab_parallel_loss.shard_loss). Every rank must hold the same full
    parameters before the call. A fused projection (qkv) is colwise per chunk: its DTensor
    is Shard(0) over the ranks' chunk slices, so its full_tensor() lists the chunks rank by rank
    (`tensor_parallel_full_parameters` puts them back in the model's order).

    [Note: DTensor sequence parallelism] With sequence_parallel the residual stream inside the layers
    is a DTensor Shard(1) on the tp mesh: the first layer's input is cut there, each pair module's
    input is redistributed to Replicate (the all-gather), each row-parallel linear's output to
    Shard(1) (the reduce-scatter), the norms run on the shard as SequenceParallel (their parameters
    Replicate DTensors, whose Partial gradients DTensor sums over tp itself: the eager runtime's
    sum_sequence_parallel_gradients is not needed here), and the last layer's output is gathered
    back into a plain tensor."""
    if mesh.size() != layout.degree:
        raise RuntimeMismatchError(
            f"the layout shards over tp={layout.degree} ranks, the mesh's tp dim has "
            f"{mesh.size()}: make the layout for tp={mesh.size()}"
        )
    sequence = layout.sequence_parallel
    styles: dict[str, ParallelStyle] = {}
    for pair in layout.pairs:
        if sequence:
            styles[pair.name] = _GatherSequenceInput()
        for linear in pair.linears:
            if linear.style is Style.ROWWISE:
                styles[linear.module] = RowwiseParallel(
                    output_layouts=Shard(1) if sequence else Replicate(),
                    use_local_output=not sequence,
                )
            else:
                styles[linear.module] = (
                    _ChunkedColwiseParallel(linear.chunks)
                    if linear.chunks > 1
                    else ColwiseParallel()
                )
    for candidate in layout.vocab:
        styles[candidate.module] = (
            RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            if candidate.kind is VocabKind.EMBEDDING
            # with the loss on the vocabulary slices the head returns this rank's slice, a plain tensor
            else ColwiseParallel(output_layouts=Shard(-1) if layout.sharded_loss else Replicate())
        )
    if sequence:
        layers = layout.sequence_layers
        for module in layout.replicated:
            if any(module.startswith(layer + ".") for layer in layers):
                styles[module] = SequenceParallel()
        whole, cut = (Replicate(),), (Shard(1),)
        if len(layers) == 1:
            styles[layers[0]] = PrepareModuleInputOutput(
                input_layouts=whole,
                desired_input_layouts=cut,
                output_layouts=cut,
                desired_output_layouts=whole,
                use_local_output=True,
            )
        else:
            styles[layers[0]] = PrepareModuleInput(input_layouts=whole, desired_input_layouts=cut)
            styles[layers[-1]] = PrepareModuleOutput(
                output_layouts=cut, desired_output_layouts=whole, use_local_output=True
            )
    parallelize_module(model, mesh, styles)


def tensor_parallel_full_parameters(
    model: nn.Module, layout: TensorParallelLayout
) -> dict[str, torch.Tensor]:
    """Every parameter of a model under apply_tensor_parallel_fsdp2, whole and in the model's order,
    on every rank (fused projections' chunks put back from their rank-by-rank order)."""
    fused = _fused_chunks(layout)
    return {
        name: full_parameter(parameter, fused.get(name, 1), layout.degree)
        for name, parameter in model.named_parameters()
    }


def _dtensor_slices(model: nn.Module, fused: dict[str, int]) -> dict[str, ParameterSlice]:
    """The slice this tp rank holds of each parameter parallelize_tensor_parallel sharded (a DTensor Shard
    over tp; fused projections by their `fused` chunks), as backend="shardplan"'s tensor parallelism says it."""
    return {
        name: ParameterSlice(
            full_shape=tuple(parameter.shape),
            dim=placement.dim,
            chunks=fused.get(name, 1),
            index=parameter.device_mesh.get_local_rank(),
            degree=parameter.device_mesh.size(),
        )
        for name, parameter in model.named_parameters()
        if isinstance(parameter, DTensor)
        for placement in parameter.placements
        if isinstance(placement, Shard)
    }


def _fused_chunks(layout: TensorParallelLayout) -> dict[str, int]:
    return {
        f"{linear.module}.{name}": linear.chunks
        for pair in layout.pairs
        for linear in pair.linears
        if linear.chunks > 1
        for name in ("weight", "bias")
    }


class _ChunkedColwiseParallel(ColwiseParallel):
    """ColwiseParallel over a fused projection: each rank holds its slice of every chunk (q, k and v
    heads of its own), where ColwiseParallel's contiguous Shard(0) would hand rank 0 all of q (and
    half of k). Overrides ColwiseParallel's private _partition_linear_fn (torch 2.13)."""

    def __init__(self, chunks: int):
        super().__init__()
        self.chunks = chunks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        index, degree = device_mesh.get_local_rank(), device_mesh.size()
        for attribute, parameter in list(module.named_parameters()):
            cut = ParameterSlice(
                full_shape=tuple(parameter.shape),
                dim=0,
                chunks=self.chunks,
                index=index,
                degree=degree,
            )
            local = cut.take(parameter.detach()).contiguous()
            module.register_parameter(
                attribute,
                nn.Parameter(
                    DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False),
                    requires_grad=parameter.requires_grad,
                ),
            )


class _GatherSequenceInput(ParallelStyle):
    """A pair module's input, sharded along the sequence, redistributed whole (the all-gather) once
    for all its column-parallel linears, whether the module is called with it positionally or by
    keyword (PrepareModuleInput takes one or the other, fixed in advance)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def whole(x: torch.Tensor) -> torch.Tensor:
            sharded = (
                x
                if isinstance(x, DTensor)
                else DTensor.from_local(x, device_mesh, [Shard(1)], run_check=False)
            )
            return sharded.redistribute(device_mesh, [Replicate()])

        module.register_forward_pre_hook(
            lambda _, args, kwargs: map_pair_input(args, kwargs, whole), with_kwargs=True
        )
        return module
