"""Exact pipeline stage cuts: the min-max partition of the chain into pp stages, by DP.

A stage's cost is its step time (chain DP on its blocks, with the micro-batches it holds in
flight) plus its boundary sends; the plan's step time is its slowest stage's, so the cut
minimizing the largest stage cost is optimal, and a DP over (stage, first block) finds it.

Most (stage, span) pairs cannot be part of the optimum, and each one asked for costs a chain
DP, so the DP is solved top-down and skips them by lower bounds of the cost of a stage and of
the slowest of the stages after it (chain_dp.StageFloors). That is exact: what it skips is
strictly worse than a cut in hand, or than the bound the caller gives. Each stage tries its
ends from the balanced one outwards, so a good cut is in hand early and the bounds bite.
"""

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from shardplan.solver.chain_dp import ROUNDING, ChainSolution
from shardplan.solver.space import BlockRule


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCut:
    start: int
    end: int
    solution: ChainSolution
    time_s: float
    """The stage's step time with its boundary sends."""


def stage_starts_allowed(rules: tuple[BlockRule, ...]) -> tuple[bool, ...]:
    return tuple(i == 0 or (r.may_start_stage and r.may_start_unit) for i, r in enumerate(rules))


def cut_stages(
    rules: tuple[BlockRule, ...],
    pp: int,
    stage_cost: Callable[[int, int, int], tuple[ChainSolution, float] | None],
    floor: Callable[[int, int, int], float] | None = None,
    bound: float = math.inf,
) -> tuple[StageCut, ...] | None:
    """The pp stages minimizing the slowest stage's cost; None when no cut fits, or none has
    its slowest stage's cost within `bound`.

    `stage_cost(stage, start, end)` gives the best plan of blocks[start:end] as stage `stage`
    and its cost, or None when it does not fit. `floor(start, end, k)` is at most the cost of the
    slowest of k stages covering blocks[start:end] (none given: 0); it must not shrink as the
    span grows. Ties go to the earliest cut.
    """
    n = len(rules)
    bound *= 1 + ROUNDING  # the caller's bound may be the same time summed in another order
    allowed = stage_starts_allowed(rules)
    must = [i for i, r in enumerate(rules) if r.must_start_stage and i > 0]

    def at_least(start: int, end: int, stages: int = 1) -> float:
        return 0.0 if floor is None else floor(start, end, stages) * (1 - ROUNDING)

    best: dict[tuple[int, int], tuple[float, int] | None] = {(pp, n): (0.0, n)}

    def solve_from(stage: int, start: int) -> tuple[float, int] | None:
        """(the least slowest-stage cost of stages stage.. on blocks[start:], this stage's end)."""
        if (stage, start) in best:
            return best[(stage, start)]
        later = pp - 1 - stage  # stages after this one, each keeping one block at least
        first, last = (start + 1, n - later) if later else (n, n)
        last = min([last] + [i for i in must if i > start])  # a pinned stage start ends this stage
        choice = None

        def limit() -> float:
            return bound if choice is None else choice[0]

        def consider(end: int) -> None:
            nonlocal choice
            if at_least(start, end) > limit():
                return
            rest = solve_from(stage + 1, end) if end == n or allowed[end] else None
            if rest is None or rest[0] > limit():
                return
            found = stage_cost(stage, start, end)
            if found is None or found[1] > bound:
                return
            if choice is None or (max(found[1], rest[0]), end) < choice:
                choice = (max(found[1], rest[0]), end)

        # The balanced end: this stage's floor reaches the later stages' floor.
        balanced = (
            first
            if not later
            else bisect.bisect_left(
                range(first, last + 1),
                0.0,
                key=lambda end: at_least(start, end) - at_least(end, n, later),
            )
            + first
        )
        for end in range(balanced, last + 1):  # this stage's floor only grows
            if at_least(start, end) > limit():
                break
            consider(end)
        for end in reversed(range(first, balanced)):  # the later stages' floor only grows
            if at_least(end, n, later) > limit():
                break
            consider(end)
        best[(stage, start)] = choice
        return choice

    if solve_from(0, 0) is None:
        return None
    cuts, start = [], 0
    for stage in range(pp):
        chosen = best[(stage, start)]
        assert chosen is not None, (
            "solve_from(0, 0) found a plan: every stage on its path has an end"
        )
        end = chosen[1]
        found = stage_cost(stage, start, end)
        assert found is not None, "the search costed this stage already"
        solution, time_s = found
        cuts.append(StageCut(start=start, end=end, solution=solution, time_s=time_s))
        start = end
    return tuple(cuts)
