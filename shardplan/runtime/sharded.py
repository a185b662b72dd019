"""backend="shardplan": the plan's units as flat sharded buffers, run by the Scheduler.

Building it: every parameter goes into its unit's flat buffer (see [Note: flat
layout]); a unit on the meta device is first materialized with its modules'
own initialization, one unit at a time, so only one unit is ever whole in
memory; rank 0's values are broadcast (as DDP and FSDP's sync_module_states
do) so ranks agree whatever their seeds; each rank keeps its slice and the
module's own tensors are dropped. Then module forwards are wrapped so units
are gathered where they are used (see [Note: unit choreography]).
"""

import contextlib
from typing import Any, Callable, Iterator, cast

import torch
import torch.nn as nn

from shardplan.common.dtypes import torch_dtype
from shardplan.errors import PlanError, ShardplanError
from shardplan.plan import Mesh, Plan, StrategyTraits, Unit
from shardplan.runtime import collectives
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.chunks import Holder, UnitHolder, replica_zero_owner
from shardplan.runtime.context_parallel import ContextParallel
from shardplan.runtime.expert_parallel import ExpertGroups, expert_place, split_experts
from shardplan.runtime.flat_param import FlatLayout
from shardplan.runtime.program import Program, grad_norm_term, refuse_optimizers_over
from shardplan.runtime.scheduler import Scheduler
from shardplan.runtime.tensor_parallel import (
    ParameterSlice,
    apply_tensor_parallel,
    plan_layout,
    sequence_parallel_parameters,
)
from shardplan.runtime.unit import FlatUnit, UnitPlace, packed_in_place
from shardplan.runtime.vocab_parallel_loss import shard_loss


class UnitProgram(Program):
    """A Program whose parameters are FlatUnits run by a Scheduler: what backend="shardplan" programs,
    pipelined or not, have in common."""

    units: list[FlatUnit]
    """The units this rank holds a shard of."""
    groups: collectives.MeshGroups
    scheduler: Scheduler
    _transactions = 0
    """Steps, evaluations and forwards begun: where a failure happened, to compare over ranks."""

    def parameters(self) -> list[nn.Parameter]:
        return [unit.shard for unit in self.units]

    @property
    def data_parallel_group(self) -> collectives.Group:
        return self.groups.data_parallel

    def holders(self) -> list[Holder]:
        return [UnitHolder(unit) for unit in self.units]

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(unit name, this rank's flat shard of it)."""
        return [(unit.name, unit.shard) for unit in self.units]

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(
            name for unit in self.units for name in unit.layout.names if name not in state
        )
        if missing:
            raise ShardplanError(
                f"the state dict lacks {len(missing)} parameters (first: {missing[:3]}): "
                "load one saved from this model"
            )
        for unit in self.units:
            unit.load_full([state[name] for name in unit.layout.names])

    def _set_gradient_sync(self, enabled: bool) -> None:
        self.scheduler.communicate = enabled

    def check_in_step(self) -> None:
        """Also abandon a loss.backward() of the program's own forward that raised outside `step` (see
        [Note: failed steps]), before a step, a forward, a clip, a save or an export builds on it."""
        if self.scheduler.backward_failed:
            self._abandon("in a loss.backward() outside program.step")
        super().check_in_step()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """See [Note: failed steps]: the step's gradients go to fresh `.grad` tensors, added to what `.grad`
        held before on success and dropped on failure; a `.grad` of zeros takes them in place and is
        zeroed again on failure, which restores it as well without a second gradient's memory."""
        self.check_in_step()
        self._transactions += 1
        self.scheduler.backward_began = False
        before = [unit.shard.grad for unit in self.units]
        zeroed = all_zeros(before)
        for unit, in_place in zip(self.units, zeroed):
            if not in_place:
                unit.shard.grad = None
            unit.forget_local_norm()  # what a loss.backward() outside a step measured
        try:
            yield
        except BaseException as error:
            for unit, grad, in_place in zip(self.units, before, zeroed):
                if in_place:
                    cast(torch.Tensor, grad).zero_()
                unit.shard.grad = grad
            self._abandon(type(error).__name__)
            raise
        for unit, grad in zip(self.units, before):
            if grad is not None:
                if unit.shard.grad is not None and unit.shard.grad is not grad:
                    grad.add_(unit.shard.grad)
                unit.shard.grad = grad

    def _abandon(self, failure: str) -> None:
        """Forget a failed step: drained when every rank stopped at the same collective, else out of step."""
        self.out_of_step = (
            f"a step failed ({failure}) at another point than on other ranks, so the ranks are "
            "out of step: restart every rank and program.load(...) the last checkpoint rather "
            "than train on"
        )  # until the ranks are known to agree
        drain = self._stopped_together()
        try:
            self.scheduler.abandon(drain=drain)
        except (
            Exception
        ):  # a collective every rank issued failed all the same: the group is unusable
            self.scheduler.abandon(drain=False)
            return
        if drain:
            self.out_of_step = None

    def _stopped_together(self) -> bool:
        """Whether every rank stopped after the same collectives of the same step (see [Note: failed steps])."""
        raise NotImplementedError

    def _grad_norm_terms(self, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        # each element counted on one rank of the world (FlatUnit.counted_gradients), summed over the world
        counted = [grad for unit in self.units for grad in unit.counted_gradients()]
        return grad_norm_term(counted, norm_type), torch.zeros((), dtype=torch.float32)

    @property
    def keeps_export_copies(self) -> bool:
        return all(
            index == 0 for dim, index in self.groups.coordinates.items() if dim != "pp"
        )  # one per stage


class ShardedProgram(UnitProgram):
    """Every unit of the plan, gathered where the model's modules use them (pp == 1)."""

    def __init__(
        self, module: nn.Module, plan: Plan, loss_fn: Callable | None, device: torch.device
    ):
        super().__init__(module, plan, loss_fn)
        self.groups = collectives.mesh_groups(device.type, plan.mesh)
        cuts, partial = apply_plan_tensor_parallel(module, plan, self.groups.tensor_parallel)
        place = unit_place(plan.mesh, self.groups)
        if plan.mesh.ep > 1:
            self.units = _build_expert_parallel_units(module, plan, device, place)
        else:
            self.units = build_units(module, plan, device, place, cuts=cuts, partial=partial)
        self.scheduler = Scheduler(
            self.units, {unit: len(set(unit.spec.modules)) for unit in self.units}
        )
        self.context = (
            ContextParallel(module, self.groups.context_parallel) if plan.mesh.cp > 1 else None
        )
        """The sequence split over the cp ranks (None at cp = 1)."""
        _wrap_forwards(
            module,
            dict(module.named_modules()),
            self.units,
            self.scheduler,
            self.context.wrap if self.context is not None else None,
        )
        self._control = collectives.control_group()
        """Where ranks compare where a failed step stopped (see [Note: failed steps])."""

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.context is None:
            with self.scheduler.forward_pass():
                return self.module(*args, **kwargs)
        args, kwargs = self.context.shard_batch(args, kwargs)
        with self.scheduler.forward_pass(), self.context.attending():
            return self.context.scale_loss(self.module(*args, **kwargs))

    def _stopped_together(self) -> bool:
        return collectives.agree_after_failure(
            [self._transactions, collectives.issued()], self._control
        )


def apply_plan_tensor_parallel(
    model: nn.Module, plan: Plan, group: collectives.Group
) -> tuple[dict[str, ParameterSlice], tuple[str, ...]]:
    """Slice `model` over its tp `group` as the plan says (its loss on the head's vocabulary slices where
    the plan says loss_parallel), before its units are built over the slices:
    (the slice of each sliced parameter, the parameters whose gradients are partial over tp)."""
    if plan.mesh.tp == 1:
        return {}, ()
    layout = plan_layout(model, plan)
    slices = apply_tensor_parallel(model, layout, group)
    if layout.sharded_loss:
        shard_loss(model, group)
    return slices, sequence_parallel_parameters(model, layout)


def _build_expert_parallel_units(
    module: nn.Module, plan: Plan, device: torch.device, place: UnitPlace
) -> list[FlatUnit]:
    """The plan's units without the routed experts, sharded as planned, and a unit of this rank's
    experts beside each ([Note: expert parallelism] in plan.py), in the order the model runs them."""
    groups = ExpertGroups(plan.mesh.size, plan.mesh.ep)
    units, cuts, expert_units = split_experts(module, plan, groups)
    experts = set(expert_units.values())
    built = build_units(
        module, plan, device, place, units=tuple(u for u in units if u not in experts)
    )
    built += build_units(
        module,
        plan,
        device,
        expert_place(groups),
        units=tuple(expert_units.values()),
        cuts=cuts,
    )
    position = {unit.name: index for index, unit in enumerate(units)}
    return sorted(built, key=lambda unit: position[unit.name])


def unit_place(mesh: Mesh, groups: collectives.MeshGroups) -> UnitPlace:
    """Where this rank's units sit: `groups.coordinates` are in the mesh the units see (cp folded into
    dp_shard, Mesh.parameter_mesh), so is the owner of each chunk."""
    mesh, at = mesh.parameter_mesh, groups.coordinates
    return UnitPlace(
        shard=groups.shard,
        shard_rank=at["dp_shard"],
        replicate=groups.replicate,
        data_parallel=groups.data_parallel,
        tensor_parallel=groups.tensor_parallel,
        replica=at["dp_replicate"],
        tp_index=at["tp"],
        owner_rank=replica_zero_owner(mesh, at),
    )


def build_units(
    model: nn.Module,
    plan: Plan,
    device: torch.device,
    place: UnitPlace,
    *,
    units: tuple[Unit, ...] | None = None,
    cuts: dict[str, ParameterSlice] | None = None,
    partial: tuple[str, ...] = (),
) -> list[FlatUnit]:
    """This rank's FlatUnits of `units` (default: all of the plan's), at `place` in the mesh, over this
    tp rank's slices (`cuts`, from apply_plan_tensor_parallel, as `partial`)."""
    cuts = cuts or {}
    named = dict(model.named_parameters())
    slots_of: dict[int, list[tuple[nn.Module, str]]] = {}
    owners: dict[int, list[str]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                slots_of.setdefault(id(parameter), []).append((module, attribute))
                owners.setdefault(id(parameter), []).append(path)
    compute_dtype = torch_dtype(plan.mixed_precision.param_dtype)
    reduce_dtype = torch_dtype(plan.mixed_precision.reduce_dtype)
    built = []
    for spec in plan.units if units is None else units:
        # slots are found by the original Parameter objects: materializing replaces them
        slots = [
            (module, attribute, index)
            for index, name in enumerate(spec.params)
            for module, attribute in slots_of[id(named[name])]
        ]
        if any(named[name].is_meta for name in spec.params):
            _materialize(
                model, spec.name, [owners[id(named[name])][0] for name in spec.params], device
            )
        first_slots = {index: (module, attribute) for module, attribute, index in reversed(slots)}
        parameters = [
            cast(nn.Parameter, module._parameters[attribute])
            for module, attribute in (first_slots[index] for index in range(len(spec.params)))
        ]
        trainable = {parameter.requires_grad for parameter in parameters}
        if len(trainable) > 1:
            raise ShardplanError(
                f"unit {spec.name!r} mixes frozen and trainable parameters: one flat buffer has "
                "one requires_grad; put frozen parameters in units of their own"
            )
        layout = FlatLayout.of(
            spec.name, list(zip(spec.params, parameters)), plan.mesh.parameter_mesh.dp_shard
        )
        unit_cuts = tuple(cuts.get(name) for name in spec.params)
        with torch.no_grad():
            flat = collectives.broadcast_(
                layout.flatten([p.detach().to(device) for p in parameters]), place.data_parallel
            )
            if (
                plan.mesh.tp > 1
            ):  # the tp ranks' whole parameters are one parameter: tp index 0's values
                packed_in_place(
                    flat,
                    layout,
                    tuple(index for index, cut in enumerate(unit_cuts) if cut is None),
                    lambda packed: collectives.broadcast_(packed, place.tensor_parallel),
                )
        shard, full = _keep_slice(spec.traits, flat, layout, place.shard_rank, spec.offload)
        shard.requires_grad_(trainable == {True})
        unit = FlatUnit(
            spec=spec,
            layout=layout,
            shard=shard,
            full=full,
            slots=slots,
            place=place,
            compute_dtype=compute_dtype,
            reduce_dtype=reduce_dtype,
            device=device,
            cuts=unit_cuts,
            partial=tuple(index for index, name in enumerate(spec.params) if name in partial),
        )
        unit.release()  # the modules' own tensors give way to placeholders: only the shard stays
        built.append(unit)
    meta_buffer_owners = [
        path
        for path, module in model.named_modules()
        if any(buffer.is_meta for buffer in module.buffers(recurse=False))
    ]
    if meta_buffer_owners:  # modules with buffers and no parameters (rotary embeddings)
        _materialize(model, "(buffers)", meta_buffer_owners, device)
    for (
        module
    ) in model.modules():  # buffers only: every parameter slot now holds a meta placeholder
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
    refuse_optimizers_over([*named.values(), *model.parameters()])  # now placeholders
    return built


def _keep_slice(
    traits: StrategyTraits, flat: torch.Tensor, layout: FlatLayout, rank: int, offload: bool
) -> tuple[nn.Parameter, torch.Tensor | None]:
    """(what the optimizer steps, the persistent full buffer it is a slice of, if any). Only a unit
    whose traits may offload is offloaded (plan.Decision refuses the others)."""
    home = torch.device("cpu") if offload else flat.device
    if traits.shards_params:
        return nn.Parameter(flat[layout.shard_slice(rank)].to(home, copy=True)), None
    if traits.shards_optimizer:
        full = flat.to(home)
        return nn.Parameter(full[layout.shard_slice(rank)]), full
    return nn.Parameter(flat.to(home)), None


def _materialize(
    model: nn.Module, unit_name: str, owner_paths: list[str], device: torch.device
) -> None:
    """Give modules on the meta device real memory, initialized by the model's own code."""
    modules = dict(model.named_modules())
    for path in dict.fromkeys(owner_paths):
        module = modules[path]
        module.to_empty(device=device, recurse=False)
        if not initialize_module(model, module):
            raise ShardplanError(
                f"unit {unit_name!r}: module {path!r} ({type(module).__name__}) is on the "
                "meta device and has no reset_parameters() to initialize it: add one, or "
                "build the model on a real device"
            )


def initialize_module(model: nn.Module, module: nn.Module) -> bool:
    """Run the model's own initialization of `module`'s direct tensors; False if it has none.

    A Hugging Face model initializes module by module with its `_init_weights` (which also
    fills rotary-embedding buffers); any other module by its `reset_parameters()`."""
    init_weights = getattr(model, "_init_weights", None)
    with torch.no_grad():
        if init_weights is not None:
            init_weights(module)
        elif callable(reset := getattr(module, "reset_parameters", None)):
            reset()
        else:
            return False
    return True


def _wrap_forwards(
    model: nn.Module,
    modules: dict[str, nn.Module],
    units: list[FlatUnit],
    scheduler: Scheduler,
    around: Callable[[Callable], Callable] | None = None,
) -> None:
    """Wrap each module that a unit names or that owns a unit's parameter (see [Note: unit choreography]);
    a unit's own forward runs inside `around` too, recomputed or not (context parallelism's attention)."""
    unit_of_module = {path: unit for unit in units for path in unit.spec.modules}
    for path in unit_of_module:
        if path not in modules:
            raise PlanError(
                f"unit {unit_of_module[path].name!r} names module {path!r}, which the model does "
                "not have: the plan was made for another model; re-plan with this one"
            )
    path_of = {id(module): path for path, module in modules.items()}
    needed: dict[str, list[FlatUnit]] = {path: [unit] for path, unit in unit_of_module.items()}
    for unit in units:
        for module, _, _ in unit.slots:
            users = needed.setdefault(path_of[id(module)], [])
            if unit not in users:
                users.append(unit)
    for path, needed_units in needed.items():
        module = modules[path]
        if hasattr(
            module.__dict__.get("forward"), "__wrapped__"
        ):  # a Scheduler's (tensor parallelism's are partials)
            raise ShardplanError(
                f"module {path!r} was already parallelized (its forward is wrapped): "
                "call parallelize once per model"
            )
        own = unit_of_module.get(path)
        forward = scheduler.wrap(module.forward, tuple(needed_units), path, own)
        if own is not None and around is not None:
            forward = around(forward)
        module.forward = checkpointed(forward, own.spec.checkpoint) if own is not None else forward


def all_zeros(grads: list[torch.Tensor | None]) -> list[bool]:
    """Which gradients exist and hold only zeros, read back in one transfer per device (one device
    sync a step, not one a unit; offloaded units keep theirs on the host)."""
    nonzero: dict[int, bool] = {}
    for device in {grad.device for grad in grads if grad is not None}:
        mine = [
            index for index, grad in enumerate(grads) if grad is not None and grad.device == device
        ]
        flags = torch.stack([cast(torch.Tensor, grads[index]).any() for index in mine]).tolist()
        nonzero.update(zip(mine, flags))
    return [grads[index] is not None and not nonzero[index] for index in range(len(grads))]
