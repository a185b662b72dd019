"""backend="fsdp2": the same plan applied with PyTorch's FSDP2 (`fully_shard`) on the unit boundaries.

It is the reference the shardplan runtime is measured against, and a real
option. Units map onto fully_shard groups by their modules (a unit of several
modules is one group); parameters owned by no unit module go to the root's
group. FSDP2 has no ZeRO-1 or DDP mode inside fully_shard: SHARD_OPTIMIZER and
REPLICATE units run as SHARD_GRAD_OP (the same arithmetic, with gradients and
optimizer state sharded too), which this backend states rather than hides.
"""
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..dtypes import torch_dtype
from ..errors import PlanError, ShardplanError
from ..plan import Plan
from . import collectives
from .activation_checkpoint import checkpointed
from .program import Program, grad_norm_term
from .sharded import initialize_module


class Fsdp2Program(Program):
    def __init__(self, module: nn.Module, plan: Plan, loss_fn: Callable | None, device: torch.device):
        super().__init__(module, plan, loss_fn)
        mesh = collectives.device_mesh(device.type, plan.mesh.dp)
        param_dtype = torch_dtype(plan.mixed_precision.param_dtype)
        reduce_dtype = torch_dtype(plan.mixed_precision.reduce_dtype)
        precision = MixedPrecisionPolicy(param_dtype=None if param_dtype is torch.float32 else param_dtype,
                                         reduce_dtype=None if reduce_dtype is torch.float32 else reduce_dtype)
        tied = _tied_across_units(module, plan)
        if tied:
            raise ShardplanError(f"parameter {tied[0]!r} is tied across units {tied[1]}, which FSDP2 cannot "
                                 "shard: use backend='shardplan' (it gathers the owning unit where the tie is "
                                 "used), or put the tied modules in one unit")
        modules = dict(module.named_modules())
        on_meta = any(parameter.is_meta for parameter in module.parameters())
        for unit in plan.units:
            missing = [path for path in unit.modules if path not in modules]
            if missing:
                raise PlanError(f"unit {unit.name!r} names modules {missing} the model does not have: "
                                "re-plan with this model")
            targets = [modules[path] for path in unit.modules]
            for target in targets:
                target.forward = checkpointed(target.forward, unit.checkpoint)
            offload = unit.offload and device.type != "cpu"  # on CPU the shard already lives in CPU memory
            fully_shard(targets if len(targets) > 1 else targets[0], mesh=mesh,
                        reshard_after_forward=unit.reshard_after_forward, mp_policy=precision,
                        offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        fully_shard(module, mesh=mesh, reshard_after_forward=False, mp_policy=precision)
        if on_meta:
            _initialize(module, device)

    def __call__(self, *args, **kwargs) -> Any:
        return self.module(*args, **kwargs)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.module.parameters())

    def evaluate(self, *args, **kwargs) -> torch.Tensor:
        try:
            return super().evaluate(*args, **kwargs)
        finally:
            # units not resharded after forward (and the root) keep parameters gathered when no backward follows
            for module in self.module.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        from torch.distributed.tensor import distribute_tensor

        with torch.no_grad():
            for name, parameter in self.module.named_parameters():
                if name not in state:
                    raise ShardplanError(f"the state dict lacks parameter {name!r}: load one saved from this model")
                whole = state[name].to(parameter.device, parameter.dtype)
                parameter.copy_(distribute_tensor(whole, parameter.device_mesh, parameter.placements))

    def _set_gradient_sync(self, enabled: bool) -> None:
        self.module.set_requires_gradient_sync(enabled)

    def _grad_norm_terms(self, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        # every gradient is a Shard(0) DTensor over the one dp mesh: local parts are summed over ranks
        local = [parameter.grad.to_local() for parameter in self.parameters() if parameter.grad is not None]
        return grad_norm_term(local, norm_type), torch.zeros((), dtype=torch.float32)


def _tied_across_units(model: nn.Module, plan: Plan) -> tuple[str, list[str]] | None:
    """(a parameter name, the units its owners belong to) for the first parameter shared across units."""
    unit_of_module = {path: unit.name for unit in plan.units for path in unit.modules}

    def unit_of(path: str) -> str:  # the unit of the nearest unit module at or above `path`
        parts = path.split(".") if path else []
        for length in range(len(parts), -1, -1):
            if ".".join(parts[:length]) in unit_of_module:
                return unit_of_module[".".join(parts[:length])]
        return "(root)"

    owners: dict[int, tuple[str, set[str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module._parameters.items():
            if parameter is not None:
                owners.setdefault(id(parameter), (f"{path}.{attribute}".lstrip("."), set()))[1].add(unit_of(path))
    return next(((name, sorted(units)) for name, units in owners.values() if len(units) > 1), None)


def _initialize(model: nn.Module, device: torch.device) -> None:
    """Meta-device model: allocate the shards and run each module's own initialization on them."""
    model.to_empty(device=device)
    for module in model.modules():
        if next(module.parameters(recurse=False), None) is not None or next(module.buffers(recurse=False), None) \
                is not None:
            initialize_module(model, module)
