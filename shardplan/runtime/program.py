"""Program: a model trained under a plan on this rank, whatever backend runs it.

What is common to both backends lives here: calling the program as the model
(FSDP2's loop: `loss = program(**batch).loss; loss.backward();
optimizer.step()`), the gradient-sync switch for accumulating by hand,
admitting a batch's shapes (admit_input), and `step`'s convenience: splitting
a replica's batch into the plan's micro-batches, finding the loss in the
model's output, averaging it, and gradient sync only on the last micro-batch.
A backend supplies the forward, what the switch does to its reductions, the
local parameters and the norm.

[Note: the user's loop] `program(*args, **kwargs)` is the model's forward on
this rank's batch, returning what the model returns; `loss.backward()` then
reduces each unit's gradient as the plan says (reduce-scattered or
all-reduced, averaged over the replicas) and an optimizer over
`program.parameters()` steps the shards. A call runs its batch as one
forward: the plan's micro-batches are `step`'s, and accumulating by hand is
`set_requires_gradient_sync(False)` for every micro-batch but the last, as
under FSDP2. The loss is this rank's, as the model computes it: the gradients
are the mean of the replicas' gradients, as under DDP and FSDP.

[Note: failed steps] A step that raises (in forward or backward, on any
exception: out of memory, Ctrl-C, a hook) is abandoned as a transaction: the
program is left as if it never ran, or, where that cannot be known, refuses
every later call until the ranks restart from a checkpoint. Gradients the
step reduces go to fresh `.grad` tensors; what `.grad` held before (gradients
accumulated over earlier steps) is set aside and added back when the step
succeeds, put back alone when it fails. A `.grad` of zeros (as
`zero_grad(set_to_none=False)` leaves it) takes the step's gradients in place
and is zeroed again on failure: no second gradient's memory, which the cost
model does not count (nor None's, after `zero_grad()`). The ranks
then compare where they stopped on a group of their own, which the step's
collectives never use (collectives.control_group): if every rank has issued
the same number of collectives, each one in flight has its partners, so it is
waited for and dropped, and every unit is resharded. If not (one rank failed
where its peers went on), those peers block in a collective the failed rank
never issues until the process group's timeout ends them; every rank that
stopped is then out of step with the others, drops what it has in flight
unwaited, issues no collective again, and refuses every call. A successful
step adds no collective for this. A `loss.backward()` of the program's own
forward (outside `step`) that raises is found at the next call and abandoned
the same way, but, as in plain PyTorch, the gradients it produced stay. A
call that fails in its forward keeps what earlier backwards accumulated by
hand (set_requires_gradient_sync(False)); a failed backward or step drops
what all-reducing units had summed locally, so an accumulation by hand starts
over (optimizer.zero_grad()). A pipeline stage cannot tell where its
neighbours stopped, so any failed pipelined step leaves the ranks out of step
(see [Note: pipelined step]).
A successful `program.load` ends the refusal.
"""

import contextlib
import dataclasses
import math
import os
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, cast

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from shardplan.common.caller import warn_at_caller
from shardplan.common.dtypes import dtype_name
from shardplan.common.files import is_finite_number
from shardplan.errors import RuntimeMismatchError, ShardplanError
from shardplan.frontend.chain import InputSpec
from shardplan.plan import Plan
from shardplan.runtime import collectives
from shardplan.solver.shapes import priced_lengths

if TYPE_CHECKING:  # chunks imports the units, which import this module
    from shardplan.runtime.checkpoint import Stateful
    from shardplan.runtime.chunks import Holder


@dataclass(frozen=True, kw_only=True, slots=True)
class StepStats:
    """What this rank's last `step` took, beside what the plan predicted for it."""

    step_time_s: float
    """Wall time of the step on this rank, to the loss averaged over the ranks (a synchronization)."""
    peak_bytes: int | None
    """Device memory allocated at the step's peak (CUDA's max_memory_allocated, reset as the step
    begins); None on CPU, where no allocator counts it."""
    predicted_step_time_s: float
    predicted_peak_bytes: int


class Program:
    """Returned by `shardplan.parallelize`; call it on every rank.

    >>> program = shardplan.parallelize(model, plan)               # doctest: +SKIP
    >>> optimizer = torch.optim.AdamW(program.parameters(), lr=3e-4)  # doctest: +SKIP
    >>> loss = program.step(ids, labels=ids); optimizer.step(); optimizer.zero_grad()  # doctest: +SKIP
    """

    def __init__(self, module: nn.Module, plan: Plan, loss_fn: Callable | None):
        self.module = module
        self.plan = plan
        self.loss_fn = loss_fn
        """loss_fn(output, target): then the last positional argument of `step` is the target."""
        self.out_of_step: str | None = None
        """Why every call now refuses (see [Note: failed steps]); None while the program can train."""
        self.last_step: StepStats | None = None
        """Time and peak memory of the last successful `step` (None before one): log it beside the plan's."""
        self.after_reduction: Callable[[bool], None] | None = None
        """Called inside each `step` once its gradients are reduced, while `.grad` holds this step's alone,
        with whether the step took the planned batch (AdaScale measures them there, in adascale.py)."""
        self.over_budget = "refuse"
        """What a training batch predicted over the budget meets: "refuse" or "warn" (parallelize's
        over_budget; [Note: admitted by memory])."""
        self.requires_gradient_sync = True
        """Whether backward reduces gradients over the replicas (see set_requires_gradient_sync)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank's batch, sharded as planned (pp == 1), returning what the model
        returns: `loss.backward()` then reduces the gradients as planned (see [Note: the user's loop]).

        >>> loss = program(input_ids=ids, attention_mask=mask, labels=ids).loss  # doctest: +SKIP
        >>> loss.backward(); optimizer.step(); optimizer.zero_grad()             # doctest: +SKIP
        """
        self.check_in_step()
        admit_input(self.plan, args, kwargs, over_budget=self.over_budget)
        with self._transaction():
            return self._forward(*args, **kwargs)

    def set_requires_gradient_sync(self, requires: bool) -> None:
        """Whether the backward of the next forwards reduces gradients over the replicas, as FSDP2's switch
        of the same name (DDP's `no_sync()`): False for every micro-batch accumulated by hand but the last.

        Set it before the forward and keep it until that forward's backward has run (backend="shardplan"
        reads it as the forward runs, FSDP2 as the backward does). What is kept local follows the plan, as `step`'s micro-batches do (see [Note: gradient accumulation] in
        unit.py): units that all-reduce (and every unit under backend="fsdp2") add into a local gradient
        and reduce it once; units that reduce-scatter still do so every backward, the memory the plan
        priced. `step` honours it too: with False, not even its last micro-batch syncs.

        >>> program.set_requires_gradient_sync(False)          # doctest: +SKIP
        >>> for batch in batches[:-1]: (program(**batch).loss / len(batches)).backward()  # doctest: +SKIP
        >>> program.set_requires_gradient_sync(True)           # doctest: +SKIP
        >>> (program(**batches[-1]).loss / len(batches)).backward(); optimizer.step()     # doctest: +SKIP
        """
        if self.plan.mesh.pp > 1:
            raise ShardplanError(
                "a pipelined plan (pp > 1) accumulates gradients over its micro-batches inside "
                "program.step(...): pass the whole accumulation batch to one step()"
            )
        self.requires_gradient_sync = bool(requires)
        self._set_gradient_sync(self.requires_gradient_sync)

    # what a backend provides

    def parameters(self) -> list[nn.Parameter]:
        """This rank's shards: give them to any torch.optim optimizer (its state is then sharded)."""
        raise NotImplementedError

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Set every parameter from whole tensors by model name (as `export_full_state_dict` returns; the
        same on every rank)."""
        raise NotImplementedError

    def holders(self) -> "list[Holder]":
        """What holds the parameters, for checkpoints (chunks.py), in an order every rank shares."""
        raise NotImplementedError

    @property
    def data_parallel_group(self) -> "collectives.Group":
        """The ranks of this rank's stage and tp index that read different batches (the replicas)."""
        raise NotImplementedError

    def average_running_statistics(self) -> None:
        """Average every norm layer's running statistics over the data-parallel replicas, in place.

        [Note: running statistics] Each replica's BatchNorm (any torch _NormBase tracking running
        statistics) updates its running mean and variance from its own batches, so replicas drift
        apart; the runtime does not synchronize them during training (that is SyncBatchNorm's cost,
        a collective per norm per forward). `save` and `export_full_state_dict` call this first:
        what is written is the replicas' mean, on every rank alike, not one rank's. Other buffers
        (rotary tables, counters) are the same on every replica and are left as they are."""
        statistics = [
            buffer
            for module in self.module.modules()
            if isinstance(module, torch.nn.modules.batchnorm._NormBase)
            and module.track_running_stats
            for buffer in (module.running_mean, module.running_var)
            if buffer is not None
        ]
        if not statistics:
            return
        flat = torch.cat([buffer.detach().reshape(-1).double() for buffer in statistics])
        collectives.wait(
            collectives.all_reduce_mean(flat, async_op=False, group=self.data_parallel_group)
        )
        with torch.no_grad():
            for buffer, mean in zip(
                statistics, flat.split([buffer.numel() for buffer in statistics])
            ):
                buffer.copy_(mean.view_as(buffer))

    # checkpoints (see [Note: checkpoint format] in checkpoint.py): the same format for both backends

    def save(
        self,
        path: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        extra: "Mapping[str, Stateful] | None" = None,
    ) -> None:
        """Write parameters, buffers, the optimizer's state and `extra` objects' state_dict()s to the
        directory `path`, atomically.

        Call on every rank. The checkpoint loads into any plan, world size and backend.

        >>> program.save("ckpt/step_1000", optimizer, extra={"sampler": sampler})  # doctest: +SKIP
        """
        from shardplan.runtime import checkpoint

        self.check_in_step()
        checkpoint.save(self, path, optimizer, extra)

    def load(
        self,
        path: str | os.PathLike,
        optimizer: torch.optim.Optimizer | None = None,
        extra: "Mapping[str, Stateful] | None" = None,
    ) -> None:
        """Restore what `save` wrote (resharding to this plan and world size), and each `extra` object's
        state (load_state_dict); call on every rank.

        >>> optimizer = torch.optim.AdamW(program.parameters(), lr=3e-4)  # doctest: +SKIP
        >>> program.load("ckpt/step_1000", optimizer, extra={"sampler": sampler})  # doctest: +SKIP
        """
        from shardplan.runtime import checkpoint

        checkpoint.load(self, path, optimizer, extra)
        self.out_of_step = None

    def export_full_state_dict(
        self, path: str | os.PathLike | None = None
    ) -> dict[str, torch.Tensor]:
        """The plain model's state dict on rank 0 ({} elsewhere), gathered one unit at a time; saved to `path`.

        >>> state = program.export_full_state_dict()  # doctest: +SKIP
        >>> plain_model.load_state_dict(state)        # on rank 0; doctest: +SKIP
        """
        from shardplan.runtime import checkpoint

        self.check_in_step()
        return checkpoint.export_full_state_dict(self, path)

    @property
    def keeps_export_copies(self) -> bool:
        """Whether export_full_state_dict copies what this rank's units gather (and sends it to rank 0)."""
        return collectives.world().rank == 0

    def _set_gradient_sync(self, enabled: bool) -> None:
        """Whether the backward of the forwards that follow reduces gradients (the backend's switch)."""
        raise NotImplementedError

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward on this rank, inside a call's or a step's transaction."""
        raise NotImplementedError

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Run a step or an evaluation so that a failure leaves the program as it was (see [Note: failed
        steps]). This default cannot see inside the backend's state (FSDP2's gathers, reductions and
        hooks), so a failure leaves the program refusing every call until a checkpoint is loaded."""
        try:
            yield
        except BaseException as error:
            self.out_of_step = (
                f"a step failed ({type(error).__name__}) inside a backend whose state it may have "
                "left half-done: program.load(...) the last checkpoint (on every rank) rather "
                "than train on"
            )
            raise

    def check_in_step(self) -> None:
        """Refuse to run once a failed step left the ranks out of step (see [Note: failed steps])."""
        if self.out_of_step is not None:
            raise RuntimeMismatchError(self.out_of_step)

    def _grad_norm_terms(self, norm_type: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum over ranks is needed, already complete) parts of Σ|g|^p, or of max|g| for inf."""
        raise NotImplementedError

    # common

    def train(self, mode: bool = True) -> "Program":
        self.module.train(mode)
        return self

    def eval(self) -> "Program":
        return self.train(False)

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward and backward of this rank's batch; returns the loss averaged over its samples and the ranks.

        Tensors of args and kwargs are split along dim 0 into the plan's micro-batches; gradients
        are synchronized on the last one only (see [Note: gradient accumulation] in unit.py), and not
        at all after set_requires_gradient_sync(False). The batch may have any size and sequence
        length (see admit_input); micro-batches of unequal size are weighted: see [Note: smaller
        batches]. A step that raises leaves the program as it was (see [Note: failed steps])."""
        self.check_in_step()
        admit_input(
            self.plan,
            args,
            kwargs,
            micro_batches=self.plan.schedule.num_micro_batches,
            over_budget=self.over_budget,
        )
        micro_batches = split_micro_batches(args, kwargs, self.plan.schedule.num_micro_batches)
        total = torch.zeros((), dtype=torch.float32)
        with self._transaction(), self._recording_stats():
            try:
                for index, (micro_args, micro_kwargs, share) in enumerate(micro_batches):
                    last = index == len(micro_batches) - 1
                    self._set_gradient_sync(last and self.requires_gradient_sync)
                    loss = self.loss(micro_args, micro_kwargs)
                    (loss * share).backward()
                    total += loss.detach().float().cpu() * share
            finally:
                self._set_gradient_sync(self.requires_gradient_sync)
            self._gradients_reduced(
                planned=self.requires_gradient_sync
                and len(micro_batches) == self.plan.schedule.num_micro_batches
                and all(share == micro_batches[0][2] for *_, share in micro_batches)
                and _takes_planned_shapes(self.plan, args, kwargs)
            )
            return collectives.wait(collectives.all_reduce_mean(total, async_op=False))

    @contextlib.contextmanager
    def _recording_stats(self) -> Iterator[None]:
        """Set `last_step` from the step run inside, when it succeeds."""
        device = collectives.default_device()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        yield
        self.last_step = StepStats(
            step_time_s=time.perf_counter() - start,
            predicted_step_time_s=self.plan.predicted.step_time_s,
            peak_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            predicted_peak_bytes=self.plan.predicted.peak_bytes,
        )

    def _gradients_reduced(self, planned: bool = True) -> None:
        if self.after_reduction is not None:
            self.after_reduction(planned)

    def evaluate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The loss of this rank's batch without gradients (a validation step), averaged as `step` averages;
        the batch may have any size and sequence length, as in `step`.

        >>> validation_loss = program.evaluate(ids, labels=ids)  # doctest: +SKIP
        """
        self.check_in_step()
        admit_input(self.plan, args, kwargs, trains=False)
        micro_batches = split_micro_batches(args, kwargs, self.plan.schedule.num_micro_batches)
        with self._transaction(), torch.no_grad():
            total = cast(
                torch.Tensor,
                sum(
                    self.loss(micro_args, micro_kwargs).float().cpu() * share
                    for micro_args, micro_kwargs, share in micro_batches
                ),
            )
            return collectives.wait(collectives.all_reduce_mean(total, async_op=False))

    def loss(self, args: tuple, kwargs: dict) -> torch.Tensor:
        args, target = self.split_target(args)
        return self.loss_of(self._forward(*args, **kwargs), target)

    def split_target(self, args: tuple) -> tuple[tuple, Any]:
        """(the model's positional arguments, the target): with loss_fn, the target is the last argument."""
        if self.loss_fn is None:
            return args, None
        if not args:
            raise ShardplanError(
                "with loss_fn, pass the target as the last positional argument of step()"
            )
        return args[:-1], args[-1]

    def loss_of(self, output: Any, target: Any) -> torch.Tensor:
        """The scalar loss of the model's `output`: loss_fn(output, target), or the output itself or its .loss."""
        if self.loss_fn is not None:
            return self.loss_fn(output, target)
        loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ShardplanError(
                f"the model returned {type(output).__name__}, not a scalar loss: return the "
                "loss (or an output with .loss, as Hugging Face models do given labels), or "
                "pass loss_fn=... to parallelize"
            )
        return loss

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale all gradients so their global norm (over every shard on every rank) is at most max_norm.

        Returns the norm before clipping, as torch.nn.utils.clip_grad_norm_ does."""
        if not (
            is_finite_number(max_norm) and max_norm >= 0
        ):  # -1 would flip every gradient, NaN poison them
            raise ShardplanError(
                f"clip_grad_norm_(max_norm={max_norm!r}): give the largest global gradient norm to "
                "allow, a finite number, 0 or more"
            )
        if not (is_finite_number(norm_type) and norm_type > 0 or norm_type == math.inf):
            raise ShardplanError(
                f"clip_grad_norm_(norm_type={norm_type!r}): give a p-norm's p above 0, or inf"
            )
        self.check_in_step()
        to_reduce, complete = self._grad_norm_terms(norm_type)
        if math.isinf(norm_type):
            total = torch.maximum(collectives.all_reduce_max(to_reduce), complete)
        else:
            total = (collectives.all_reduce_sum(to_reduce) + complete) ** (1.0 / norm_type)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for parameter in self.parameters():
            if parameter.grad is not None:
                parameter.grad.mul_(coefficient.to(parameter.grad.device))
        return total


def grad_norm_term(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Σ|g|^p over `grads` (max|g| for the inf norm), in float32 on CPU."""
    grads = [g for g in grads if g.numel()]  # a rank's shard of a small parameter may be empty
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float().cpu() for g in grads]).max()
    return torch.stack(
        [torch.linalg.vector_norm(g.detach().float(), norm_type).cpu() ** norm_type for g in grads]
    ).sum()


_replaced: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()
"""Tensors no optimizer should step, by id: a model's parameters that parallelize replaced, and the
placeholders now in their slots (what `model.parameters()` gives after it). Weak, so a freed tensor's
id, reused, is never mistaken for one of them. Process-wide, as torch's optimizer step hooks are."""
_optimizer_hook = None


def refuse_optimizers_over(tensors: Iterable[torch.Tensor]) -> None:
    """Make any optimizer stepping one of `tensors` raise at its step instead of training nothing."""
    global _optimizer_hook
    for tensor in tensors:
        _replaced[id(tensor)] = tensor
    if _optimizer_hook is None:
        _optimizer_hook = register_optimizer_step_pre_hook(_refuse_replaced)


def _refuse_replaced(
    optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    # an error, not a warning: such a step never trains, and a warning scrolls by in a long run's log
    if any(
        _replaced.get(id(parameter)) is parameter
        for group in optimizer.param_groups
        for parameter in group["params"]
    ):
        raise ShardplanError(
            "optimizer steps the model's original parameters, which parallelize replaced: "
            "build it over program.parameters()"
        )


def admit_input(
    plan: Plan,
    args: tuple,
    kwargs: dict,
    *,
    micro_batches: int = 1,
    trains: bool = True,
    over_budget: str = "refuse",
) -> None:
    """Admit a batch for a call, a step or an evaluation, or refuse it in one line: the one place where
    the runtime decides which inputs a plan takes. `micro_batches`: the parts the batch is split into;
    `trains`: False for an evaluation (no gradients, so no memory check); `over_budget`: "refuse" or
    "warn" where a training batch is predicted over the budget ([Note: admitted by memory]).

    [Note: admitted shapes] Nothing in either backend is fixed to the plan's shapes (the
    tensor-parallel layout is found once, at start-up; a pipeline re-cuts its stages at each new
    shape: [Note: pipelined shapes] in pipelined.py), so any batch size and sequence length is
    taken: dynamic padding, a larger evaluation batch, an epoch's last batch. An input the plan
    records keeps its number of dims and its dtype, and holds a sample at least. Sequence
    parallelism splits the sequence (dim 1 of the tokens) over the tp ranks, which it must divide;
    context parallelism into 2 · cp chunks (each split again over tp under sequence parallelism).
    A pipeline's first stage reads every input the plan records, and its schedule runs
    micro-batches of one shape, so the batch must pass them all and split into equal
    micro-batches."""
    for spec in plan.inputs:
        value = _input(spec, args, kwargs)
        if not isinstance(value, torch.Tensor):
            if plan.mesh.pp > 1:
                raise RuntimeMismatchError(
                    f"the plan was made with input {spec.name!r} of shape {list(spec.shape)}; "
                    "this batch does not pass it, which a pipeline's first stage reads: call "
                    "step() with the inputs the model was planned with"
                )
            continue  # left out (labels, to generate): the model's own signature decides
        if value.dim() != len(spec.shape):
            raise RuntimeMismatchError(
                f"input {spec.name!r} has {value.dim()} dims (shape {list(value.shape)}), the plan "
                f"was made for {len(spec.shape)} ({list(spec.shape)}): pass it with "
                f"{len(spec.shape)} dims (batch and sequence may be of any size), or re-plan for this one"
            )
        if value.dim() and not value.shape[0]:
            raise RuntimeMismatchError(
                f"input {spec.name!r} has no samples (shape {list(value.shape)}): give every rank at "
                "least one sample a call (a rank that skips leaves its peers waiting in a collective)"
            )
        _check_dtype(spec, value)
    if plan.mesh.pp > 1:
        _check_equal_micro_batches(args, kwargs, micro_batches)
    if plan.mesh.cp > 1:
        # each cp rank's 2 chunks, then split again over tp by sequence parallelism
        tp = plan.mesh.tp if plan.tensor_parallel.sequence_parallel else 1
        _check_sequence_divides(
            2 * plan.mesh.cp * tp, "context parallelism", "cut into 2 * cp chunks", args, kwargs
        )
    elif plan.tensor_parallel.sequence_parallel:
        _check_sequence_divides(
            plan.mesh.tp,
            "sequence parallelism",
            f"split over tp={plan.mesh.tp} ranks",
            args,
            kwargs,
        )
    if trains:
        _check_predicted_to_fit(plan, args, kwargs, micro_batches, over_budget)


def _check_predicted_to_fit(
    plan: Plan, args: tuple, kwargs: dict, micro_batches: int, over_budget: str
) -> None:
    """[Note: admitted by memory] A plan records the longest sequence that fits its budget at each
    micro-batch size (Plan.sequence_limits, priced from one sequence fit: solver/shapes.py). A micro-
    batch is admitted by the row of the next size up, whose limit is the smaller; sizes past the last
    row and lengths past the lengths priced are not refused, as nothing says they do not fit."""
    tokens = next(
        (
            value
            for spec in plan.inputs
            if isinstance(value := _input(spec, args, kwargs), torch.Tensor) and value.dim() >= 2
        ),
        None,
    )
    if tokens is None or not plan.sequence_limits:
        return
    micro_batch, length = -(-tokens.shape[0] // micro_batches), tokens.shape[1]
    row = next((r for r in plan.sequence_limits if r.micro_batch >= micro_batch), None)
    if row is None or length <= row.longest or row.longest >= priced_lengths(plan):
        return
    message = (
        f"a micro-batch of {micro_batch} x {length} tokens is predicted over the plan's memory budget: "
        f"the longest sequence that fits a micro-batch of {row.micro_batch} is {row.longest} "
        "(Plan.sequence_limits); shorten it, use smaller micro-batches, or re-plan for this shape "
        '(parallelize(..., over_budget="warn") warns instead)'
    )
    if over_budget == "warn":
        warn_at_caller(message)
        return
    raise RuntimeMismatchError(message)


def _check_sequence_divides(
    multiple: int, parallelism: str, split: str, args: tuple, kwargs: dict
) -> None:
    """Refuse a sequence length that `parallelism` cannot `split` (a multiple of `multiple` tokens),
    before any rank runs a layer: the sequence is dim 1 of the first input of 2 dims or more (the
    tokens)."""
    named = [(str(index), value) for index, value in enumerate(args)] + list(kwargs.items())
    tokens = next(
        (
            (name, value)
            for name, value in named
            if isinstance(value, torch.Tensor) and value.dim() > 1
        ),
        None,
    )
    if tokens is not None and tokens[1].shape[1] % multiple:
        name, value = tokens
        raise RuntimeMismatchError(
            f"input {name!r} has a sequence of {value.shape[1]} tokens (shape {list(value.shape)}), "
            f"which the plan's {parallelism} cannot {split}: pad sequences "
            f"to a multiple of {multiple} (pad_to_multiple_of={multiple} in a Hugging Face tokenizer or "
            f"collator), or re-plan without {parallelism}"
        )


def _check_dtype(spec: InputSpec, value: torch.Tensor) -> None:
    given = dtype_name(value.dtype)
    if given != spec.dtype:
        raise RuntimeMismatchError(
            f"input {spec.name!r} is {given}, the plan was made for {spec.dtype}: "
            f"pass it as {spec.dtype} (.to(torch.{spec.dtype})), or re-plan for {given}"
        )


def _input(spec: InputSpec, args: tuple, kwargs: dict) -> Any:
    """The argument of step(...) the plan's input `spec` names (positional ones are named "0", "1", ...)."""
    return (
        args[int(spec.name)]
        if spec.name.isdigit() and int(spec.name) < len(args)
        else kwargs.get(spec.name)
    )


def batch_inputs(plan: Plan, args: tuple, kwargs: dict) -> tuple[InputSpec, ...]:
    """The plan's inputs at the shapes this batch passes them (each one a tensor: a pipeline's batch, which
    admit_input has taken)."""
    return tuple(
        dataclasses.replace(spec, shape=tuple(_input(spec, args, kwargs).shape))
        for spec in plan.inputs
    )


def _takes_planned_shapes(plan: Plan, args: tuple, kwargs: dict) -> bool:
    """Whether this batch passes every input of the plan at its planned shape (AdaScale's estimates are
    for batches of that size: see [Note: AdaScale's samples] in adascale.py)."""
    return all(
        isinstance(value := _input(spec, args, kwargs), torch.Tensor)
        and tuple(value.shape) == tuple(spec.shape)
        for spec in plan.inputs
    )


def _check_equal_micro_batches(args: tuple, kwargs: dict, count: int) -> None:
    """Refuse a batch that does not split into `count` equal micro-batches along dim 0: a pipeline's
    schedule runs micro-batches of one shape (see [Note: pipelined shapes] in pipelined.py)."""
    leaves = pytree.tree_leaves((args, kwargs))
    batch_sizes = sorted(
        {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    )
    if count > 1 and (len(batch_sizes) != 1 or batch_sizes[0] % count):
        raise RuntimeMismatchError(
            f"a pipelined plan splits each batch into {count} equal micro-batches along dim 0 (its "
            f"schedule runs micro-batches of one shape), but the inputs have batch sizes "
            f"{batch_sizes}: pass one batch size divisible by {count} (DataLoader(drop_last=True) "
            "drops an epoch's uneven last batch), or re-plan with another num_micro_batches"
        )


def split_micro_batches(args: tuple, kwargs: dict, count: int) -> list[tuple[tuple, dict, float]]:
    """(args, kwargs, share of the batch) of each micro-batch: every tensor with a batch dim split along
    dim 0 into `count` parts as equal as can be (fewer when the batch has fewer samples).

    [Note: smaller batches]
    A batch of another size than planned (an epoch's last, an evaluation batch; see [Note: admitted
    shapes]) may not split evenly into the plan's micro-batches, so each one's loss, a mean over its
    samples, is weighted by its share of the batch: the step's gradient and loss are the batch's
    mean, as one forward over the whole batch gives. Ranks are averaged with equal weights: give
    every rank the same batch size (DistributedSampler does)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch_sizes = sorted(
        {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    )
    if count == 1:
        return [(args, kwargs, 1.0)]
    if len(batch_sizes) != 1:
        raise RuntimeMismatchError(
            f"the plan splits each batch into {count} micro-batches along dim 0, but the "
            f"inputs have batch sizes {batch_sizes}: give every batched input one batch size, "
            "or re-plan with one micro-batch"
        )
    total = batch_sizes[0]
    quotient, remainder = divmod(total, min(count, total))
    sizes = [quotient + (index < remainder) for index in range(min(count, total))]
    parts = [
        leaf.split(sizes)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0
        else [leaf] * len(sizes)
        for leaf in leaves
    ]
    return [
        (*pytree.tree_unflatten([part[index] for part in parts], spec), size / total)
        for index, size in enumerate(sizes)
    ]
