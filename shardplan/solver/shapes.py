"""A plan priced at shapes other than its own: any micro-batch and sequence length, from one
SequenceFit (frontend/shapes.py), and the longest sequence each micro-batch fits in the budget.

Shapes are per micro-batch, as users ask ("will sequence 8192 fit with micro-batch 2?"): a replica's
step takes the plan's number of micro-batches of that size."""

import os
from dataclasses import replace

from shardplan.common.sizes import parse_bytes
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.errors import ShardplanError
from shardplan.frontend.shapes import SequenceFit, inputs_at, sequence_length
from shardplan.plan import Plan, Predicted
from shardplan.solver.evaluate import evaluate

Hardware = str | os.PathLike | HardwareProfile | None

LENGTHS_SEARCHED = 16
"""The longest sequence searched, in multiples of the plan's own length."""


def priced_lengths(plan: Plan) -> int:
    """The longest sequence `longest_sequence` searches by default: past it nothing is priced."""
    return LENGTHS_SEARCHED * sequence_length(plan.inputs)


def evaluate_at(
    fit: SequenceFit, plan: Plan, *, micro_batch: int, length: int, hardware: Hardware = None
) -> Predicted:
    """What `plan`'s own decisions cost when each micro-batch holds `micro_batch` samples of `length`
    tokens."""
    if micro_batch < 1:
        raise ShardplanError(f"micro-batch {micro_batch} trains no sample: give 1 or more")
    if not sequence_length(plan.inputs):
        raise ShardplanError(
            "the plan's inputs have no sequence dim (no input of two dims or more): price it at "
            "its own shape with evaluate"
        )
    batch = micro_batch * plan.schedule.num_micro_batches
    at = replace(plan, inputs=inputs_at(plan.inputs, batch, length))
    return evaluate(fit.chain_at(length), at, hardware)


def longest_sequence(
    fit: SequenceFit,
    plan: Plan,
    *,
    micro_batch: int,
    memory_budget: int | str | None = None,
    hardware: Hardware = None,
    most: int | None = None,
) -> int:
    """The longest sequence whose predicted peak fits the budget (the plan's own by default) at
    `micro_batch` samples a micro-batch, up to `most` (priced_lengths by default); 0 where not
    even one token fits. The peak grows with the length, so a bisection finds it."""
    budget = (
        plan.reasoning.budget_bytes if memory_budget is None else parse_bytes(memory_budget)
    ) or get_hardware(hardware or plan.hardware).usable_memory_bytes
    most = most or priced_lengths(plan)

    def fits(length: int) -> bool:
        return (
            evaluate_at(
                fit, plan, micro_batch=micro_batch, length=length, hardware=hardware
            ).peak_bytes
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


def micro_batch_of(plan: Plan) -> int:
    """The samples one micro-batch of `plan` holds (at least 1)."""
    return max(1, plan.batch_per_replica // plan.schedule.num_micro_batches)


def sequence_limits(
    fit: SequenceFit,
    plan: Plan,
    *,
    memory_budget: int | str | None = None,
    hardware: Hardware = None,
) -> tuple[tuple[int, int], ...]:
    """(micro-batch, longest sequence that fits) for micro-batches of powers of two up to four times
    the plan's, and the plan's own. The longest shrinks as the micro-batch grows, so a micro-batch
    between two rows fits what the larger one fits."""
    planned = micro_batch_of(plan)
    sizes = sorted({planned, *(2**k for k in range((4 * planned).bit_length()))})
    return tuple(
        (
            size,
            longest_sequence(
                fit, plan, micro_batch=size, memory_budget=memory_budget, hardware=hardware
            ),
        )
        for size in sizes
    )
