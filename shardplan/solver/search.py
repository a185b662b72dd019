"""The outer enumeration: mesh (pp × dp_replicate × dp_shard × cp × tp), micro-batch count and pipeline
schedule.

For each configuration the stage cut (stages.py) and, inside each stage, the units and
their decisions (chain_dp.py) are exact, but where a rank runs several stages or defers their
weight gradients ([Note: a rank's stages share its budget]); this module tries every configuration
and ranks the results. Plain data in, plain data out.

[Note: near ties] The cost model is off by a few percent against measured runs (memory and time on CPU
ranks, more against published GPU runs), so a plan predicted 1-2% faster than a much simpler one is not
known to be faster. Within PlanOptions.near_tie of the fastest time a sample, the plan without a
pipeline, then the one mixing the fewest unit settings, is chosen, and its reasoning names the faster
plan it passed over.

[Note: a rank's stages share its budget] Under a schedule priced by its order of operations
(cost.ORDERED_SCHEDULES: virtual stages, the zero-bubble schedule) a rank's peak is its stages'
together (cost.pipeline_ranks): while one runs, the others hold their state and the activations of
the micro-batches they have in flight, and under the zero-bubble schedule what their deferred weight
gradients start from; a stage's DP sees its own peak alone. So solve_configuration cuts the stages
with each given the whole budget, walks each rank's order, and while some rank's peak is over, lowers
the budgets of that rank's stages by the excess, shared in proportion to how far each stage's peak
stands above the least its span can reach, and cuts again. Where every stage of the rank is at that
least already, each budget goes one byte below it: the cut must give those stages fewer blocks. Each
round takes a plan of some stage out of its reach for good, so the rounds end, with a plan whose
every rank fits or with none. It is not exact: what a stage saves of its own peak and what its rank
saves at its fullest moment differ (the shares may lower a stage more than its rank needed, a slower
plan), and the cut is made on the stages' budgets, not the ranks' (tests/test_virtual_stages.py
checks it against every plan of a tiny model). Without such a schedule the first cut is the answer.
"""

import bisect
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from shardplan.costmodel import cost
from shardplan.costmodel.cost import CostContext, evaluate_stage
from shardplan.costmodel.hardware import HardwareModel
from shardplan.frontend.chain import Block, BlockChain
from shardplan.plan import (
    MULTI_STAGE_SCHEDULES,
    Decision,
    Mesh,
    MixedPrecision,
    Schedule,
)
from shardplan.solver.chain_dp import (
    ROUNDING,
    ChainSolution,
    ChainSolver,
    StageFloors,
    UnitCosts,
    block_signatures,
)
from shardplan.solver.space import BlockRule, SearchSpace
from shardplan.solver.stages import StageCut, cut_stages

SCHEDULES = ("1f1b", "interleaved_1f1b", "zero_bubble")
"""Schedules searched. GPipe is left out: in the cost model it takes the time of 1F1B with more
micro-batches in flight (m instead of min(m, pp - stage)), so it never wins, at any micro-batch count:
1F1B over fewer micro-batches than stages runs too (fill-drain on the early stages: Schedule.runs_as,
[Note: 1F1B over fewer micro-batches than stages] in runtime/pipeline_schedules.py). A plan may still
name GPipe (Configuration.in_flight prices it). Interleaved 1F1B is searched at every v from 2 with
pp · v stages of a block each at least, the zero-bubble schedule at every v from 1 (virtual_stage_counts);
both over at least pp micro-batches, in whole rounds of pp as torch's schedules run them
(multi_stage_micro_batches)."""

MAX_VIRTUAL_STAGES = 4
"""The most virtual stages per rank searched: each halves the bubble again and adds a send per
micro-batch and rank; Megatron-LM's and torchtitan's published runs take 2 to 4."""


def configuration_space(space: SearchSpace, configuration: "Configuration") -> SearchSpace:
    """The decisions a configuration's units may take: the zero-bubble schedule runs each backward in two
    passes, which torch's selective checkpointing refuses (it allows one backward through a region it
    recomputes), so its units do not checkpoint selectively."""
    if configuration.schedule.name != "zero_bubble":
        return space
    return replace(space, checkpoints=tuple(c for c in space.checkpoints if not c.selective))


def virtual_stage_counts(schedule: str, pp: int, n_blocks: int, tied: bool = False) -> range:
    """The v searched for `schedule` over `pp` ranks of a chain of `n_blocks` blocks: pp · v stages of a
    block each at least (see SCHEDULES); one stage per rank for a chain with `tied` parameters, whose
    ties across stages the runtime shares between stages of one per rank only."""
    if pp == 1 or schedule not in MULTI_STAGE_SCHEDULES:
        return range(1, 2)
    least = 2 if schedule == "interleaved_1f1b" else 1
    return range(least, (1 if tied else min(MAX_VIRTUAL_STAGES, n_blocks // pp)) + 1)


def multi_stage_micro_batches(schedule: str, pp: int, m: int) -> bool:
    """Whether a schedule with virtual stages runs `m` micro-batches over `pp` ranks as searched: at least
    pp, in whole rounds (torch's interleaved schedules take m divisible by its rounds, max(1, m // pp),
    and below pp their warm-up leaves ranks waiting on one another's stages)."""
    return schedule not in MULTI_STAGE_SCHEDULES or (m >= pp and m % (m // pp) == 0)


RUNNER_UP_SLACK = 1.25
"""A configuration is searched only for plans at most this much slower than the best so far:
the bound prunes the DPs (exactly: the winner is never cut), and runner-ups stay informative."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Setting:
    """Everything fixed for one search: the step's shape and what may vary."""

    world_size: int
    batch_size: int
    """Samples in one replica's batch (the leading dim of the example inputs)."""
    mixed_precision: MixedPrecision = MixedPrecision()
    optimizer: str = "adamw"
    allow_pipeline: bool = True
    max_pipeline_degree: int = 8
    """Deeper pipelines need many micro-batches to amortize the bubble; raise it for huge models."""
    max_micro_batches: int = 64
    skip_edges: tuple[tuple[int, int], ...] = ()
    """(i, j): block j > i + 1 reads block i's output (T5's encoder output, LLaMA's rotary tables):
    a stage boundary between them sends that output too."""
    tied_edges: tuple[tuple[int, int], ...] = ()
    """(i, j): block j reads a parameter block i holds: a stage boundary between them costs tied_terms."""
    global_batch_size: int | None = None
    """Samples of one step over all replicas, each replica taking global / dp of them; None: every
    replica takes the chain's batch (`batch_size`), whatever dp."""
    tensor_parallel: tuple[tuple[int, bool], ...] = ((1, False),)
    """(tp degree, sequence parallel) pairs to search: tensor_parallel_options."""
    context_parallel: tuple[int, ...] = (1,)
    """cp degrees to search: context_parallel_options."""
    expert_parallel: tuple[int, ...] = (1,)
    """ep degrees to search: expert_parallel_options."""
    replica_group_ranks: int = 0
    """dp_replicate > 1 only where a replica group's dp_shard × tp ranks are a multiple of this (a
    node's devices); 0: no replica groups."""
    runtime: cost.Runtime | None = None
    """Whose kernels around the collectives are priced (CostContext.runtime); None: shardplan's runtime's."""

    def replica_batch(self, dp: int) -> float:
        """Samples one replica takes per step."""
        return self.global_batch_size / dp if self.global_batch_size else self.batch_size


@dataclass(frozen=True, kw_only=True, slots=True)
class Configuration:
    """One point of the outer search: the plan's mesh and schedule."""

    mesh: Mesh
    schedule: Schedule
    sequence_parallel: bool = False

    def in_flight(self, stage: int) -> int:
        """Micro-batches stage `stage` is priced holding ([Note: virtual stages and the zero-bubble
        schedule] in costmodel/cost.py for the schedules with virtual stages)."""
        schedule, pp = self.schedule, self.mesh.pp
        if pp > 1 and schedule.name in cost.ORDERED_SCHEDULES:
            return cost.in_flight_at_peak(
                schedule.name, pp, schedule.virtual_stages, schedule.num_micro_batches, stage
            )
        return schedule.in_flight(stage, pp)

    @property
    def stage_count(self) -> int:
        """Stages of the plan: pp · v."""
        return self.mesh.pp * self.schedule.virtual_stages

    def describe(self) -> str:
        mesh = self.mesh
        text = f"dp={mesh.dp} pp={mesh.pp} micro-batches={self.schedule.num_micro_batches}"
        if mesh.tp > 1 or mesh.dp_replicate > 1:
            text = (
                f"dp_shard={mesh.dp_shard}"
                + (f" dp_replicate={mesh.dp_replicate}" if mesh.dp_replicate > 1 else "")
                + (
                    f" tp={mesh.tp}" + (" (sequence parallel)" if self.sequence_parallel else "")
                    if mesh.tp > 1
                    else ""
                )
                + f" pp={mesh.pp} micro-batches={self.schedule.num_micro_batches}"
            )
        if mesh.cp > 1:
            text = f"cp={mesh.cp} " + text
        if mesh.ep > 1:
            text = f"ep={mesh.ep} " + text
        if self.schedule.virtual_stages > 1:
            text += f" virtual-stages={self.schedule.virtual_stages}"
        return text + (f" {self.schedule.name}" if self.mesh.pp > 1 else "")


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    configuration: Configuration
    stages: tuple[StageCut, ...]
    step_time_s: float
    peak_bytes: int


@dataclass(slots=True)
class SearchMemo:
    """What searches of one chain share when they take the same rules, space, hardware and step (their
    Settings differing at most in tensor_parallel): compile's searches of one solve. Configurations
    come back across them (the best of each tp degree searches the main search's again)."""

    guesses: dict[Configuration, float] = field(default_factory=dict)
    """Each configuration's simple plan's step time (uniform_plan_time_s), walked once: for searches
    of one budget (a search given a time bound neither reads nor writes them)."""
    unit_costs: dict[Configuration, UnitCosts] = field(default_factory=dict)
    """Each configuration's UnitCosts, priced once (they do not depend on the budget)."""
    signatures: tuple[int, ...] | None = None
    """block_signatures of the chain."""
    boundaries: dict[Configuration, list[float]] = field(default_factory=dict)
    """Each configuration's boundary_times_s, priced once: the guess and the search of a configuration
    each took them, and pricing every block on its rank for them was a tenth of a search."""

    def costs(
        self,
        blocks: Sequence[Block],
        rules: tuple[BlockRule, ...],
        setting: Setting,
        configuration: Configuration,
        hardware: HardwareModel,
        space: SearchSpace,
    ) -> UnitCosts:
        found = self.unit_costs.get(configuration)
        if found is None:
            if self.signatures is None:
                self.signatures = block_signatures(blocks)
            found = self.unit_costs[configuration] = UnitCosts(
                blocks,
                rules,
                configuration_space(space, configuration),
                context(setting, configuration, hardware, 0),
                self.signatures,
            )
        return found

    def boundary_times_s(
        self,
        blocks: Sequence[Block],
        setting: Setting,
        configuration: Configuration,
        hardware: HardwareModel,
    ) -> list[float]:
        found = self.boundaries.get(configuration)
        if found is None:
            found = self.boundaries[configuration] = boundary_times_s(
                blocks, setting, configuration, hardware
            )
        return found


def tensor_parallel_options(
    blocks: Sequence[Block], world_size: int, max_degree: int
) -> tuple[tuple[int, bool], ...]:
    """(tp, sequence parallel) to search: 1, and each degree up to `max_degree` dividing the world at
    which some block slices (TensorParallelFacts.slices_at), with sequence parallelism where every
    layer between the pairs slices at it (a layer left whole cannot run on a shard of the sequence)."""
    found = [(1, False)]
    for degree in range(2, min(max_degree, world_size) + 1):
        facts = [b.tensor_parallel for b in blocks if b.tensor_parallel is not None]
        if world_size % degree or not any(f.slices_at(degree) for f in facts):
            continue
        layers = [f for f in facts if f.sequence_layer]
        found.append((degree, bool(layers) and all(f.slices_at(degree) for f in layers)))
    return tuple(found)


def context_parallel_options(
    chain: BlockChain, world_size: int, max_degree: int
) -> tuple[int, ...]:
    """cp to search: 1, and each degree up to `max_degree` dividing the world where the runtime can split
    the sequence (runtime/context_parallel.py): the model attends (a block's attention_kv_bytes), is
    trained from labels=, and its sequence (dim 1 of the first input of 2 dims or more) divides into
    2 · cp chunks."""
    lengths = [spec.shape[1] for spec in chain.inputs if len(spec.shape) > 1]
    attends = any(block.attention_kv_bytes for block in chain.blocks)
    if not (lengths and attends and any(spec.name == "labels" for spec in chain.inputs)):
        return (1,)
    return (1,) + tuple(
        cp
        for cp in range(2, min(max_degree, world_size) + 1)
        if world_size % cp == 0 and lengths[0] % (2 * cp) == 0
    )


def expert_parallel_options(chain: BlockChain, world_size: int, max_degree: int) -> tuple[int, ...]:
    """ep to search: 1, and each degree up to `max_degree` dividing the world and the experts of every
    block holding routed experts (Block.routed_experts), where the model has some."""
    counts = [block.routed_experts for block in chain.blocks if block.routed_experts]
    return (1,) + tuple(
        ep
        for ep in range(2, min(max_degree, world_size) + 1)
        if counts and world_size % ep == 0 and all(count % ep == 0 for count in counts)
    )


def replica_groups(setting: Setting, dp: int, tp: int) -> tuple[int, ...]:
    """dp_replicate to try over `dp` data-parallel ranks: 1 (every rank shards), and replica groups
    of one node's worth of ranks (dp_shard × tp = setting.replica_group_ranks), whose gathers stay
    inside the node. Groups of several nodes sit between the two (slower gathers than one node's, more
    memory than all ranks'), and are not searched: a pruning, which keeps 1024 ranks in seconds."""
    shard = setting.replica_group_ranks // tp if setting.replica_group_ranks >= tp else 0
    return (1,) + ((dp // shard,) if shard and dp % shard == 0 and shard < dp else ())


def configurations(setting: Setting, n_blocks: int) -> list[Configuration]:
    """Every mesh, micro-batch count and schedule to try, in a fixed order: tp among
    setting.tensor_parallel, cp among setting.context_parallel (without a pipeline), pp up to the
    blocks, dp_replicate among replica_groups, ep among setting.expert_parallel where it divides
    dp_shard × cp (without tp or a pipeline, as the runtime runs it), micro-batch counts dividing a
    replica's batch."""
    world = setting.world_size
    found = []
    for (tp, sequence_parallel), cp, pp in itertools.product(
        setting.tensor_parallel, setting.context_parallel, range(1, n_blocks + 1)
    ):  # a stage holds a block at least: O(blocks), not O(ranks)
        if (
            (world // tp) % (pp * cp)
            or (pp > 1 and (not setting.allow_pipeline or pp > setting.max_pipeline_degree))
            or (cp > 1 and pp > 1)  # the runtime splits no sequence under a pipeline
        ):
            continue
        dp = world // (tp * pp * cp)
        batch = setting.replica_batch(dp)
        if batch != int(batch) or batch < 1:
            continue
        micro = [
            m for m in range(1, min(int(batch), setting.max_micro_batches) + 1) if batch % m == 0
        ]
        for replicas, ep, m, schedule in itertools.product(
            replica_groups(setting, dp, tp * cp),
            setting.expert_parallel,
            micro,
            SCHEDULES if pp > 1 else ("none",),
        ):
            if not multi_stage_micro_batches(schedule, pp, m) or (
                ep > 1 and ((dp // replicas * cp) % ep or tp > 1 or pp > 1)
            ):
                continue
            for v in virtual_stage_counts(schedule, pp, n_blocks, bool(setting.tied_edges)):
                found.append(
                    Configuration(
                        mesh=Mesh(
                            dp_shard=dp // replicas,
                            dp_replicate=replicas,
                            tp=tp,
                            pp=pp,
                            cp=cp,
                            ep=ep,
                        ),
                        schedule=Schedule(num_micro_batches=m, name=schedule, virtual_stages=v),
                        sequence_parallel=sequence_parallel,
                    )
                )
    return found


def context(
    setting: Setting, configuration: Configuration, hardware: HardwareModel, stage: int
) -> CostContext:
    mesh, precision = configuration.mesh, setting.mixed_precision
    return CostContext(
        hardware=hardware,
        dp=mesh.parameter_mesh.dp_shard,  # the cp ranks shard the units with the dp_shard ranks
        dp_replicate=mesh.dp_replicate,
        tp=mesh.tp,
        sequence_parallel=configuration.sequence_parallel,
        cp=mesh.cp,
        ep=mesh.ep,
        batch_scale=setting.replica_batch(mesh.dp) / setting.batch_size / mesh.cp,
        num_micro_batches=configuration.schedule.num_micro_batches,
        in_flight=configuration.in_flight(stage),
        pipeline_degree=mesh.pp,
        schedule=configuration.schedule.name,
        virtual_stages=configuration.schedule.virtual_stages,
        stage=stage,
        param_dtype=precision.param_dtype,
        reduce_dtype=precision.reduce_dtype,
        optimizer=setting.optimizer,
        runtime=setting.runtime,
    )


def boundary_bytes(blocks: Sequence[Block], skip_edges: Sequence[tuple[int, int]]) -> list[int]:
    """Activation bytes crossing a stage boundary at each cut (before block `cut`, 0 < cut < n;
    0 at both ends): the previous block's output and the output of every earlier block read
    past the cut. A block i read as late as block j crosses every cut in i + 2 .. j: summed
    over the cuts once, as running sums of where each such span starts and ends."""
    n = len(blocks)
    last_reader: dict[int, int] = {}
    for i, j in skip_edges:
        last_reader[i] = max(last_reader.get(i, j), j)
    change = [0] * (n + 2)
    for i, j in last_reader.items():
        if i + 2 <= j:
            change[i + 2] += blocks[i].output_bytes
            change[j + 1] -= blocks[i].output_bytes
    skipping = list(itertools.accumulate(change))
    return [0] + [blocks[cut - 1].output_bytes + skipping[cut] for cut in range(1, n)] + [0]


def boundary_times_s(
    blocks: Sequence[Block], setting: Setting, configuration: Configuration, hardware: HardwareModel
) -> list[float]:
    """Per-micro-batch pipeline traffic of a boundary at each cut (0 at both ends): the stages on
    either side each pay it once, one sending the activations forward, the other their gradient
    back. A send of x bytes between two ranks is priced as an all-gather of 2x bytes over 2 ranks
    (each rank receives x): the profile has no point-to-point figures. It includes the link's
    in-step wait: a send in a step waits for its peer as a collective does (without it the
    pipelined plans' step times read 0.72-0.96 of measured, with it 0.84-1.02: docs/benchmarks.md).
    Neighbouring stages sit dp · tp ranks apart (the activations each tp rank holds, 1/tp of them
    under sequence parallelism, are what it sends: on_rank): once the world spans nodes, the slowest stage's sends
    cross them, one rank's links each side (ranks_per_node=1)."""
    if configuration.mesh.pp == 1:
        return [0.0] * (len(blocks) + 1)
    ctx = context(setting, configuration, hardware, 0)
    m, crossing = (
        ctx.num_micro_batches,
        boundary_bytes([cost.on_rank(b, ctx) for b in blocks], setting.skip_edges),
    )
    spans_nodes = setting.world_size > getattr(hardware, "devices_per_node", setting.world_size)
    ranks_per_node = (
        1 if spans_nodes else 0
    )  # 0: the group fills nodes (CostContext.ranks_per_node)
    return (
        [0.0]
        + [
            hardware.collective_time_s(
                "all_gather_into_tensor", 2 * -(-nbytes // m), 2, ranks_per_node=ranks_per_node
            )
            for nbytes in crossing[1:-1]
        ]
        + [0.0]
    )


def boundary_time_s(
    blocks: Sequence[Block],
    start: int,
    end: int,
    setting: Setting,
    configuration: Configuration,
    hardware: HardwareModel,
) -> float:
    """Per-micro-batch pipeline traffic of the stage blocks[start:end] (see boundary_times_s)."""
    times_s = boundary_times_s(blocks, setting, configuration, hardware)
    return times_s[start] + times_s[end]


class TiedTerms(NamedTuple):
    copy_bytes: int
    """Held all step by the stage: copies of parameters another stage holds, with their gradients."""
    sync_s: float
    """Once a step: their values sent to the copies and the gradients summed back."""


def tied_terms(
    blocks: Sequence[Block],
    start: int,
    end: int,
    setting: Setting,
    configuration: Configuration,
    hardware: HardwareModel,
) -> TiedTerms:
    """What ties to other stages cost the stage blocks[start:end] (see [Note: tied weights across stages] in
    runtime/pipelined.py): for each tie (i, j) it holds one end of, a broadcast of the parameters and an
    all-reduce of their gradients between the two stages, each the owner's shard (block i's parameters in
    fp32, as the optimizer steps them, over dp_shard); the stage of j keeps the copy and its gradient."""
    copy_bytes, sync_s = 0, 0.0
    for i, j in setting.tied_edges:
        if (start <= i < end) == (start <= j < end):
            continue
        shard_bytes = -(-blocks[i].param_numel * 4 // configuration.mesh.dp_shard)
        # the broadcast to one peer priced as a send is (boundary_times_s)
        sync_s += hardware.collective_time_s(
            "all_gather_into_tensor", 2 * shard_bytes, 2
        ) + hardware.collective_time_s("all_reduce", shard_bytes, 2)
        copy_bytes += 2 * shard_bytes if start <= j < end else 0
    return TiedTerms(copy_bytes, sync_s)


def solve_configuration(
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    configuration: Configuration,
    hardware: HardwareModel,
    budget_bytes: float,
    space: SearchSpace,
    *,
    minimize_memory: bool = False,
    time_bound_s: float = math.inf,
    costs: UnitCosts | None = None,
    times_s: Sequence[float] | None = None,
) -> Candidate | None:
    """The best plan with this mesh, micro-batch count and schedule (or the smallest-peak one);
    None when nothing fits the budget or nothing is as fast as `time_bound_s`. `costs`, `times_s`:
    its UnitCosts and boundary_times_s, where the caller keeps them (SearchMemo)."""
    narrowed = configuration_space(space, configuration)
    if narrowed is not space and not all(narrowed.decisions((rule,)) for rule in set(rules)):
        return None  # a block's constraint allows only what this schedule cannot run
    space = narrowed
    contexts = [
        context(setting, configuration, hardware, stage)
        for stage in range(configuration.stage_count)
    ]
    if costs is None:  # shared by the stages: see UnitCosts
        costs = UnitCosts(blocks, rules, space, contexts[0])
    solvers: dict[tuple[int, float, bool], ChainSolver] = {}
    if times_s is None:
        times_s = boundary_times_s(blocks, setting, configuration, hardware)
    floors = StageFloors(costs, budget_bytes, minimize_memory=minimize_memory)
    least_peak = (
        floors if minimize_memory else StageFloors(costs, budget_bytes, minimize_memory=True)
    )
    pp, v = configuration.mesh.pp, configuration.schedule.virtual_stages
    if (
        not minimize_memory
        and v > 1
        and floors.least_of_ranks(pp, v) * (1 - ROUNDING) > time_bound_s * (1 + ROUNDING)
    ):  # the stage cut bounds each stage's time; a rank's, the sum of its v stages', only this does
        return None

    budgets = [budget_bytes] * configuration.stage_count
    """What each stage's own peak may reach: the budget, less what the other stages of its rank need
    of it where a rank runs several ([Note: a rank's stages share its budget])."""

    def solver(stage: int, allowed: float, least: bool) -> ChainSolver:
        """The DP of stage `stage`'s units within `allowed` bytes: the fastest, or the least peak."""
        ctx = contexts[stage]
        key = (ctx.in_flight, allowed, least)
        if key not in solvers:
            solvers[key] = ChainSolver(
                blocks,
                rules,
                ctx,
                allowed,
                space,
                minimize_memory=least,
                time_bound_s=math.inf if least else time_bound_s,
                only_end=len(blocks) if configuration.mesh.pp == 1 else None,
                costs=costs,
            )
        return solvers[key]

    def stage_cost(stage: int, start: int, end: int) -> tuple[ChainSolution, float] | None:
        ctx = contexts[stage]
        tied = tied_terms(blocks, start, end, setting, configuration, hardware)
        allowed = budgets[stage] - tied.copy_bytes  # the copies a stage holds leave its units less
        if least_peak.least(start, end) > allowed:  # no plan of the span fits: no DP
            return None
        solution = solver(stage, allowed, minimize_memory).solve(start, end)
        if solution is None:
            return None
        if minimize_memory:
            return solution, float(solution.peak_bytes + tied.copy_bytes)
        return solution, solution.time_s + ctx.pipeline_factor * (
            times_s[start] + times_s[end]
        ) + tied.sync_s

    def tighten(cuts: tuple[StageCut, ...], over_bytes: list[float]) -> None:
        """Lower the budgets of the stages of each rank `over_bytes` over the budget ([Note: a rank's
        stages share its budget])."""
        for rank, over in enumerate(over_bytes):
            if over <= 0:
                continue
            own, rooms = {}, {}
            for index in range(rank, len(cuts), pp):
                cut = cuts[index]
                own[index] = (
                    cut.solution.peak_bytes
                    + tied_terms(
                        blocks, cut.start, cut.end, setting, configuration, hardware
                    ).copy_bytes
                )
                least = solver(index, math.inf, True).solve(cut.start, cut.end)
                assert least is not None, "without a budget every span has a plan"
                rooms[index] = cut.solution.peak_bytes - least.peak_bytes
            total = sum(rooms.values())
            for index, room in rooms.items():
                shrink = min(room, -(-over * room // total)) if total else 1  # 1: past the least
                budgets[index] = min(budgets[index], own[index] - shrink)

    while True:
        cuts = cut_stages(
            rules,
            configuration.stage_count,
            stage_cost,
            floors.least,
            budget_bytes if minimize_memory else time_bound_s,
        )
        if cuts is None:
            return None
        if configuration.schedule.name not in cost.ORDERED_SCHEDULES:
            step_time_s = max(c.time_s for c in cuts)
            peak = max(
                c.solution.peak_bytes
                + tied_terms(blocks, c.start, c.end, setting, configuration, hardware).copy_bytes
                for c in cuts
            )
            break
        # a rank may run several of the stages, and hold what its order holds: its time is theirs
        # summed, its peak its order's ([Note: virtual stages and the zero-bubble schedule])
        ranks = cost.pipeline_ranks(
            [
                walk_stage(
                    blocks,
                    index,
                    cut.start,
                    cut.end,
                    tuple(b - cut.start for b in cut.solution.bounds),
                    cut.solution.decisions,
                    setting,
                    configuration,
                    hardware,
                    times_s,
                )
                for index, cut in enumerate(cuts)
            ]
        )
        peak = max(rank.peak_bytes for rank in ranks)
        step_time_s = max(rank.step_time_s for rank in ranks)
        if step_time_s > time_bound_s * (1 + ROUNDING):
            return None
        if peak <= budget_bytes:
            break
        if minimize_memory:  # its stages are at their least peaks already
            return None
        tighten(cuts, [rank.peak_bytes - budget_bytes for rank in ranks])
    return Candidate(
        configuration=configuration, stages=cuts, step_time_s=step_time_s, peak_bytes=peak
    )


def walk_stage(
    blocks: Sequence[Block],
    index: int,
    start: int,
    end: int,
    bounds: tuple[int, ...],
    decisions: tuple[Decision, ...],
    setting: Setting,
    configuration: Configuration,
    hardware: HardwareModel,
    times_s: Sequence[float] | None = None,
) -> cost.StepCost:
    """Stage `index` (blocks start..end, units starting at `bounds` within it) walked event by event.
    `times_s`: the configuration's boundary_times_s where the caller has them (pricing every cut for
    one stage's two was most of a search's walks)."""
    return evaluate_stage(
        tuple(blocks[start:end]),
        bounds,
        decisions,
        context(setting, configuration, hardware, index),
        boundary_s=(
            boundary_time_s(blocks, start, end, setting, configuration, hardware)
            if times_s is None
            else times_s[start] + times_s[end]
        ),
        tied=tied_terms(blocks, start, end, setting, configuration, hardware),
    )


def samples_per_step(setting: Setting, configuration: Configuration) -> float:
    """Samples one step of `configuration` trains: a replica's batch times the replicas."""
    return setting.replica_batch(configuration.mesh.dp) * configuration.mesh.dp


def time_per_sample_s(candidate: Candidate, setting: Setting) -> float:
    return candidate.step_time_s / samples_per_step(setting, candidate.configuration)


def complexity(candidate: Candidate) -> tuple[bool, int]:
    """What makes a plan harder to run and reason about: a pipeline, then how many distinct unit settings it
    mixes. Lower is simpler."""
    decisions = {d for cut in candidate.stages for d in cut.solution.decisions}
    return candidate.configuration.mesh.pp > 1, len(decisions)


def simplest_near_the_fastest(
    candidates: list[Candidate], setting: Setting, near_tie: float
) -> list[Candidate]:
    """`candidates` (fastest first) with the simplest one at most `near_tie` slower a sample than the fastest
    moved to the front ([Note: near ties])."""
    fastest = time_per_sample_s(candidates[0], setting)
    near = [c for c in candidates if time_per_sample_s(c, setting) <= fastest * (1 + near_tie)]
    chosen = min(near, key=lambda c: (complexity(c), time_per_sample_s(c, setting)))
    return [chosen] + [c for c in candidates if c is not chosen]


def search(
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hardware: HardwareModel,
    budget_bytes: float,
    space: SearchSpace,
    *,
    time_bound_s: float = math.inf,
    memo: SearchMemo | None = None,
    runner_ups: bool = True,
    only: Callable[[Configuration], bool] | None = None,
) -> list[Candidate]:
    """The best plan of every configuration within RUNNER_UP_SLACK of the fastest, fastest first
    (ties: smaller peak, then configuration order). Fastest per sample: meshes with fewer replicas
    (tp, pp) train fewer samples a step unless a global batch is given, when every step trains the same.
    `runner_ups=False`: only the plans as fast as the fastest (the same first), so that each plan
    found bounds the rest by its own time, not RUNNER_UP_SLACK above it (for callers that take [0]).

    Configurations are solved in the order of their simplest plan's time, so that the first
    exact answers bound (and prune) the rest; the bound never cuts a plan that could win.
    Plans slower than `time_bound_s` per sample are not looked for. `memo`: what searches of the
    same blocks, rules and space share (see SearchMemo; those of other tp options included).

    Pipelines over fewer micro-batches than stages are searched only when no other configuration
    has a plan (starved_pipeline): the memory's last resort. `only`: the configurations searched
    (every one where None)."""
    everything = [c for c in configurations(setting, len(blocks)) if only is None or only(c)]
    for starved in (False, True):
        found = _search_among(
            [c for c in everything if starved_pipeline(c) == starved],
            blocks,
            rules,
            setting,
            hardware,
            budget_bytes,
            space,
            time_bound_s=time_bound_s,
            memo=memo or SearchMemo(),
            slack=RUNNER_UP_SLACK if runner_ups else 1.0,
        )
        if found:
            return found
    return []


def starved_pipeline(configuration: Configuration) -> bool:
    """A pipeline over fewer micro-batches than stages: each stage idles (pp - 1) / (m + pp - 1) of its step,
    half or more, where m = pp micro-batches of the same batch hold the first stage's activations no larger
    (it keeps all of them either way) and idle less. Where a replica's batch does not split so (one sequence)
    it is what makes a model fit at all, and its stages' fixed costs are fewer; the search takes these
    configurations only when nothing else fits, which keeps a solve in seconds (70B shapes at world 1024
    would try four times the configurations) at the price of those fixed costs on a CPU (the zoo's
    encoder-decoder at world 2 plans 23% faster over one micro-batch than over two, within its budget)."""
    return (
        configuration.mesh.pp > 1
        and configuration.schedule.num_micro_batches < configuration.mesh.pp
    )


def _search_among(
    everything: list[Configuration],
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hardware: HardwareModel,
    budget_bytes: float,
    space: SearchSpace,
    *,
    time_bound_s: float,
    memo: SearchMemo,
    slack: float,
) -> list[Candidate]:
    """search over `everything`, keeping the plans within `slack` of the fastest."""
    samples = [samples_per_step(setting, c) for c in everything]
    known = memo.guesses
    if time_bound_s == math.inf:
        for c in everything:
            if c not in known:
                known[c] = uniform_plan_time_s(
                    blocks,
                    rules,
                    setting,
                    c,
                    hardware,
                    budget_bytes,
                    space,
                    costs=memo.costs(blocks, rules, setting, c, hardware, space),
                    times_s=memo.boundary_times_s(blocks, setting, c, hardware),
                )
    guess_s = (
        [known[c] / n for c, n in zip(everything, samples)]
        if time_bound_s == math.inf
        else [math.inf] * len(everything)
    )  # a given bound is tight enough
    found, bound = (
        [],
        min(min(guess_s, default=math.inf), time_bound_s),
    )  # a simple plan reaches it: exact
    for order in sorted(range(len(everything)), key=lambda i: (guess_s[i], i)):
        configuration = everything[order]
        candidate = solve_configuration(
            blocks,
            rules,
            setting,
            configuration,
            hardware,
            budget_bytes,
            space,
            time_bound_s=bound * samples[order],
            costs=memo.costs(blocks, rules, setting, configuration, hardware, space),
            times_s=memo.boundary_times_s(blocks, setting, configuration, hardware),
        )
        if candidate is not None:
            per_sample = candidate.step_time_s / samples[order]
            found.append((per_sample, candidate.peak_bytes, order, candidate))
            bound = min(bound, per_sample * slack)
    # The same list whatever the solving order; with ROUNDING's slack, so that a winner equal to a
    # guess (the guess walked by evaluate_stage, the winner summed by the DP) is not lost to the last bit.
    found = [item for item in found if item[0] <= bound * (1 + ROUNDING)]
    return [c for *_, c in sorted(found, key=lambda item: item[:3])]


def uniform_plan_time_s(
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    configuration: Configuration,
    hardware: HardwareModel,
    budget_bytes: float,
    space: SearchSpace,
    costs: UnitCosts,
    times_s: Sequence[float],
) -> float:
    """Step time of the fastest simple plan of this configuration that fits: stages cut evenly by
    compute, every block its own unit, one decision per stage; inf when none fits. `costs`, `times_s`:
    the configuration's UnitCosts and boundary_times_s (SearchMemo). Under a schedule priced by its
    order of operations (cost.ORDERED_SCHEDULES), inf: a rank holds more than its stages' walks (the
    zero-bubble schedule its deferred weight gradients' inputs, virtual stages each other's
    activations), so its stages taking each its own fastest decision need not fit, and a guess must
    be a plan's time that fits."""
    n, pp = len(blocks), configuration.mesh.pp
    if (
        not all(rule.may_start_unit for rule in rules)
        or any(r.must_start_stage for r in rules[1:])
        or configuration.schedule.name in cost.ORDERED_SCHEDULES
    ):
        return math.inf
    prefix = list(itertools.accumulate((b.fwd_flops + b.bwd_flops for b in blocks), initial=0))
    edges = [0]
    for stage in range(
        1, pp
    ):  # first block past an even share of the work, one block at least per stage
        at = bisect.bisect_left(prefix, prefix[-1] * stage / pp)
        edges.append(min(max(at, edges[-1] + 1), n - (pp - stage)))
    edges.append(n)
    if any(not rules[e].may_start_stage for e in edges[1:-1]):
        return math.inf
    worst = 0.0
    for stage, (start, end) in enumerate(zip(edges, edges[1:])):
        ctx = context(setting, configuration, hardware, stage)
        boundary_s = times_s[start] + times_s[end]
        # Walking the stage is what costs: decisions whose units' own times already lose to the
        # fastest so far, or whose end of forward (Σ base + held bytes) is over budget, are not.
        options = []
        for decision in costs.decisions(start, end):
            units = [costs(j, j + 1, decision) for j in range(start, end)]
            if sum(cost.end_of_forward_bytes(u, ctx) for u in units) <= budget_bytes:
                options.append((sum(cost.own_time_s(u, ctx) for u in units), decision))
        fastest = math.inf  # each stage takes its own fastest fitting decision
        for least_s, decision in sorted(options, key=lambda option: option[0]):
            if least_s * (1 - ROUNDING) > fastest:
                break
            step = evaluate_stage(
                tuple(blocks[start:end]),
                tuple(range(end - start)),
                (decision,) * (end - start),
                ctx,
                boundary_s=boundary_s,
                tied=tied_terms(blocks, start, end, setting, configuration, hardware),
                units=[costs(j, j + 1, decision) for j in range(start, end)],
            )
            if step.peak_bytes <= budget_bytes:
                fastest = min(fastest, step.step_time_s)
        worst = max(worst, fastest)
    return worst


def smallest_peak(
    blocks: Sequence[Block],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hardware: HardwareModel,
    space: SearchSpace,
    budget_bytes: float = math.inf,
    memo: SearchMemo | None = None,
) -> int | None:
    """The least peak memory per rank any configuration reaches (the budget that would just fit),
    or None when none reaches `budget_bytes`. Deepest pipelines first: they usually need the
    least, and each answer bounds (prunes) the next search exactly. `memo`: as search's (only its
    budget-free parts are read)."""
    best, memo = None, memo or SearchMemo()
    for configuration in reversed(configurations(setting, len(blocks))):
        bound = budget_bytes if best is None else best
        candidate = solve_configuration(
            blocks,
            rules,
            setting,
            configuration,
            hardware,
            bound,
            space,
            minimize_memory=True,
            costs=memo.costs(blocks, rules, setting, configuration, hardware, space),
            times_s=memo.boundary_times_s(blocks, setting, configuration, hardware),
        )
        if candidate is not None and (best is None or candidate.peak_bytes < best):
            best = candidate.peak_bytes
    return best
