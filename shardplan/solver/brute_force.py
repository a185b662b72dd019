"""Exhaustive enumeration of the same decision space: the oracle the DPs are tested against.

It shares nothing with the DPs but the SearchSpace and the rules: each candidate
is scored by cost.evaluate_stage, which walks the events one by one.
"""

import itertools
from collections.abc import Iterator, Sequence

from shardplan.costmodel.cost import CostContext, evaluate_stage
from shardplan.frontend.chain import Block
from shardplan.solver.chain_dp import ChainSolution
from shardplan.solver.space import BlockRule, SearchSpace


def unit_partitions(rules: tuple[BlockRule, ...], space: SearchSpace) -> Iterator[tuple[int, ...]]:
    """Every tuple of unit start offsets allowed by the rules and max_unit_blocks."""
    n = len(rules)
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = (0,) + tuple(i + 1 for i, cut in enumerate(cuts) if cut)
        ends = bounds[1:] + (n,)
        if any(rules[i].must_start_unit and i not in bounds for i in range(n)):
            continue
        if any(not rules[i].may_start_unit for i in bounds[1:]):
            continue
        if any(end - start > space.max_unit_blocks for start, end in zip(bounds, ends)):
            continue
        yield bounds


def count_candidates(rules: tuple[BlockRule, ...], space: SearchSpace) -> int:
    total = 0
    for bounds in unit_partitions(rules, space):
        ends = bounds[1:] + (len(rules),)
        count = 1
        for start, end in zip(bounds, ends):
            count *= len(space.decisions(rules[start:end]))
        total += count
    return total


def solve_chain_brute_force(
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    ctx: CostContext,
    budget_bytes: float,
    space: SearchSpace,
) -> ChainSolution | None:
    """The fastest plan of the whole chain within budget (ties: smaller peak, then first found)."""
    best = None
    for bounds in unit_partitions(rules, space):
        ends = bounds[1:] + (len(blocks),)
        choices = [space.decisions(rules[start:end]) for start, end in zip(bounds, ends)]
        for decisions in itertools.product(*choices):
            step = evaluate_stage(tuple(blocks), bounds, decisions, ctx)
            if step.peak_bytes > budget_bytes:
                continue
            key = (step.step_time_s, step.peak_bytes)
            if best is None or key < best[0]:
                best = (
                    key,
                    ChainSolution(
                        bounds=bounds,
                        decisions=tuple(decisions),
                        time_s=step.step_time_s,
                        peak_bytes=step.peak_bytes,
                    ),
                )
    return None if best is None else best[1]
