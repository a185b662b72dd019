"""AdaScale (Johnson et al., ICML 2020): the learning rate scaled to the batch by the gradient's noise.

A run at S times the base batch takes steps `gain` times the base learning rate, where
gain = (σ² + μ²) / (σ²/S + μ²) lies between 1 (no noise: a bigger batch buys nothing) and S
(all noise: S times the batch is S base steps). σ² is the trace of the gradient's covariance at
the base batch, μ² the squared norm of the true gradient; both are estimated each step from
the spread of the gradients that are averaged, and smoothed. FairScale's
fairscale/optim/adascale.py is the reference: the same estimators, clamps, smoothing and
debiased running averages, per parameter group.

[Note: AdaScale's samples] The estimators need n independent gradients g_i and the squared norm
of their mean ḡ. Here a sample is one micro-batch of one data-parallel replica, n = dp ×
num_micro_batches, as FairScale counts each accumulated backward: a replica's micro-batches
are drawn from the data as independently as the replicas' batches are. What is never done is
to treat a micro-batch's *reduction* as a replica's: ḡ's norm is taken once per step, from the
step's accumulated, averaged `.grad`. The replica's accumulated gradient cannot be the sample:
units that reduce-scatter (ZeRO-2/3) do so every micro-batch, so a rank never holds its
replica's sum, and holding it would cost the whole model's gradient per rank. Each micro-batch's
gradient is that of loss / num_micro_batches (Program.step, the pipeline's loss), hence the
num_micro_batches² below.

Where the norms are taken, without gathering a gradient: Σ‖g_i‖² in FlatUnit.reduce, on the full
unit gradient each rank holds before its reduction, each rank counting its replica's share (a tp
rank its slices, tp index 0 the parameters whole on every tp rank, once sequence parallelism's
partial sums are completed); ‖ḡ‖² on the reduced shards (FlatUnit.counted_gradients, as
clip_grad_norm_ counts them). Both are summed over the world in one all-reduce of 2 × (parameter
groups) numbers per step.
"""

import math
from typing import cast

import torch

from shardplan.common.files import is_finite_number
from shardplan.errors import ShardplanError
from shardplan.plan import Plan
from shardplan.runtime import collectives
from shardplan.runtime.program import Program, grad_norm_term
from shardplan.runtime.sharded import UnitProgram

VARIANCE_FLOOR = 1e-6
"""FairScale's floor on the variance estimate: the gain stays defined when the noise measures ≤ 0."""


class AdaScale:
    """Scale `optimizer`'s learning rate by AdaScale's gain, from the gradients `program.step` reduces.

    `scale` is the global batch over the base batch the learning rate was tuned for (default: the
    data-parallel replicas, so the base is one replica's batch). The wrapped optimizer keeps its
    own learning rates (a scheduler may change them); `step` multiplies them by each group's gain
    for the update only. Drive schedules by `progress`, the scale-invariant iteration count.
    Parameter group i of every rank's optimizer is measured as one group: under a pipeline, each
    stage's group i (build the stages' optimizers alike).

    >>> adascale = shardplan.AdaScale(torch.optim.SGD(program.parameters(), lr=0.1), program)  # doctest: +SKIP
    >>> loss = program.step(ids, labels=ids); adascale.step(); adascale.zero_grad()         # doctest: +SKIP
    >>> lr_schedule(adascale.progress)                                                       # doctest: +SKIP
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        program: Program,
        scale: float | None = None,
        *,
        smoothing: float | None = None,
    ):
        if not isinstance(program, UnitProgram):
            raise ShardplanError(
                "AdaScale needs each replica's gradient before it is averaged, which "
                f"{type(program).__name__} reduces inside FSDP2's own hooks: parallelize with "
                "backend='shardplan'"
            )
        if program.plan.mesh.cp > 1:
            raise ShardplanError(
                f"AdaScale estimates the gradient's noise from each rank's gradient of its own "
                f"samples, and under context parallelism (cp={program.plan.mesh.cp}) a rank's "
                "gradient is its share of one sequence's: re-plan with cp=1 to use AdaScale"
            )
        if program.plan.mesh.ep > 1:
            raise ShardplanError(
                f"AdaScale estimates the gradient's noise from each rank's gradient of its own "
                f"samples, and under expert parallelism (ep={program.plan.mesh.ep}) a rank's expert "
                "gradients sum its ep group's tokens: re-plan with ep=1 to use AdaScale"
            )
        if program.after_reduction is not None:
            raise ShardplanError(
                "this program already measures its gradients for another AdaScale: make one "
                "AdaScale per program"
            )
        groups = len(optimizer.param_groups)
        if not collectives.same_on_all_ranks(
            [groups]
        ):  # the per-group sums are all-reduced by index
            raise ShardplanError(
                f"the optimizers on the ranks have different numbers of parameter groups (this "
                f"rank's: {groups}): build every rank's optimizer (every stage's) with as many"
            )
        self.optimizer = optimizer
        self.program = program
        group_of = {
            id(parameter): index
            for index, group in enumerate(optimizer.param_groups)
            for parameter in group["params"]
        }
        self._units = [
            (unit, group_of[id(unit.shard)]) for unit in program.units if id(unit.shard) in group_of
        ]
        """This rank's units that the optimizer steps, with the index of their parameter group."""
        plan = program.plan
        self.samples = plan.mesh.dp * plan.schedule.num_micro_batches
        """Gradients averaged each step (see [Note: AdaScale's samples])."""
        self.scale = self._checked(float(plan.mesh.dp if scale is None else scale))
        self.base_batch = global_batch(plan) / self.scale
        """The batch the learning rate was tuned for, in samples (in replicas when the plan records no
        inputs); kept over world changes, which re-derive `scale` from it (load_state_dict)."""
        if smoothing is not None and not (is_finite_number(smoothing) and 0 <= smoothing < 1):
            raise ShardplanError(
                f"AdaScale's smoothing is {smoothing}: give the weight of the past in its running "
                "averages, from 0 to below 1"
            )
        self.smoothing = max(1 - self.samples / 1000, 0.0) if smoothing is None else smoothing
        """Weight of the past in the running averages (FairScale's default: less the more samples a step)."""
        self._averages = {name: [0.0] * groups for name in _AVERAGES}
        self._averages["sqr"] = [1.0] * groups  # gain 1 until a first measurement
        self.progress = 0.0
        """Σ gain over the steps taken: the iterations at the base batch they stand for (schedulers' clock)."""
        self._measured = False
        """Whether a program.step has measured gradients since the last optimizer step."""
        for unit, _ in self._units:
            unit.local_square_norm = torch.zeros((), device=unit.device)
        program.after_reduction = self._measure

    def _checked(self, scale: float, fix: str = "use scale=1") -> float:
        """`scale`, refused where no gain can be estimated for it; `fix`: the way out besides re-planning."""
        if not (is_finite_number(scale) and scale > 0):
            raise ShardplanError(
                f"AdaScale's scale is {scale}: give the global batch over the base batch, a finite "
                "number above 0"
            )
        if self.samples == 1 and scale != 1:
            raise ShardplanError(
                f"AdaScale at scale {scale} estimates the gradient's noise from several "
                "gradients a step, and this plan averages one (dp=1, 1 micro-batch): plan "
                f"dp > 1 or micro-batches > 1, or {fix}"
            )
        return scale

    # the gain

    def gain(self, group: int | None = None) -> float:
        """(σ² + μ²) / (σ²/S + μ²) of parameter group `group`, or of all groups together (None)."""
        indices = range(len(self.optimizer.param_groups)) if group is None else [group]
        variance = sum(self._averages["var"][index] for index in indices)
        square = sum(self._averages["sqr"][index] for index in indices)
        return (variance + square) / (variance / self.scale + square)

    @property
    def variance(self) -> list[float]:
        """σ² per parameter group: the smoothed trace of the gradient's covariance at the base batch."""
        return list(self._averages["var"])

    @property
    def square(self) -> list[float]:
        """μ² per parameter group: the smoothed squared norm of the true gradient."""
        return list(self._averages["sqr"])

    def step(self, closure=None):
        """The wrapped optimizer's step with each group's learning rate times its gain; advances `progress`."""
        if not self._measured:
            raise ShardplanError(
                "AdaScale.step() found no program.step(...) since the last step: AdaScale "
                "measures the gradients program.step reduces; train with program.step"
            )
        groups = self.optimizer.param_groups
        rates = [group["lr"] for group in groups]
        for index, group in enumerate(groups):
            group["lr"] = rates[index] * self.gain(index)
        try:
            result = self.optimizer.step(closure)
        finally:
            for group, rate in zip(groups, rates):
                group["lr"] = rate
        self.progress += self.gain()
        self._measured = False
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # measuring (see [Note: AdaScale's samples])

    def _measure(self, planned: bool) -> None:
        """Update the running averages from the step just reduced (on every rank: one all-reduce), unless
        a rank's batch was smaller than planned (an epoch's last): its micro-batches are not samples of
        the size the estimates are for, so that step keeps the averages (and gains) as they were; as does
        a step whose gradients are not finite."""
        groups = len(self.optimizer.param_groups)
        sums = torch.zeros(2 * groups + 1, dtype=torch.float64)
        for unit, group in self._units:
            sums[group] += (
                cast(torch.Tensor, unit.local_square_norm).double().cpu()
            )  # set in __init__
            sums[groups + group] += grad_norm_term(unit.counted_gradients(), 2.0).double()
            unit.forget_local_norm()
        sums[-1] = 0.0 if planned else 1.0
        collectives.all_reduce_sum(sums)
        count = self.program.plan.schedule.num_micro_batches
        self._measured = True
        if (
            self.samples == 1 or sums[-1] > 0
        ):  # scale 1 (checked): the gain is 1 whatever the estimates
            return
        if not torch.isfinite(sums).all():
            # an overflowed step (one a loop skips for its non-finite loss) would make every later
            # average, gain and learning rate NaN: the averages keep their last values instead
            return
        for group in range(groups):
            variance, square = estimate(
                count**2 * sums[group].item(), sums[groups + group].item(), self.samples, self.scale
            )
            self._update("var", group, variance)
            self._update("sqr", group, square)

    def _update(self, name: str, group: int, value: float) -> None:
        """FairScale's debiased exponential average (Adam's bias correction) of `name` in `group`."""
        biased, weight = self._averages[name + "_biased"], self._averages[name + "_weight"]
        biased[group] = self.smoothing * biased[group] + (1 - self.smoothing) * value
        weight[group] = self.smoothing * weight[group] + (1 - self.smoothing)
        self._averages[name][group] = biased[group] / weight[group]

    # checkpoints

    def state_dict(self) -> dict:
        """Plain numbers (the same on every rank): the running averages, `progress` and the base batch."""
        return {
            "base_batch": self.base_batch,
            "progress": self.progress,
            "averages": {name: list(values) for name, values in self._averages.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s numbers; the scale is re-derived for this program's global batch (a world
        that grew or shrank since the save): scale = global batch / the saved base batch. A state whose numbers
        AdaScale never holds (NaN, infinite, negative; a base batch of 0) is refused, and nothing changes."""
        base_batch, progress, averages = _checked_state(state, len(self.optimizer.param_groups))
        self.scale = self._checked(
            global_batch(self.program.plan) / base_batch,
            fix=f"train at the saved base batch of {base_batch:g} without AdaScale",
        )
        self.base_batch, self.progress, self._averages = base_batch, progress, averages


def _checked_state(state: object, groups: int) -> tuple[float, float, dict[str, list[float]]]:
    """(base batch, progress, averages) of a saved AdaScale state for `groups` parameter groups, each checked."""

    def refuse(what: str) -> ShardplanError:
        return ShardplanError(
            f"the AdaScale state {what}: it is not one AdaScale.state_dict() gives; load the state "
            "that was saved with this run, or start AdaScale afresh"
        )

    if not (isinstance(state, dict) and isinstance(state.get("averages"), dict)):
        raise refuse("is not a dict with base_batch, progress and averages")
    base_batch, progress, saved = state.get("base_batch"), state.get("progress"), state["averages"]
    if not (is_finite_number(base_batch) and base_batch > 0):
        raise refuse(f"has base_batch {str(base_batch)[:40]}, not a number of samples above 0")
    if not (is_finite_number(progress) and progress >= 0):
        raise refuse(f"has progress {str(progress)[:40]}, not a finite number, 0 or more")
    if sorted(saved) != sorted(_AVERAGES):
        raise refuse(f"has averages {sorted(saved)[:8]}, where AdaScale keeps {list(_AVERAGES)}")
    averages = {}
    for name in _AVERAGES:
        values = saved[name]
        if not isinstance(values, (list, tuple)) or len(values) != groups:
            found = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            if name == "var":  # the usual cause: another optimizer's state
                raise ShardplanError(
                    f"the AdaScale state has {found} parameter groups, this optimizer {groups}: "
                    "load it into an optimizer built with the same parameter groups"
                )
            raise refuse(f"has {found} values of {name} for {groups} parameter group(s)")
        top = (
            1.0 if name.endswith("_weight") else math.inf
        )  # a debiasing weight is a sum of shares of 1
        if not all(is_finite_number(value) and 0 <= value <= top for value in values):
            raise refuse(
                f"has {name} {list(values)[:4]}: each must be a finite number, 0 or more"
                + (", at most 1" if top == 1.0 else "")
            )
        averages[name] = [float(value) for value in values]
    if not all(variance + square > 0 for variance, square in zip(averages["var"], averages["sqr"])):
        raise refuse(
            "has a group whose noise and squared gradient are both 0, which leaves its gain undefined"
        )
    return float(base_batch), float(progress), averages


_AVERAGES = ("var", "sqr", "var_biased", "sqr_biased", "var_weight", "sqr_weight")
"""The running averages (var: σ², sqr: μ²) and their debiasing sums, one number per parameter group."""


def estimate(
    local_square: float, reduced_square: float, samples: int, scale: float
) -> tuple[float, float]:
    """(σ², μ²) at the base batch from one step: `local_square` = Σ‖g_i‖² over `samples` gradients g_i,
    `reduced_square` = ‖ḡ‖² of their mean, the global batch `scale` times the base (AdaScale's
    Appendix B.3, as FairScale generalizes it to scale ≠ samples).

    Unbiased: E Σ‖g_i‖² = n(μ² + v) and E‖ḡ‖² = μ² + v/n for a sample's variance v, which is
    σ² n / S at the base batch. Clamped as FairScale clamps them.

    >>> estimate(local_square=12.0, reduced_square=2.0, samples=4, scale=4.0)  # v = (12 - 4 × 2) / 3, S = n
    (1.3333333333333333, 1.6666666666666667)
    """
    variance = (local_square / samples - reduced_square) * scale / (samples - 1)
    square = reduced_square - variance / scale
    return max(variance, VARIANCE_FLOOR), max(square, 0.0)


def global_batch(plan: Plan) -> float:
    """Samples a step averages over the world: dp × the replica batch the plan records (replicas alone
    when it records none, as a plan written by hand without example inputs)."""
    replica = plan.inputs[0].shape[0] if plan.inputs and plan.inputs[0].shape else 1
    return float(plan.mesh.dp * replica)


__all__ = ["AdaScale", "estimate"]
