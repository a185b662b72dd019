"""One unit at run time: its shard, its full buffer when gathered, and its gradient reduction.

The unit is a small state machine (UnitState). What "gathered" means follows
the strategy's traits (plan.StrategyTraits), as the cost model's terms do:

- shards_params (FULL_SHARD, SHARD_GRAD_OP): the shard is 1/dp of the flat
  buffer; gathering is an all_gather (in the compute dtype). Otherwise every
  rank keeps the whole buffer: with shards_optimizer (SHARD_OPTIMIZER) the
  optimizer steps this rank's slice of it (`shard` is a view into `full`),
  all-gathered back into `full`, lazily, at the next use after a step.
- reduce_scatters_grads: the gradient is reduce-scattered every micro-batch;
  otherwise it accumulates locally and is all-reduced once per step (and
  sliced, when `shard` is a slice of `full`).

[Note: units on the mesh] A unit is sharded over its UnitPlace's `shard` group (FSDP's shard
group) and holds this tp rank's slices of the parameters tensor parallelism cuts (`cuts`).
Reduce-scattered gradients are then averaged over the `replicate` group (HSDP: the shard
is the same on every replica group), all-reduced ones over the whole `data_parallel` group.
Under sequence parallelism the gradients of the whole parameters inside the sharded layers
(`partial`) are summed over tp on the flat gradient, before the data-parallel reduction
(both are sums, so the order does not change the result; before, every such parameter is whole
and contiguous in the flat gradient, and every replica reduces complete gradients).

[Note: presenting parameters] The modules keep their own code: their
parameter slots (`module._parameters[name]`) hold views of the gathered
buffer while the unit is in use and meta-device placeholders of the right
shape and dtype otherwise, so a stray use outside the runtime's control fails
loudly instead of reading stale memory.
"""

import enum
from typing import Callable, NamedTuple, cast

import torch
import torch.nn as nn

from shardplan.plan import StrategyTraits, Unit
from shardplan.runtime import collectives
from shardplan.runtime.collectives import Pending
from shardplan.runtime.flat_param import FlatLayout
from shardplan.runtime.tensor_parallel import ParameterSlice


class UnitPlace(NamedTuple):
    """Where this rank's units sit in the plan's mesh (see [Note: units on the mesh])."""

    shard: collectives.Group
    """The ranks a unit's flat buffer is sharded over."""
    shard_rank: int
    """This rank's index in `shard`."""
    replicate: collectives.Group
    data_parallel: collectives.Group
    tensor_parallel: collectives.Group
    replica: int
    """This rank's replica group (its dp_replicate index)."""
    tp_index: int
    owner_rank: Callable[[int, int], int]
    """The world rank that stands for (shard index, tp index) of this rank's stage: replica group 0's, which
    writes that part of the checkpoint and counts it in the gradient norm."""

    @classmethod
    def alone(cls) -> "UnitPlace":
        """A unit held whole by one rank, outside any mesh (no collective runs over a group of one)."""
        return cls(
            shard=None,
            shard_rank=0,
            replicate=None,
            data_parallel=None,
            tensor_parallel=None,
            replica=0,
            tp_index=0,
            owner_rank=lambda shard, tp: 0,
        )


def packed_in_place(
    flat: torch.Tensor,
    layout: FlatLayout,
    indices: tuple[int, ...],
    collective: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Apply `collective` to the parameters `indices` of `flat` at once (one message), in place."""
    if not indices:
        return
    views = layout.split(flat)
    pieces = [views[index] for index in indices]
    packed = collective(torch.cat([piece.reshape(-1) for piece in pieces]))
    for piece, result in zip(pieces, packed.split([piece.numel() for piece in pieces])):
        piece.copy_(result.view_as(piece))


class UnitState(enum.Enum):
    SHARDED = "sharded"
    """Only the shard is held (for SHARD_OPTIMIZER / REPLICATE: the persistent buffer, no compute copy)."""
    GATHERING = "gathering"
    """An async all_gather into the full buffer is in flight."""
    GATHERED = "gathered"
    """The full buffer, in the compute dtype, is held and can be presented to the modules."""


class FlatUnit:
    def __init__(
        self,
        *,
        spec: Unit,
        layout: FlatLayout,
        shard: nn.Parameter,
        full: torch.Tensor | None,
        slots: list[tuple[nn.Module, str, int]],
        place: UnitPlace,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        device: torch.device,
        cuts: tuple[ParameterSlice | None, ...] | None = None,
        partial: tuple[int, ...] = (),
    ):
        self.spec = spec
        self.layout = layout
        self.shard = shard
        """What the optimizer steps (fp32): this rank's slice, or the whole buffer for REPLICATE."""
        self.full = full
        """SHARD_OPTIMIZER only: the persistent full buffer that `shard` is a slice of."""
        self.slots = slots
        """(module, attribute, index in layout) for every place a parameter is presented, ties included."""
        self.place = place
        self.rank = place.shard_rank
        """This rank's index in `group`, which the unit is sharded over."""
        self.group = place.shard
        self.cuts = cuts if cuts is not None else (None,) * len(layout.names)
        """Per parameter (layout order): the slice of it this tp rank holds, None when it is whole (default: all)."""
        self.partial = partial
        """Indices of the parameters whose gradients are partial over tp (sequence parallelism)."""
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.device = device
        """Where compute happens; the shard lives on CPU instead when the unit is offloaded."""
        self.state = UnitState.SHARDED
        self.views_epoch = -1
        """The forward pass whose views are presented on the modules; -1 while placeholders are."""
        self._buffer: torch.Tensor | None = None
        """The full compute-dtype buffer while GATHERED."""
        self._pending_gather: Pending | None = None
        """The all_gather in flight while GATHERING."""
        self._grad_accumulator: torch.Tensor | None = None
        """Replicated units: the full reduce-dtype gradient summed over a step's micro-batches before it is
        all-reduced. Kept from step to step: a buffer allocated anew each step has its pages faulted in
        again each step (~7 ms for 3 MB on this CPU box, more than the additions it holds)."""
        self._accumulating = False
        """Whether the accumulator holds this step's earlier micro-batches."""
        self._pending_reduce: Pending | None = None
        """The gradient reduction issued in backward, waited on before the next one or at the end."""
        self.local_square_norm: torch.Tensor | None = None
        """Set by AdaScale (adascale.py), else None: Σ over micro-batches of the squared norm of this rank's
        part of its replica's gradient before reduction (see [Note: AdaScale's samples] there)."""
        self._synced_version = shard._version
        """SHARD_OPTIMIZER: shard version when `full` was last gathered; a step bumps it."""
        self._placeholders = [
            torch.empty(
                layout.shapes[index],
                dtype=compute_dtype,
                device="meta",
                requires_grad=shard.requires_grad,
            )
            for _, _, index in slots
        ]
        """What the slots hold between uses: shape, dtype and requires_grad of the parameter, no memory."""

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def traits(self) -> StrategyTraits:
        return self.spec.traits

    @property
    def sharded(self) -> bool:
        """Whether the parameters exist only as shards between uses (so using them needs an all_gather)."""
        return self.traits.shards_params

    @property
    def gathered_buffer_storage(self) -> int | None:
        return self._buffer.untyped_storage().data_ptr() if self._buffer is not None else None

    def prefetch(self) -> None:
        """Start gathering without waiting (only sharded units need communication to gather)."""
        if self.state is UnitState.SHARDED and self.sharded:
            self._pending_gather = collectives.all_gather(
                self._compute_shard(), async_op=True, group=self.group
            )
            self.state = UnitState.GATHERING

    def gathered(self) -> torch.Tensor:
        """The full buffer in the compute dtype, gathering (or waiting for a prefetch) if needed."""
        if self.state is UnitState.GATHERING:
            self._buffer = collectives.wait(
                cast(collectives.Pending, self._pending_gather)
            )  # GATHERING: in flight
            self._pending_gather = None
        elif self.state is UnitState.SHARDED:
            self._buffer = self._materialize()
        self.state = UnitState.GATHERED
        return cast(torch.Tensor, self._buffer)

    def present(self, gathered: torch.Tensor, epoch: int) -> None:
        """Put views of `gathered` (an autograd output) into the modules' parameter slots."""
        views = self.layout.split(gathered)
        for (
            module,
            attribute,
            index,
        ) in self.slots:  # plain views in the parameter slots, as FSDP1 puts them
            module._parameters[attribute] = cast(nn.Parameter, views[index])
        self.views_epoch = epoch

    def release(self) -> None:
        """Drop the full buffer (reshard); the modules get placeholders back."""
        if self.state is UnitState.GATHERING:
            collectives.wait(cast(collectives.Pending, self._pending_gather))
            self._pending_gather = None
        for (module, attribute, _), placeholder in zip(self.slots, self._placeholders):
            module._parameters[attribute] = cast(nn.Parameter, placeholder)
        self._buffer = None
        self.views_epoch = -1
        self.state = UnitState.SHARDED

    def abandon(self, *, drain: bool, keep_accumulated: bool = False) -> None:
        """Forget a failed step (see [Note: failed steps] in program.py): its collectives in flight, waited
        for when `drain` (every rank issued them) and dropped unwaited otherwise, its sum of earlier
        micro-batches' gradients unless `keep_accumulated` (no backward of the failed step ran), and the
        gathered buffer."""
        for pending in (self._pending_gather, self._pending_reduce):
            if pending is not None and drain:
                collectives.wait(pending)
        self._pending_gather = self._pending_reduce = None
        self._accumulating = self._accumulating and keep_accumulated
        self.forget_local_norm()
        self.state = (
            UnitState.SHARDED
        )  # nothing left to wait for: release() only puts placeholders back
        self.release()

    def reduce(self, grad_full: torch.Tensor, *, communicate: bool) -> None:
        """Take the gradient of the full buffer: accumulate it locally, or issue its reduction.

        [Note: gradient accumulation] Units that reduce-scatter (FULL_SHARD, SHARD_GRAD_OP) do so
        every micro-batch into the sharded gradient: holding full gradients until the last one
        would cost each rank the whole model's gradient, more than micro-batching saves in
        activations. Units that all-reduce (SHARD_OPTIMIZER, REPLICATE) hold a full gradient anyway,
        so micro-batches before the last only add into a full-size reduce-dtype accumulator and
        the last reduces the sum once. The cost model counts the same (shardplan.costmodel.cost). Measured for
        AdaScale, every micro-batch's partial tp sums are completed before it is added (the sums commute)."""
        grad = grad_full.to(self.reduce_dtype)
        scatters = self.traits.reduce_scatters_grads
        measured = self.local_square_norm is not None
        summed_now = scatters or measured  # a micro-batch's norm needs its partial tp sums complete
        if summed_now:
            self._sum_partial_over_tp(grad)
        if measured:
            for part in self._counted_over_tp(grad, 0):
                self.local_square_norm += torch.linalg.vector_norm(part.float()) ** 2
        if not scatters and (self._accumulating or not communicate):
            if self._grad_accumulator is None:
                self._grad_accumulator = torch.empty_like(grad)
            if self._accumulating:
                self._grad_accumulator.add_(grad)
            else:
                self._grad_accumulator.copy_(grad)
            self._accumulating = not communicate
            if not communicate:
                return
            grad = self._grad_accumulator
        if not summed_now:
            self._sum_partial_over_tp(grad)
        if scatters:
            self._pending_reduce = collectives.reduce_scatter_mean(
                grad, async_op=True, group=self.group
            )
        else:
            self._pending_reduce = collectives.all_reduce_mean(
                grad, async_op=True, group=self.place.data_parallel
            )
        if (
            self._pending_reduce.work is None
        ):  # a group of one: done, and the full gradient need not wait
            self.finish_reduction()

    def _sum_partial_over_tp(self, grad: torch.Tensor) -> None:
        packed_in_place(
            grad,
            self.layout,
            self.partial,
            lambda packed: collectives.all_reduce_sum(packed, self.place.tensor_parallel),
        )

    def forget_local_norm(self) -> None:
        """Start `local_square_norm` over (a new step, or a failed one's measurements dropped)."""
        if self.local_square_norm is not None:
            self.local_square_norm.zero_()

    @property
    def reducing(self) -> bool:
        return self._pending_reduce is not None

    def finish_reduction(self) -> None:
        """Wait for the issued reduction and add its result into `shard.grad`."""
        reduced = collectives.wait(
            cast(collectives.Pending, self._pending_reduce)
        )  # callers check `reducing`
        self._pending_reduce = None
        if self.traits.reduce_scatters_grads:  # HSDP: the same shard on every replica group
            reduced = collectives.wait(
                collectives.all_reduce_mean(reduced, async_op=False, group=self.place.replicate)
            )
        if self.full is not None:  # reduced in full, stepped as `shard`, a slice of it
            reduced = reduced[self.layout.shard_slice(self.rank)]
        reduced = reduced.to(device=self.shard.device, dtype=self.shard.dtype)
        if self.shard.grad is None:  # a copy, not the accumulator or a view of the reduced buffer
            self.shard.grad = (
                reduced.clone()
                if reduced._base is not None or reduced is self._grad_accumulator
                else reduced
            )
        else:
            self.shard.grad.add_(reduced)

    def counted_gradients(self) -> list[torch.Tensor]:
        """The parts of `shard.grad` this rank counts in a norm over the world, so that every element of
        the model's gradient is counted once: replica group 0's, the first shard of a unit stepped whole,
        and of a parameter whole on every tp rank, tp index 0's."""
        grad = self.shard.grad
        sharded = self.traits.shards_optimizer
        if grad is None or self.place.replica or (not sharded and self.rank):
            return []
        return self._counted_over_tp(grad, self.rank * self.layout.shard_numel if sharded else 0)

    def _counted_over_tp(self, flat: torch.Tensor, low: int) -> list[torch.Tensor]:
        """The parts of `flat` (the flat buffer's elements from `low` on) that this tp rank counts in a sum
        over tp: all at tp index 0; elsewhere only the slices of parameters tp cuts, since a whole
        parameter is the same on every tp rank."""
        if self.place.tp_index == 0:
            return [flat]
        counted = []
        for index, cut in enumerate(self.cuts):
            begin, end = self.layout.span(index)
            begin, end = max(begin - low, 0), min(end - low, flat.numel())
            if cut is not None and end > begin:
                counted.append(flat[begin:end])
        return counted

    def full_values(self) -> torch.Tensor:
        """The full fp32 buffer (a collective for sharded units: call on every rank)."""
        if self.sharded:
            return collectives.wait(
                collectives.all_gather(self.shard.detach(), async_op=False, group=self.group)
            )
        self._sync_full()
        return (self.full if self.full is not None else self.shard).detach()

    def load_full(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite the parameters with whole values (the same on every rank; no communication)."""
        self.release()
        flat = self.layout.flatten(
            [tensor.detach().to(self.shard.device, self.layout.dtype) for tensor in tensors]
        )
        with torch.no_grad():
            if self.full is not None:
                self.full.copy_(flat)
            else:
                self.shard.copy_(
                    flat[self.layout.shard_slice(self.rank)]
                    if self.traits.shards_optimizer
                    else flat
                )
        self._synced_version = self.shard._version

    def _compute_shard(self) -> torch.Tensor:
        return self.shard.detach().to(device=self.device, dtype=self.compute_dtype)

    def _materialize(self) -> torch.Tensor:
        if self.sharded:
            return collectives.wait(
                collectives.all_gather(self._compute_shard(), async_op=False, group=self.group)
            )
        self._sync_full()
        persistent = (self.full if self.full is not None else self.shard).detach()
        return persistent.to(device=self.device, dtype=self.compute_dtype)

    def _sync_full(self) -> None:
        """SHARD_OPTIMIZER: after an optimizer step changed this rank's slice, gather every slice."""
        if self.full is None or self.shard._version == self._synced_version:
            return
        gathered = collectives.wait(
            collectives.all_gather(self.shard.detach().clone(), async_op=False, group=self.group)
        )
        with torch.no_grad():
            self.full.copy_(gathered)
        self._synced_version = self.shard._version
