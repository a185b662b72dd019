"""Exact pipeline stage cuts: the min-max partition of the chain into pp stages, by DP.

A stage's cost is its step time (chain DP on its blocks, with the micro-batches it holds in
flight) plus its boundary sends; the plan's step time is its slowest stage's, so the cut
minimizing the largest stage cost is optimal, and a DP over (stage, first block) finds it.
"""
from collections.abc import Callable
from dataclasses import dataclass

from .chain_dp import ChainSolution
from .space import BlockRule


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCut:
    start: int
    end: int
    solution: ChainSolution
    time_s: float
    """The stage's step time with its boundary sends."""


def stage_starts_allowed(rules: tuple[BlockRule, ...]) -> tuple[bool, ...]:
    return tuple(i == 0 or (r.may_start_stage and r.may_start_unit) for i, r in enumerate(rules))


def cut_stages(rules: tuple[BlockRule, ...], pp: int,
               stage_cost: Callable[[int, int, int], tuple[ChainSolution, float] | None]) -> tuple[StageCut, ...] | None:
    """The pp stages minimizing the slowest stage's time; None when no cut fits.

    `stage_cost(stage, start, end)` gives the best plan of blocks[start:end] as stage `stage`
    and its time, or None when it does not fit. Ties go to the earliest cut.
    """
    n = len(rules)
    allowed = stage_starts_allowed(rules)
    must = [i for i, r in enumerate(rules) if r.must_start_stage and i > 0]
    best: dict[tuple[int, int], tuple[float, int] | None] = {(pp, n): (0.0, n)}
    for stage in reversed(range(pp)):
        for start in range(stage, n - (pp - 1 - stage)):
            if not allowed[start]:
                continue
            choice = None
            ends = range(start + 1, n - (pp - 2 - stage)) if stage < pp - 1 else (n,)
            for end in ends:  # each later stage keeps one block at least
                if any(start < i < end for i in must):
                    break
                rest = best.get((stage + 1, end))
                if rest is None:
                    continue
                found = stage_cost(stage, start, end)
                if found is None:
                    continue
                worst = max(found[1], rest[0])
                if choice is None or worst < choice[0]:
                    choice = (worst, end)
            best[(stage, start)] = choice
    if best.get((0, 0)) is None:
        return None
    cuts, start = [], 0
    for stage in range(pp):
        end = best[(stage, start)][1]
        solution, time_s = stage_cost(stage, start, end)
        cuts.append(StageCut(start=start, end=end, solution=solution, time_s=time_s))
        start = end
    return tuple(cuts)
