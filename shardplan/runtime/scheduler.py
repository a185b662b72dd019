"""When each unit is gathered, presented, released and reduced, in forward and in backward.

[Note: unit choreography]
Forward. A module's forward is wrapped (the module's code is untouched): on
entry it *activates* the units it needs (its own unit if it is one of a unit's
modules, and the units of the parameters it owns, which covers tied weights
and parameters of the root module). The first activation of a unit in a
forward pass gathers it (waiting for the prefetch if one was issued), presents
views of the gathered buffer through `_GatherFlat` (all_gather forward,
reduce in backward), and prefetches the unit that came next in the previous
forward pass. A FULL_SHARD unit is released when none of its modules is
running any more and all of them have run; its saved tensors are only handles
(see [Note: saved handles]). Other strategies keep the buffer until backward.

Backward. The first use of a released unit (a saved handle unpacked, or a
checkpointed module recomputed) gathers it again and prefetches the unit used
before it in forward. When autograd reaches `_GatherFlat.backward` every
gradient of the unit's buffer is summed: the unit issues its reduction (async;
at most one is in flight, the previous one is finished first) and releases
the buffer. A callback queued on the autograd engine finishes the last
reduction and releases whatever is left when backward ends. The engine drops
it when backward raises: the program then abandons the step (see [Note:
failed steps] in program.py).

[Note: saved handles] While a FULL_SHARD unit is gathered in forward, a
saved_tensors_hooks pack hook replaces any saved tensor that lives in the
unit's buffer (a parameter view, its transpose) by (unit, size, stride,
offset); unpacking gathers the unit again and rebuilds the view. So no
gathered buffer stays alive between forward and backward.
"""

import contextlib
import functools
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch.autograd import Variable

from shardplan.runtime.activation_checkpoint import outside_selective_checkpoint
from shardplan.runtime.unit import FlatUnit, UnitState


class _Handle(NamedTuple):
    unit: FlatUnit
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt


class _GatherFlat(torch.autograd.Function):
    """shard → the unit's full buffer; in backward, hands the buffer's gradient to the scheduler."""

    @staticmethod  # ctx: Any, as autograd's context takes whatever attributes forward sets on it
    def forward(
        ctx: Any, shard: torch.Tensor, unit: FlatUnit, scheduler: "Scheduler"
    ) -> torch.Tensor:
        # decided now, not in backward: a pipeline schedule runs forwards of later micro-batches
        # before the backward of earlier ones
        ctx.unit, ctx.scheduler, ctx.communicate = unit, scheduler, scheduler.communicate
        buffer = unit.gathered()
        return buffer.view_as(buffer)

    @staticmethod
    def backward(ctx: Any, grad_full: torch.Tensor) -> tuple[None, None, None]:
        ctx.scheduler.unit_backward_done(ctx.unit, grad_full, communicate=ctx.communicate)
        return None, None, None


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Scheduler:
    def __init__(self, units: list[FlatUnit], module_counts: dict[FlatUnit, int]):
        self.units = units
        self.communicate = True
        """Whether the backward of the forward now running reduces gradients (False on micro-batches
        before the last)."""
        self._module_counts = module_counts
        """Number of distinct modules of each unit: all have run once a unit's forward is over."""
        self._epoch = 0
        """Forward passes begun: views presented in an older pass are stale."""
        self._active = {unit: 0 for unit in units}
        """Wrapped forwards now running that activated each unit."""
        self._modules_done: dict[FlatUnit, set[str]] = {unit: set() for unit in units}
        self._order: list[FlatUnit] = []
        """Units in order of first activation in this forward pass (backward prefetches backwards along it)."""
        self._next: dict[FlatUnit, FlatUnit] = dict(zip(units, units[1:]))
        """Unit activated after each one in the previous forward pass (plan order before the first)."""
        self._storages: dict[int | None, FlatUnit] = {}
        """Storage address of each gathered FULL_SHARD buffer → its unit, for the pack hook."""
        self._reducing: FlatUnit | None = None
        self._callback_task: int | None = None
        """The autograd graph task that _end_backward is queued on; None once it has run."""
        self.backward_began = False
        """Whether a unit's gradient reached the scheduler since the program last cleared this (as a step
        or a call begins): a failure before then left every unit's local gradient sum as it was."""

    # forward pass boundaries

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """One forward pass of the model (or of a pipeline stage, for one micro-batch).

        One that raises is not ended here: releasing would wait for gathers a peer may never issue
        (see [Note: failed steps] in program.py)."""
        self._begin_forward()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield
        self._end_forward()

    def _begin_forward(self) -> None:
        self._epoch += 1
        self._order = []
        for done in self._modules_done.values():
            done.clear()

    def _end_forward(self) -> None:
        self._next.update(zip(self._order, self._order[1:]))
        for unit in self.units:
            if unit.state is not UnitState.SHARDED and (
                unit.spec.reshard_after_forward or not torch.is_grad_enabled()
            ):
                self._release(unit)

    # module wrapping

    def wrap(
        self, forward: Callable, units: tuple[FlatUnit, ...], path: str, own_unit: FlatUnit | None
    ) -> Callable:
        """`forward` with `units` activated around it; `own_unit` is the unit `path` is a module of."""

        @functools.wraps(forward)
        def run(*args: Any, **kwargs: Any) -> Any:
            for unit in units:
                self._enter(unit)
            try:
                return forward(*args, **kwargs)
            finally:
                if own_unit is not None and not _in_backward():
                    self._modules_done[own_unit].add(path)
                for unit in units:
                    self._exit(unit)

        return run

    def _enter(self, unit: FlatUnit) -> None:
        self._active[unit] += 1
        if unit.views_epoch == self._epoch:
            return
        backward = _in_backward()
        if not backward and unit not in self._order:
            self._order.append(unit)
        with outside_selective_checkpoint():
            unit.gathered()
            unit.present(_GatherFlat.apply(unit.shard, unit, self), self._epoch)
            if unit.spec.reshard_after_forward and not backward:
                self._storages[unit.gathered_buffer_storage] = unit
            if unit.spec.prefetch:
                self._prefetch(self._before(unit) if backward else self._next.get(unit))

    def _exit(self, unit: FlatUnit) -> None:
        self._active[unit] -= 1
        if (
            self._active[unit] == 0
            and unit.spec.reshard_after_forward
            and not _in_backward()
            and len(self._modules_done[unit]) >= self._module_counts[unit]
        ):
            self._release(unit)

    def _before(self, unit: FlatUnit) -> FlatUnit | None:
        if unit not in self._order:
            return None
        index = self._order.index(unit)
        return self._order[index - 1] if index > 0 else None

    @staticmethod
    def _prefetch(unit: FlatUnit | None) -> None:
        if unit is not None:
            unit.prefetch()

    def _release(self, unit: FlatUnit) -> None:
        self._storages.pop(unit.gathered_buffer_storage, None)
        unit.release()

    # saved tensors (see [Note: saved handles])

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor | _Handle:
        if not self._storages or tensor.device.type == "meta":
            return tensor
        unit = self._storages.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Handle(unit, tensor.size(), tensor.stride(), tensor.storage_offset())

    def _unpack(self, packed: torch.Tensor | _Handle) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed
        unit = packed.unit
        newly_gathered = unit.state is not UnitState.GATHERED
        buffer = unit.gathered()
        if newly_gathered and unit.spec.prefetch:
            self._prefetch(self._before(unit))
        return buffer.as_strided(packed.size, packed.stride, packed.offset)

    # backward

    def unit_backward_done(
        self, unit: FlatUnit, grad_full: torch.Tensor, *, communicate: bool
    ) -> None:
        task = torch._C._current_graph_task_id()
        if self._callback_task != task:
            Variable._execution_engine.queue_callback(self._end_backward)
            self._callback_task = task
        self.backward_began = True
        if self._reducing is not None:  # one reduction in flight: finish it before issuing the next
            self._reducing.finish_reduction()
            self._reducing = None
        unit.reduce(grad_full, communicate=communicate)
        if unit.reducing:
            self._reducing = unit
        self._release(unit)

    def _end_backward(self) -> None:
        if self._reducing is not None:
            self._reducing.finish_reduction()
            self._reducing = None
        for unit in self.units:
            if unit.state is not UnitState.SHARDED:
                self._release(unit)
        self._callback_task = None

    # failures (see [Note: failed steps] in program.py)

    @property
    def backward_failed(self) -> bool:
        """Whether a backward ended without its end-of-backward callback: it raised."""
        return self._callback_task is not None and not _in_backward()

    def abandon(self, *, drain: bool) -> None:
        """Forget a failed forward or backward: every unit sharded, nothing in flight (waited for when
        `drain`), no reduction or callback pending. Gradients summed locally over earlier backwards
        (accumulation by hand) are kept when no backward had begun since `backward_began` was cleared,
        dropped otherwise (that backward added to some units' sums and not to others')."""
        self._reducing = None
        self._callback_task = None
        self._storages.clear()
        for unit in self.units:
            self._active[unit] = 0
            self._modules_done[unit].clear()
            unit.abandon(drain=drain, keep_accumulated=not self.backward_began)
