"""A plan priced at shapes other than its own: any replica batch and sequence length, from one
SequenceFit (frontend/shapes.py), and the longest sequence each batch fits in the budget."""

import os
from dataclasses import replace

from shardplan.common.sizes import parse_bytes
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.errors import ShardplanError
from shardplan.frontend.shapes import SequenceFit, inputs_at, sequence_length
from shardplan.plan import Plan, Predicted
from shardplan.solver.evaluate import evaluate

Hardware = str | os.PathLike | HardwareProfile | None


def evaluate_at(
    fit: SequenceFit, plan: Plan, *, batch: int, length: int, hardware: Hardware = None
) -> Predicted:
    """What `plan`'s own decisions cost when each replica takes `batch` samples of `length` tokens
    a step (split into the plan's micro-batches)."""
    if batch < 1:
        raise ShardplanError(f"batch {batch} trains no sample: give 1 or more")
    if not sequence_length(plan.inputs):
        raise ShardplanError(
            "the plan's inputs have no sequence dim (no input of two dims or more): price it at "
            "its own shape with evaluate"
        )
    at = replace(plan, inputs=inputs_at(plan.inputs, batch, length))
    return evaluate(fit.chain_at(length), at, hardware)


def longest_sequence(
    fit: SequenceFit,
    plan: Plan,
    *,
    batch: int,
    memory_budget: int | str | None = None,
    hardware: Hardware = None,
    most: int | None = None,
) -> int:
    """The longest sequence whose predicted peak fits the budget (the plan's own by default) at
    `batch` samples per replica, up to `most` (16 times the plan's length by default); 0 where not
    even one token fits. The peak grows with the length, so a bisection finds it."""
    budget = (
        plan.reasoning.budget_bytes if memory_budget is None else parse_bytes(memory_budget)
    ) or get_hardware(hardware or plan.hardware).usable_memory_bytes
    most = most or 16 * sequence_length(plan.inputs)

    def fits(length: int) -> bool:
        return (
            evaluate_at(fit, plan, batch=batch, length=length, hardware=hardware).peak_bytes
            <= budget
        )

    low, high = (
        0,
        most,
    )  # fits(low) holds (no tokens, by definition); find the last length that fits
    if fits(most):
        return most
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low
