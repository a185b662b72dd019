"""Expert parallelism on backend="shardplan": a mixture of experts' routed experts split over ep ranks.

See [Note: expert parallelism] in plan.py for the layout. The routed experts are the modules that hold
them as two 3-D parameters, `gate_up_proj` (experts, 2 · intermediate, hidden) and `down_proj`
(experts, hidden, intermediate), and are called with the router's choice, `(hidden_states,
top_k_index, top_k_weights)`: transformers 5's Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 experts.
The router and the shared experts stay where they are, in the FSDP units.

Each ep rank keeps its experts' slice of both parameters (a ParameterSlice along the expert dim, as a
tp slice is, so checkpoints and exports gather them whole) in a unit of its own that no one shards
(REPLICATE over the ranks holding the same experts). The experts' forward is replaced: every
(token, choice) pair is sent to the rank of its expert by all-to-all over the ep group, run there
expert by expert, sent back by a second all-to-all (both differentiable: backward runs the two
again, reversed) and summed into its token with the router's weight, on the rank the token came
from. No token is dropped (these models have no expert capacity), so this computes what the experts'
own loop computes, summed in another order.

[Note: expert gradients] An expert's gradient on its rank sums what the tokens of the whole ep group
contribute. Every other gradient is averaged over the parameter_mesh.dp ranks that read different
tokens; the experts' is averaged over the parameter_mesh.dp / ep ranks holding the same experts, so the
experts' weights scale their gradient by 1 / ep in backward, which makes both the gradient of the
mean loss over every rank's tokens, as one process computes it.
"""

import dataclasses
from typing import Any, Callable, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as functional_collectives
import torch.nn as nn
import torch.nn.functional as F

from shardplan.errors import ShardplanError
from shardplan.plan import ROUTED_EXPERT_PARAMETERS, Plan, ShardStrategy, Unit
from shardplan.runtime.tensor_parallel import ParameterSlice
from shardplan.runtime.unit import UnitPlace


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Path → every module of `model` holding routed experts as ROUTED_EXPERT_PARAMETERS."""
    return {
        path: module
        for path, module in model.named_modules()
        if all(
            isinstance(module._parameters.get(name), nn.Parameter)
            and module._parameters[name].dim() == 3  # type: ignore[union-attr]
            for name in ROUTED_EXPERT_PARAMETERS
        )
        and hasattr(module, "act_fn")
    }


class ExpertGroups:
    """The ep group of this rank (ep consecutive ranks) and the ranks holding the same experts (every
    ep-th rank), made on every rank in the same order, as torch.distributed requires."""

    def __init__(self, world: int, ep: int):
        rank = dist.get_rank()
        self.ep, self.index = ep, rank % ep
        """This rank's index in its ep group: it holds experts index · E/ep .. (index + 1) · E/ep - 1."""
        self.replica = rank // ep
        """Which ep group this rank is in: its index among the ranks holding the same experts."""
        by_group = [dist.new_group(list(range(first, first + ep))) for first in range(0, world, ep)]
        self.expert_parallel: dist.ProcessGroup = by_group[self.replica]
        by_index = [dist.new_group(list(range(index, world, ep))) for index in range(ep)]
        self.same_experts: dist.ProcessGroup = by_index[self.index]


def split_experts(
    model: nn.Module, plan: Plan, groups: ExpertGroups
) -> tuple[tuple[Unit, ...], dict[str, ParameterSlice], dict[str, Unit]]:
    """Keep this rank's experts of every expert module of `model` and route its tokens over the ep group.

    Returns the plan's units without the expert parameters (a unit left with none dropped), the slice
    each expert parameter now holds, and the unit of each expert module: REPLICATE, unsharded, its
    gradient all-reduced over the ranks holding the same experts."""
    found = expert_modules(model)
    if not found:
        raise ShardplanError(
            f"the plan has ep={plan.mesh.ep}, but {type(model).__name__} has no routed experts "
            f"(modules holding 3-D {' and '.join(ROUTED_EXPERT_PARAMETERS)}, as transformers' mixtures of "
            "experts do) to split over ep ranks: re-plan with ep=1"
        )
    cuts: dict[str, ParameterSlice] = {}
    expert_units: dict[str, Unit] = {}
    for path, module in found.items():
        experts = module._parameters[ROUTED_EXPERT_PARAMETERS[0]].shape[0]  # type: ignore[union-attr]
        if experts % groups.ep:
            raise ShardplanError(
                f"{path} holds {experts} experts, which ep={groups.ep} ranks cannot split evenly: "
                f"re-plan with an ep that divides {experts}"
            )
        for name in ROUTED_EXPERT_PARAMETERS:
            whole = module._parameters[name]
            assert whole is not None
            cut = ParameterSlice(
                full_shape=tuple(whole.shape), dim=0, chunks=1, index=groups.index, degree=groups.ep
            )
            module._parameters[name] = nn.Parameter(
                cut.take(whole.detach()).clone(), requires_grad=whole.requires_grad
            )
            cuts[f"{path}.{name}"] = cut
        module.forward = _routed_forward(module, experts, groups)  # type: ignore[method-assign]
        expert_units[path] = Unit(
            name=path,
            modules=(path,),
            params=tuple(f"{path}.{name}" for name in ROUTED_EXPERT_PARAMETERS),
            strategy=ShardStrategy.REPLICATE,
        )
    units = []
    for unit in plan.units:
        kept = tuple(name for name in unit.params if name not in cuts)
        if kept:
            units.append(dataclasses.replace(unit, params=kept))
        units.extend(
            expert_units[path]
            for path in found
            if any(path == module or path.startswith(module + ".") for module in unit.modules)
        )
    return tuple(units), cuts, expert_units


def expert_place(groups: ExpertGroups) -> UnitPlace:
    """Where an expert unit sits: whole on this rank, its slice one of the ep group's (as a tp slice is
    one of the tp group's), replicated over the ranks holding the same experts, whose first ep group
    (ranks 0 .. ep - 1 of the first replica) writes it in checkpoints and counts it in the gradient
    norm."""
    return UnitPlace(
        shard=None,
        shard_rank=0,
        replicate=groups.same_experts,
        data_parallel=groups.same_experts,
        tensor_parallel=groups.expert_parallel,
        replica=groups.replica,
        tp_index=groups.index,
        owner_rank=lambda shard, index: index,
    )


class _ScaledGradient(torch.autograd.Function):
    """The identity, whose gradient is scaled ([Note: expert gradients])."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


def _exchange(
    rows: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """`rows` cut into `send` counts, one part to each rank of `group`, and what each sends this one,
    `receive` counts from each (differentiable: backward sends the gradients back the same way)."""
    exchanged = functional_collectives.all_to_all_single_autograd(
        rows.contiguous(), receive, send, group=group
    )
    return functional_collectives.wait_tensor(exchanged)


def _routed_forward(module: nn.Module, experts: int, groups: ExpertGroups) -> Callable:
    ep, group = groups.ep, groups.expert_parallel
    local = experts // ep
    activation = cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn)

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        choices = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)  # (token, choice) pairs by expert, so by rank
        token = order // choices
        per_expert = torch.bincount(chosen, minlength=experts)
        # row e · local + l: what each rank sends this one for its local expert l
        received_per_expert = torch.empty_like(per_expert)
        dist.all_to_all_single(received_per_expert, per_expert, group=group)
        send = per_expert.view(ep, local).sum(1).tolist()
        receive = received_per_expert.view(ep, local).sum(1).tolist()
        arrived = _exchange(hidden_states[token], receive, send, group)
        # arrived is by source rank, then by expert: regroup it by expert
        expert_of_row = torch.arange(local).repeat(ep).repeat_interleave(received_per_expert)
        by_expert = torch.argsort(expert_of_row, stable=True)
        gate_up = _ScaledGradient.apply(module.gate_up_proj, 1 / ep)
        down = _ScaledGradient.apply(module.down_proj, 1 / ep)
        outputs = []
        rows_of = received_per_expert.view(ep, local).sum(0).tolist()
        for expert, rows in enumerate(arrived[by_expert].split(rows_of)):
            gate, up = F.linear(rows, gate_up[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(activation(gate) * up, down[expert]))
        computed = torch.cat(outputs)[torch.argsort(by_expert)]
        # back in (token, choice) order: each token's choices summed with the router's weights (an
        # index_add_ would save its whole source for backward; indexing saves only the indices)
        returned = _exchange(computed, send, receive, group)[torch.argsort(order)]
        weighted = returned.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)
        return weighted.sum(dim=-2).to(hidden_states.dtype)

    return forward
