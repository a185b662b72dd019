"""Exact choice of unit boundaries and per-unit decisions on a chain: dynamic programming.

[Note: what the DP state holds]
Every memory event of a stage (cost.evaluate_stage) is
    Σ_all units base_bytes + Σ_units before the event's unit held_bytes + a local term,
where the local term of unit k depends only on k and its neighbours (the prefetched
unit's params; in backward, also the next unit's reduction in flight). So scanning units
left to right, after placing unit U a partial plan is summarized by
    Q = Σ base_bytes so far + Σ held_bytes so far (U included),
    R = the largest event finished so far (U's backward included, U's forward not yet:
        it depends on whether the next unit is prefetched) + Σ base_bytes so far,
    T = step time so far (U's own terms and the exposure of every pair up to U),
keyed by U itself (its span and decision) and by what U's backward holds of the unit before
it (its params prefetched): U's backward event is then Q + a constant of the key, so the next
unit V can add V's reduction in flight to it. Appending V adds base_bytes(V) to every event
(R and Q), closes U's forward event, adds V's backward event and U's backward event with V's
reduction in flight. The final peak and time are non-decreasing in R, Q and T,
so within a key only the Pareto-minimal (T, R, Q) states can lead to an optimum:
the DP keeps exactly those (and drops states already over budget), which makes it
exact for the cost model, not a heuristic. Further cuts, each exact:
- canonical R: R is raised to Q + the least rise any continuation adds (`_least_rise`);
- safe states: once every continuation of a state fits, slower states of its key go;
- time bounds: given a plan as fast as `time_bound_s` (the search has one), states whose time
  plus a lower bound of the time still to come exceeds it go (`_time_to_end_tables`);
- identical blocks share memoized fronts and unit costs (`block_signatures`).
The decision space and its documented restrictions are in space.py; brute_force.py enumerates
the same space and tests/test_solver.py checks gap 0 on random chains.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import cast

import numpy as np

from shardplan.costmodel import cost
from shardplan.costmodel.cost import CostContext, UnitCost
from shardplan.frontend.chain import Block, TensorParallelFacts
from shardplan.plan import Decision
from shardplan.solver.space import BlockRule, SearchSpace


@dataclass(frozen=True, kw_only=True, slots=True)
class ChainSolution:
    bounds: tuple[int, ...]
    """Block offsets where units start (the first is 0)."""
    decisions: tuple[Decision, ...]
    time_s: float
    """The stage's step time (cost.evaluate_stage's step_time_s without pipeline boundary terms)."""
    peak_bytes: int


def block_signatures(blocks: Sequence[Block]) -> tuple[int, ...]:
    """Identical blocks (same numbers, any name) share an id, so their unit costs are computed once."""
    ids: dict[Block, int] = {}
    return tuple(
        ids.setdefault(
            replace(
                b,
                index=0,
                name="",
                modules=(),
                param_names=(),
                first_node="",
                last_node="",
                tensor_parallel=b.tensor_parallel and _unnamed(b.tensor_parallel),
            ),
            len(ids),
        )
        for b in blocks
    )


def _unnamed(facts: TensorParallelFacts) -> TensorParallelFacts:
    """`facts` without the module names they list (what a refusal names, not what anything costs)."""
    return replace(facts, sharded=(), divisors=tuple((size, "") for size, _ in facts.divisors))


class UnitCosts:
    """The units a chain's spans may form: the decisions each span may take, and unit_cost
    memoized on (signatures of the span, decision), so identical layers cost once.

    unit_cost does not read ctx.in_flight, so the stages of a configuration share one."""

    def __init__(
        self,
        blocks: Sequence[Block],
        rules: tuple[BlockRule, ...],
        space: SearchSpace,
        ctx: CostContext,
        signatures: tuple[int, ...] | None = None,
    ):
        self.blocks, self.rules, self.space, self.ctx = tuple(blocks), rules, space, ctx
        self.signatures = block_signatures(self.blocks) if signatures is None else signatures
        """block_signatures(blocks), which the caller may have already."""
        self.memo: dict = {}
        self.allowed: dict[tuple[int, int], tuple[Decision, ...]] = {}

    def decisions(self, start: int, end: int) -> tuple[Decision, ...]:
        """What a unit of blocks[start:end] may decide (SearchSpace.decisions on their rules)."""
        found = self.allowed.get((start, end))
        if found is None:
            found = self.allowed[(start, end)] = self.space.decisions(self.rules[start:end])
        return found

    def __call__(self, start: int, end: int, decision: Decision) -> cost.UnitCost:
        key = (self.signatures[start:end], decision)
        found = self.memo.get(key)
        if found is None:
            found = self.memo[key] = cost.unit_cost(
                tuple(self.blocks[start:end]), decision, self.ctx
            )
        return found


def block_terms(costs: UnitCosts, ctx: CostContext, count: int) -> list[list[tuple[float, int]]]:
    """For each of the first `count` blocks, the (time, memory) it adds at least to a stage under
    each decision it may take, whatever units it joins (the terms of a Lagrangian relaxation of
    the stage's memory budget: a stage's Σ memory is within budget at its end of forward).

    Time is the block's own unit time and the least its collectives leave exposed (least_exposed_s)
    when units are single blocks, else only its compute and recompute (the rest is not additive over
    a unit's blocks); memory is its base + held bytes as a unit of one block, less one byte for the
    rounding a unit's blocks share."""
    pf = ctx.pipeline_factor
    terms, known = [], {}
    for j in range(count):
        key = (
            costs.signatures[j],
            costs.rules[j],
        )  # identical blocks with the same rules: one list, shared
        if key not in known:
            units = [costs(j, j + 1, d) for d in costs.decisions(j, j + 1)]
            known[key] = [
                (
                    cost.own_time_s(u, ctx) + least_exposed_s(u, ctx)
                    if costs.space.max_unit_blocks == 1
                    else pf * (u.compute_fwd_s + u.compute_bwd_s + u.recompute_s)
                    - ctx.weight_grad_credit * u.compute_bwd_s,
                    max(0, cost.end_of_forward_bytes(u, ctx) - 1),
                )
                for u in units
            ]
        terms.append(known[key])
    return terms


def least_exposed_s(u: UnitCost, ctx: CostContext) -> float:
    """At least what a unit's own collectives leave exposed in its stage's step, whatever its neighbours:
    the pair terms (cost.pair_exposed_s) hide at most 1 - contention of its forward gather (behind the unit
    before), of its backward gather (behind the unit after) and of its reduction, and hide none of them at a
    chain end. Counted a hair low (1e-12), so that float rounding never lifts it above what the pairs sum to."""
    share = u.contention * (1 - 1e-12)
    return share * (
        ctx.pipeline_factor * (u.gather_fwd_s + u.gather_bwd_s)
        + (1 if u.reduce_per_step else ctx.pipeline_factor) * u.reduce_s
    )


def priced_terms(terms: list[list[tuple[float, int]]], prices: np.ndarray) -> list[list[float]]:
    """For each block, min over its decisions of t + λ m at each price λ; a list of terms that
    blocks share (block_terms) is priced once."""
    rows: dict[int, list[float]] = {}
    for options in terms:
        if id(options) not in rows:
            rows[id(options)] = [min(t + price * m for t, m in options) for price in prices]
    return [rows[id(options)] for options in terms]


def lagrange_prices(terms: list[list[tuple[float, int]]], budget_bytes: float) -> np.ndarray:
    """Prices λ (seconds per byte) of the relaxation: 0 (the plain time bound) and a geometric
    range around the price at which the least time and the budget weigh the same."""
    least_time = sum(min(t for t, _ in options) for options in terms)
    scale = least_time / budget_bytes if math.isfinite(budget_bytes) and least_time else 0.0
    return np.array([0.0] + [scale * 2.0**k for k in range(-4, 9)] if scale else [0.0])


class StageFloors:
    """Lower bounds of stage costs on spans of a chain, for the stage cut to skip spans with.

    By `block_terms`, a stage on blocks[a:b] takes at least Σ_b min_d (t_b,d + λ m_b,d) - λ budget
    seconds for every price λ ≥ 0, and its peak is at least Σ_b min_d m_b,d bytes (its end of
    forward); the largest of k stages' costs is at least the mean of their bounds. Memory is
    counted with one micro-batch in flight, the least any stage holds, so one table bounds them all.
    """

    def __init__(self, costs: UnitCosts, budget_bytes: float, *, minimize_memory: bool = False):
        ctx = replace(costs.ctx, in_flight=1)
        terms = block_terms(costs, ctx, len(costs.blocks))
        if minimize_memory:  # the stage's cost is its peak: one row, of bytes
            prices, allowances = np.zeros(1), np.zeros(1)
            per_block: list[list[float]] = [[min(m for _, m in options)] for options in terms]
        else:
            prices = lagrange_prices(terms, budget_bytes)
            allowances = prices * (budget_bytes if math.isfinite(budget_bytes) else 0.0)
            per_block = priced_terms(terms, prices)
        self.sums = np.zeros((len(prices), len(costs.blocks) + 1))
        for j, row in enumerate(per_block):
            self.sums[:, j + 1] = self.sums[:, j] + row
        self.allowances = allowances
        self.rows: dict[int, list[float]] = {}
        """start → the bound of one stage from there, for every end at once (the stage cut asks often,
        millions of times a solve: a list, as indexing an array and handing back a numpy scalar cost
        several times as much for the same float)."""
        self.memo: dict[tuple[int, int, int], float] = {}

    def least(self, start: int, end: int, stages: int = 1) -> float:
        """At least the largest stage cost when `stages` stages cover blocks[start:end]."""
        if stages == 1:
            row = self.rows.get(start)
            if row is None:
                row = self.rows[start] = (
                    (self.sums - self.sums[:, start, None] - self.allowances[:, None])
                    .max(axis=0)
                    .tolist()
                )
            return row[end]
        found = self.memo.get((start, end, stages))
        if found is None:
            spread = (self.sums[:, end] - self.sums[:, start]) / stages - self.allowances
            found = self.memo[(start, end, stages)] = float(spread.max())
        return found

    def least_of_ranks(self, ranks: int, stages_per_rank: int) -> float:
        """At least the slowest rank's time when `ranks` ranks each run `stages_per_rank` of the stages
        covering the chain (virtual stages), a rank's time the sum of its stages': the mean of the
        ranks' bounds, each the sum of its stages' (every stage has its own memory allowance)."""
        spread = self.sums[:, -1] / ranks - stages_per_rank * self.allowances
        return float(spread.max())


@dataclass(slots=True)
class _Front:
    """States as arrays. A state's parent is state `parent_index` of key number `parent_source`
    in the position its last unit started from."""

    time_s: np.ndarray
    r: np.ndarray
    q: np.ndarray
    parent_source: np.ndarray
    parent_index: np.ndarray

    def take(self, keep: np.ndarray) -> "_Front":
        return _Front(
            time_s=self.time_s[keep],
            r=self.r[keep],
            q=self.q[keep],
            parent_source=self.parent_source[keep],
            parent_index=self.parent_index[keep],
        )


@dataclass(slots=True)
class _Columns:
    """Every state of a position, and each key's last unit's terms as arrays, so that appending a
    unit is one vectorized step over all of them: the methods are cost.py's pair terms with this
    view as the earlier unit, computed in the same order so both give the same bits; per key, as
    a key's states share its last unit (`front.parent_source` picks a state's)."""

    front: _Front
    """parent_* here name the state itself: its key number and index at this position."""
    rise_fwd_bytes: np.ndarray
    rise_bwd_bytes: np.ndarray
    """How far the last unit's backward event stands above Q, before the next unit's reduction
    in flight is added to it."""
    prefetch: np.ndarray
    gathered_bwd_bytes: np.ndarray
    gathered_bwd_values: tuple[int, ...]
    """The distinct values of gathered_bwd_bytes."""
    hide_fwd_s: np.ndarray
    gather_bwd_s: np.ndarray
    hide_bwd_s: np.ndarray

    def prefetch_fwd_bytes(self, nxt: UnitCost, ctx: CostContext) -> np.ndarray | int:
        """cost.prefetch_fwd_bytes(each last unit, nxt)."""
        if ctx.in_flight > 1 and nxt.kept_gathered_bytes:
            return 0
        return self.prefetch * nxt.gathered_fwd_bytes

    def prefetch_bwd_bytes(self, nxt: UnitCost) -> np.ndarray | int:
        """cost.prefetch_bwd_bytes(nxt, each last unit)."""
        return self.gathered_bwd_bytes if nxt.prefetch else 0

    def pair_time_s(self, nxt: UnitCost, ctx: CostContext) -> np.ndarray:
        """cost.pair_time_s(each last unit, nxt)."""
        hideable = 1 - nxt.contention  # every unit of a stage has its hardware's contention
        per_mb = (
            nxt.gather_fwd_s
            - self.prefetch * np.minimum(nxt.gather_fwd_s * hideable, self.hide_fwd_s)
            + (
                self.gather_bwd_s
                - nxt.prefetch * np.minimum(self.gather_bwd_s * hideable, nxt.free_bwd_s)
            )
        )
        reduce = nxt.reduce_s - np.minimum(nxt.reduce_s * hideable, self.hide_bwd_s)
        if nxt.reduce_per_step:
            return ctx.pipeline_factor * per_mb + reduce
        return ctx.pipeline_factor * (per_mb + reduce)


@dataclass(slots=True)
class _Position:
    """Pareto fronts of a span, one per key (the last unit: offsets relative to the span's start)."""

    keys: list
    fronts: list
    columns: _Columns | None = None


ROUNDING = 1e-9
"""Relative slack on bounds: the same plan's time summed in another order may differ in the last bits."""
_PARETO_CHUNK = 128
"""States taken at once, in time order (see `_pareto`): larger chunks check more pairs inside
the chunk, smaller ones strike the rest more often; 128 was fastest on LLaMA-70B fronts."""


_EARLIER = np.tri(_PARETO_CHUNK, k=-1, dtype=bool)
"""[i, j]: state j comes before state i in a chunk."""
_NOTHING = np.array([np.iinfo(np.int64).max])
"""Above every byte count: the least Q before a staircase's first point."""


def _staircase(r: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (R, Q) points no other point beats in both: R rising, Q strictly falling."""
    order = np.lexsort((q, r))
    r, q = r[order], q[order]
    lowest_before = np.minimum.accumulate(np.concatenate((_NOTHING, q[:-1])))
    keep = q < lowest_before
    return r[keep], q[keep]


def _beaten(stair_r: np.ndarray, stair_q: np.ndarray, r: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Which (r, q) a staircase point beats or equals in both: the last step at or below r has
    the least Q of all steps at or below r."""
    step = stair_r.searchsorted(r, side="right") - 1
    return (step >= 0) & (stair_q[np.maximum(step, 0)] <= q)


def _witnessed(front: _Front, order: np.ndarray) -> np.ndarray:
    """`order` (states in time order, equal times in the input's order) less the states that the
    earlier state of least Q, or of least R, beats or equals in both R and Q: an O(n) first strike,
    exact as every strike is (an earlier state is no slower, and of equal states the first); most
    states go here, as most are beaten by the leanest earlier state."""
    r, q = front.r[order], front.q[order]
    at = np.arange(len(order))
    struck = np.zeros(len(order), bool)
    for first, second in ((q, r), (r, q)):
        least = np.minimum.accumulate(first)
        witness = np.maximum.accumulate(np.where(first == least, at, 0))[
            :-1
        ]  # the last to reach it
        struck[1:] |= (first[witness] <= first[1:]) & (second[witness] <= second[1:])
    return order[~struck]


def _pareto(front: _Front) -> _Front:
    """Keep the states no other state beats in all of (T, R, Q); of equal states, the first.

    In (T, R, Q) order a state is beaten iff an earlier one is at least as good in R and Q. So
    states are taken a chunk at a time: each is checked against the earlier ones of its chunk,
    and what the chunk keeps joins the staircase of kept (R, Q) points, which strikes out every
    later state it beats at once (a binary search each). On large fronts most states go in a first
    strike in time order alone (`_witnessed`), cheap as a front arrives in runs sorted by time (each
    source key's states); only what it leaves is sorted by (T, R, Q), equal states still in input order."""
    if len(front.time_s) < 2:
        return front
    if (
        len(front.time_s) <= _PARETO_CHUNK
    ):  # one chunk: a first strike would cost more than it saves
        pool = np.lexsort((front.q, front.r, front.time_s))
    else:
        pool = _witnessed(front, np.argsort(front.time_s, kind="stable"))
        pool = pool[np.lexsort((front.q[pool], front.r[pool], front.time_s[pool]))]
    stair_r = stair_q = np.zeros(0, np.int64)
    keep = []
    while len(pool):
        chunk, pool = pool[:_PARETO_CHUNK], pool[_PARETO_CHUNK:]
        r, q = front.r[chunk], front.q[chunk]
        earlier = _EARLIER[: len(chunk), : len(chunk)]
        fresh = chunk[
            ~(earlier & (r[None, :] <= r[:, None]) & (q[None, :] <= q[:, None])).any(axis=1)
        ]
        keep.append(fresh)
        if len(pool):
            stair_r, stair_q = _staircase(
                np.concatenate((stair_r, front.r[fresh])), np.concatenate((stair_q, front.q[fresh]))
            )
            pool = pool[~_beaten(stair_r, stair_q, front.r[pool], front.q[pool])]
    return front.take(np.concatenate(keep))


def _concat(fronts: list[_Front]) -> _Front:
    return _Front(
        *(
            np.concatenate([getattr(f, name) for f in fronts])
            for name in ("time_s", "r", "q", "parent_source", "parent_index")
        )
    )


class ChainSolver:
    """Best plans of sub-chains blocks[a:b] under one CostContext and budget.

    Positions are memoized on the signatures (and rules) of blocks[a:j]: in a run of identical
    layers every start shares them, which is what makes pipeline stage costs cheap.
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        rules: tuple[BlockRule, ...],
        ctx: CostContext,
        budget_bytes: float,
        space: SearchSpace,
        *,
        minimize_memory: bool = False,
        time_bound_s: float = math.inf,
        only_end: int | None = None,
        costs: UnitCosts | None = None,
    ):
        self.blocks, self.rules, self.ctx, self.space = tuple(blocks), rules, ctx, space
        self.budget_bytes, self.minimize_memory = budget_bytes, minimize_memory
        self.time_bound_s = time_bound_s * (1 + ROUNDING)
        """States slower than this are dropped: the caller has a plan at least this fast already."""
        self.only_end = only_end
        """When every query ends here, a state's time plus the compute of the blocks still to come
        (a lower bound of what they add) is held to the bound too."""
        self.costs = costs or UnitCosts(self.blocks, rules, space, ctx)
        """May be shared with the other stages of a configuration."""
        self.prices, self.time_to_end_s = self._time_to_end_tables()
        self.signatures = tuple(zip(self.costs.signatures, rules))
        self.span_ids: dict[tuple, int] = {}
        """(start, end) → an id shared by every span with the same signatures and rules."""
        self.interned: dict[tuple, int] = {}
        self.memo: dict[int, _Position] = {}
        self.solutions: dict[int, ChainSolution | None] = {}
        self.least_rises: dict[tuple, int] = {}
        self.safe_margin_bytes = None if minimize_memory else self._safe_margin_bytes()

    def solve(self, start: int, end: int) -> ChainSolution | None:
        """The fastest plan of blocks[start:end] as one stage, None if nothing fits the budget."""
        if self.only_end is not None and end != self.only_end:
            raise ValueError(
                f"this solver was built for spans ending at {self.only_end}, not {end}"
            )
        span = self._span_id(start, end)
        if span not in self.solutions:
            self.solutions[span] = self._solve(start, end)
        found = self.solutions[span]
        if found is None or found.bounds[0] == start:
            return found
        shift = start - found.bounds[0]
        return ChainSolution(
            bounds=tuple(b + shift for b in found.bounds),
            decisions=found.decisions,
            time_s=found.time_s,
            peak_bytes=found.peak_bytes,
        )

    def _solve(self, start: int, end: int) -> ChainSolution | None:
        built = end  # shorter spans first, from the longest one built already: no deep recursion
        while built > start and self._span_id(start, built - 1) not in self.memo:
            built -= 1
        for shorter_end in range(built, end):
            self._position(start, shorter_end)
        position = self._position(start, end)
        best = None
        for number, (key, front) in enumerate(zip(position.keys, position.fronts)):
            u = self.costs(start + key[0], start + key[1], key[2])
            tail = 0.0 if self.minimize_memory else cost.pair_time_s(u, None, self.ctx)
            peak = np.maximum(front.r, front.q + max(self._rise_fwd(u), 0))
            time_s = front.time_s + tail
            fits = np.flatnonzero((peak <= self.budget_bytes) & (time_s <= self.time_bound_s))
            if not len(fits):
                continue
            # the key's least (time, peak), the first of equals (lexsort is stable): a loop over
            # every state took most of a solve's own time on fronts of thousands
            i = int(fits[np.lexsort((peak[fits], time_s[fits]))[0]])
            candidate = (float(time_s[i]), int(peak[i]))
            if best is None or candidate < best[0]:
                best = (candidate, number, i)
        if best is None:
            return None
        (time_s, peak), number, index = best
        bounds, decisions, at = [], [], end
        while at > start:
            position = self._position(start, at)
            key, front = position.keys[number], position.fronts[number]
            bounds.append(start + key[0])
            decisions.append(key[2])
            number, index, at = (
                int(front.parent_source[index]),
                int(front.parent_index[index]),
                start + key[0],
            )
        return ChainSolution(
            bounds=tuple(reversed(bounds)),
            decisions=tuple(reversed(decisions)),
            time_s=time_s,
            peak_bytes=peak,
        )

    def _least_rise(self, first: int, end: int, decision: Decision, prefetched: int) -> int:
        """The least that any continuation of a state whose last unit is blocks[first:end] (holding
        `prefetched` bytes of the unit before it in its backward) adds above Q.

        The end of the chain adds the unit's forward rise; the next unit V adds the larger of
        that (plus V's prefetched params), V's backward working set (plus this unit's params
        prefetched) and this unit's backward beside V's reduction in flight. Without `only_end`
        the blocks after `end` are unknown (memoized fronts are shared by every span with the same
        blocks), so only the first bound holds. Memoized on the signatures of the blocks it reads:
        in a run of identical layers it is computed once."""
        last = (
            end
            if self.only_end is None or end == self.only_end
            else min(self.only_end, end + self.space.max_unit_blocks)
        )
        key = (self.signatures[first:last], end - first, last == end, decision, prefetched)
        if key not in self.least_rises:
            self.least_rises[key] = self._least_rise_of(first, end, last, decision, prefetched)
        return self.least_rises[key]

    def _least_rise_of(
        self, first: int, end: int, last: int, decision: Decision, prefetched: int
    ) -> int:
        u = self.costs(first, end, decision)
        rise_fwd = self._rise_fwd(u)
        if last == end:
            return rise_fwd
        ctx, least = self.ctx, None
        rise_bwd = cost.own_peak_bytes(u, ctx, backward=True) - cost.held_bytes(u, ctx) + prefetched
        for after in range(end + 1, last + 1):
            for following in self.costs.decisions(end, after):
                v = self.costs(end, after, following)
                rise = max(
                    rise_fwd + cost.prefetch_fwd_bytes(u, v, ctx),
                    cost.own_peak_bytes(v, ctx, backward=True) + cost.prefetch_bwd_bytes(v, u),
                    rise_bwd + cost.in_flight_bwd_bytes(v),
                )
                least = rise if least is None else min(least, rise)
        return rise_fwd if least is None else least

    def _time_to_end_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """Lower bounds of the time blocks[j:only_end] still add, knowing the memory left.

        Every feasible completion of a state with level Q keeps Σ(base + held) of the blocks to
        come within budget - Q (the end-of-forward event), so by `block_terms` the time to come is
        at least Σ_b min_d (t_b,d + λ m_b,d) - λ (budget - Q) for any price λ ≥ 0: returns the
        prices and, per price, those sums by block offset j."""
        n = len(self.blocks)
        if self.only_end is None or self.minimize_memory:
            return np.zeros(1), np.zeros((1, n + 1))
        terms = block_terms(self.costs, self.ctx, self.only_end)
        prices = lagrange_prices(terms, self.budget_bytes)
        sums = np.zeros((len(prices), n + 1))
        per_block = priced_terms(terms, prices)
        for j in reversed(range(self.only_end)):
            sums[:, j] = sums[:, j + 1] + per_block[j]
        return prices, sums

    def _rise_fwd(self, u: cost.UnitCost) -> int:
        """How far a unit's forward event stands above the level after it (its held bytes)."""
        return cost.own_peak_bytes(u, self.ctx, backward=False) - cost.held_bytes(u, self.ctx)

    def _safe_margin_bytes(self) -> int:
        """An upper bound on what any continuation adds to a state's peak, anywhere in the chain:
        every block's largest base + held bytes, plus the largest working set of any unit with
        its neighbours' gathered params and reduction in flight (see `_drop_slower_than_safe`)."""
        n, ctx, space = len(self.blocks), self.ctx, self.space
        spans: dict[tuple, tuple[int, int]] = {}  # identical spans (blocks and rules) counted once
        for a in range(n):
            for b in range(a + 1, min(n, a + space.max_unit_blocks) + 1):
                spans.setdefault(self.signatures[a:b], (a, b))
        units = [self.costs(a, b, d) for a, b in spans.values() for d in self.costs.decisions(a, b)]
        if not units:
            return 0
        gathered = max(u.gathered_bytes for u in units) + max(u.reducing_bytes for u in units)
        rise = max(
            max(cost.own_peak_bytes(u, ctx, backward=True), self._rise_fwd(u)) for u in units
        )
        most: dict[tuple, int] = {}  # per block signature: its largest base + held bytes
        for i in range(n):
            if self.signatures[i : i + 1] not in most:
                singles = [self.costs(i, i + 1, d) for d in self.costs.decisions(i, i + 1)]
                most[self.signatures[i : i + 1]] = max(
                    cost.end_of_forward_bytes(u, ctx) for u in singles
                )
        return rise + gathered + sum(most[self.signatures[i : i + 1]] for i in range(n))

    def _drop_slower_than_safe(self, front: _Front) -> _Front:
        """A state is safe when every continuation of it fits the budget; then no state as slow
        or slower can end faster: keep the fastest safe state and the faster ones (exact)."""
        safe = np.flatnonzero(
            np.maximum(front.r, front.q) + self.safe_margin_bytes <= self.budget_bytes
        )
        if not len(safe):
            return front
        fastest = safe[np.lexsort((front.q[safe], front.r[safe], front.time_s[safe]))[0]]
        return front.take(
            np.flatnonzero(
                (front.time_s < front.time_s[fastest]) | (np.arange(len(front.time_s)) == fastest)
            )
        )

    def _span_id(self, start: int, end: int) -> int:
        found = self.span_ids.get((start, end))
        if found is None:
            for at in range(start, end + 1):
                if (start, at) not in self.span_ids:
                    token = (
                        (self.span_ids[(start, at - 1)], self.signatures[at - 1])
                        if at > start
                        else ()
                    )
                    self.span_ids[(start, at)] = self.interned.setdefault(token, len(self.interned))
            found = self.span_ids[(start, end)]
        return found

    def _position(self, start: int, end: int) -> _Position:
        span = self._span_id(start, end)
        found = self.memo.get(span)
        if found is None:
            found = self.memo[span] = self._build(start, end)
        return found

    def _build(self, start: int, end: int) -> _Position:
        if end == start:
            zero = np.zeros(1, np.int64)
            return _Position(
                keys=[None],
                fronts=[
                    _Front(
                        time_s=np.zeros(1), r=zero, q=zero, parent_source=zero, parent_index=zero
                    )
                ],
            )
        keys, fronts = [], []
        rules, space = self.rules, self.space
        candidates: dict = {}
        for first in range(max(start, end - space.max_unit_blocks), end):
            if first > start and not rules[first].may_start_unit:
                continue
            if any(rules[i].must_start_unit for i in range(first + 1, end)):
                continue
            source = self._position(start, first)
            if not source.keys:
                continue
            for decision in self.costs.decisions(first, end):
                key = (first - start, end - start, decision)
                chunk, prefetched = self._extend(source, start, key)
                for held, part in self._by_prefetched(source, chunk, prefetched):
                    if len(part.time_s):
                        candidates[key + (held,)] = part
        for key, front in candidates.items():
            # Raise R to Q + the least rise any continuation adds: states differing only below
            # that level behave the same in every future, so the Pareto step merges them (exact).
            front.r = np.maximum(
                front.r, front.q + self._least_rise(start + key[0], start + key[1], key[2], key[3])
            )
            if self.safe_margin_bytes is not None:
                front = self._drop_slower_than_safe(front)
            keys.append(key)
            fronts.append(_pareto(front))
        return _Position(keys=keys, fronts=fronts)

    @staticmethod
    def _by_prefetched(
        source: _Position, chunk: _Front, prefetched: np.ndarray | int
    ) -> list[tuple[int, _Front]]:
        """`chunk` split by what the new unit's backward holds of the unit before it (the key's last
        part): a scalar is one value for every state, else one of the source's units' values."""
        if not isinstance(prefetched, np.ndarray):
            return [(prefetched, chunk)]
        values = cast(_Columns, source.columns).gathered_bwd_values
        if len(values) == 1:
            return [(values[0], chunk)]
        return [(held, chunk.take(np.flatnonzero(prefetched == held))) for held in values]

    def _columns(self, position: _Position, start: int) -> _Columns:
        if position.columns is None:
            units = [self.costs(start + k[0], start + k[1], k[2]) for k in position.keys]
            sizes = [len(f.time_s) for f in position.fronts]
            front = _concat(position.fronts)
            front.parent_source = np.repeat(np.arange(len(units)), sizes)
            front.parent_index = np.concatenate([np.arange(size) for size in sizes])
            position.columns = _Columns(
                front=front,
                rise_fwd_bytes=np.array([self._rise_fwd(u) for u in units], np.int64),
                rise_bwd_bytes=np.array(
                    [
                        cost.own_peak_bytes(u, self.ctx, backward=True)
                        - cost.held_bytes(u, self.ctx)
                        + key[3]
                        for u, key in zip(units, position.keys)
                    ],
                    np.int64,
                ),
                prefetch=np.array([u.prefetch for u in units], bool),
                gathered_bwd_bytes=np.array([u.gathered_bwd_bytes for u in units], np.int64),
                gathered_bwd_values=tuple(sorted({u.gathered_bwd_bytes for u in units})),
                hide_fwd_s=np.array([u.hide_fwd_s for u in units], float),
                gather_bwd_s=np.array([u.gather_bwd_s for u in units], float),
                hide_bwd_s=np.array([u.hide_bwd_s for u in units], float),
            )
        return position.columns

    def _extend(
        self, source: _Position, start: int, key: tuple[int, int, Decision]
    ) -> tuple[_Front, np.ndarray | int]:
        """Append unit `key` to every state of `source`; drop what is already over budget. Also returns
        what the new unit's backward holds of the unit before it (its prefetch), per state kept."""
        ctx = self.ctx
        v = self.costs(start + key[0], start + key[1], key[2])
        delta, held_v = cost.base_bytes(v, ctx), cost.held_bytes(v, ctx)
        v_bwd = cost.own_peak_bytes(v, ctx, backward=True)
        own_time = 0.0 if self.minimize_memory else cost.own_time_s(v, ctx)
        prefetched: np.ndarray | int
        if source.keys == [None]:
            front, rise, prefetched = source.fronts[0], v_bwd, 0
            step: float | np.ndarray = (
                0.0 if self.minimize_memory else own_time + cost.pair_time_s(None, v, ctx)
            )
        else:
            columns = self._columns(source, start)
            front, key_of = columns.front, columns.front.parent_source
            held_before = columns.prefetch_bwd_bytes(v)
            rise = np.maximum(
                np.maximum(
                    columns.rise_fwd_bytes + columns.prefetch_fwd_bytes(v, ctx), v_bwd + held_before
                ),
                columns.rise_bwd_bytes + cost.in_flight_bwd_bytes(v),
            )[key_of]
            prefetched = held_before[key_of] if isinstance(held_before, np.ndarray) else held_before
            step = 0.0 if self.minimize_memory else (own_time + columns.pair_time_s(v, ctx))[key_of]
        r = np.maximum(front.r, front.q + rise) + delta
        time_s, q = front.time_s + step, front.q + delta + held_v
        end = start + key[1]
        to_come_s = self.time_to_end_s[:, end, None]
        if math.isfinite(
            self.budget_bytes
        ):  # without a budget only the plain compute bound (λ = 0) is there
            # summed in place: adding the column into a new (prices × states) array took ten times as long
            priced = self.prices[:, None] * np.minimum(q - self.budget_bytes, 0)
            priced += to_come_s
            to_come_s = priced
        fits = np.flatnonzero(
            (r <= self.budget_bytes) & (time_s + to_come_s.max(axis=0) <= self.time_bound_s)
        )
        return (
            _Front(
                time_s=time_s[fits],
                r=r[fits],
                q=q[fits],
                parent_source=front.parent_source[fits],
                parent_index=front.parent_index[fits],
            ),
            prefetched[fits] if isinstance(prefetched, np.ndarray) else prefetched,
        )
