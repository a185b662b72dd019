"""`compile`: model → Plan; `solve`: BlockChain → Plan (no torch: re-planning from a cached chain is fast).

`compile` captures and analyzes the model (shardplan.frontend.passes.analyze) and hands the
chain to `solve`, which searches meshes, micro-batches and schedules (solver/search.py),
cuts stages and chooses units exactly (solver/stages.py, solver/chain_dp.py), and
writes the decisions, the predicted terms and the reasoning into a Plan.
"""

import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, cast

from shardplan.common.dtypes import dtype_name
from shardplan.common.sizes import format_bytes, parse_bytes
from shardplan.costmodel import cost
from shardplan.costmodel.cost import evaluate_stage
from shardplan.costmodel.hardware import HardwareModel, HardwareProfile, get_hardware
from shardplan.errors import EMPTY_BATCH, InfeasibleError, PlanError, ShardplanError
from shardplan.frontend.chain import Block, BlockChain, InputSpec
from shardplan.plan import (
    MAX_WORLD_SIZE,
    Alternative,
    Checkpoint,
    Decision,
    KeptWhole,
    Mesh,
    MixedPrecision,
    Plan,
    Predicted,
    Reasoning,
    Schedule,
    ShardedModule,
    Stage,
    TensorParallel,
    Unit,
)
from shardplan.solver.chain_dp import ROUNDING
from shardplan.solver.search import (
    Candidate,
    Configuration,
    SearchMemo,
    Setting,
    boundary_time_s,
    configurations,
    context,
    samples_per_step,
    search,
    smallest_peak,
    tensor_parallel_options,
    tied_terms,
)
from shardplan.solver.space import (
    BlockRule,
    Constraints,
    SearchSpace,
    constraint_patterns,
    resolve_rules,
)

if TYPE_CHECKING:
    from torch import nn

RUNNER_UPS = 4
"""Other configurations listed in Plan.reasoning, besides the expert defaults."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """What `compile` and `solve` are asked for besides the model and the world size (their keywords)."""

    hardware: str | os.PathLike | HardwareProfile = "h100-80g"
    """A built-in profile's name, a profile file, or a profile."""
    memory_budget: int | str | None = None
    """Bytes per rank, or a size such as "40GiB"; None: the profile's usable memory."""
    mixed_precision: MixedPrecision | None = None
    """None: compute and reduce in the parameters' dtype."""
    optimizer: str = "adamw"
    allow_pipeline: bool = True
    """Search pipeline stages (pp > 1) with their micro-batch counts and schedules; without, plan data
    parallelism alone, and say in the InfeasibleError when a pipeline would fit."""
    allow_offload: bool = False
    constraints: Constraints | None = None
    space: SearchSpace | None = None
    max_unit_blocks: int | None = None
    """The most blocks one unit holds; None: the space's (default_space's: 4 on short chains, 1 past 16 blocks)."""
    max_tensor_parallel: int | None = None
    """The largest tp searched (among degrees dividing the world at which the chain's layout slices
    something); None: a node's devices where the device overlaps communication with compute (GPUs),
    1 on CPU ranks (gloo), where the tp ranks' exchanges take the cores the compute needs."""
    allow_replica_groups: bool = True
    """Search HSDP (dp_replicate > 1) where each replica group's dp_shard × tp ranks fill whole nodes."""
    global_batch_size: int | None = None
    """Samples per step over all replicas, split evenly over dp (meshes whose dp does not divide it are
    not searched); None: every replica takes the chain's batch."""
    explain: bool = True
    """Write the reasoning: the binding constraint (a second search without the budget) and the
    runner-ups (the best plan of every other tp degree). Those searches are most of a solve's time;
    a re-plan in a loop (a budget sweep, a CI gate) that wants only the plan passes False."""

    @classmethod
    def of(cls, keywords: dict[str, Any]) -> "PlanOptions":
        """The options `compile` / `solve` were called with; a keyword that is no field is refused in one line."""
        known = [field.name for field in dataclasses.fields(cls)]
        unknown = [name for name in keywords if name not in known]
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise ShardplanError(
                f"unknown option {unknown[0]!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f": the options are {', '.join(known)}"
            )
        return cls(**keywords)


P = ParamSpec("P")


class _Compile(Protocol[P]):
    """`compile`'s signature with PlanOptions' fields as its keywords, for the type checker."""

    def __call__(
        self,
        model: "nn.Module",
        world_size: int,
        example_inputs: tuple = (),
        example_kwargs: dict | None = None,
        *args: P.args,
        **options: P.kwargs,
    ) -> Plan: ...


class _Solve(Protocol[P]):
    """`solve`'s signature with PlanOptions' fields as its keywords, for the type checker."""

    def __call__(
        self,
        chain: BlockChain,
        world_size: int,
        model_name: str = "",
        *args: P.args,
        **options: P.kwargs,
    ) -> Plan: ...


def _compile_keywords(
    options: Callable[P, PlanOptions],
) -> Callable[[Callable[..., Plan]], _Compile[P]]:
    return lambda function: cast(_Compile[P], function)


def _solve_keywords(
    options: Callable[P, PlanOptions],
) -> Callable[[Callable[..., Plan]], _Solve[P]]:
    return lambda function: cast(_Solve[P], function)


@_compile_keywords(
    PlanOptions
)  # the keywords are PlanOptions' fields: a misspelt one is a type error
def compile(
    model: "nn.Module",
    world_size: int,
    example_inputs: tuple = (),
    example_kwargs: dict | None = None,
    **options: Any,
) -> Plan:
    """The fastest plan for training `model` on `world_size` ranks within the memory budget;
    `options` are PlanOptions' fields.

    >>> from shardplan.models import zoo
    >>> entry = zoo.gpt()
    >>> plan = compile(entry.model, 8, entry.args, entry.kwargs, hardware="cpu-gloo")  # doctest: +SKIP
    >>> plan.mesh.dp * plan.mesh.pp
    8
    """
    from shardplan.frontend.passes import analyze, fingerprint_of

    _check_world_size(
        world_size
    )  # before the capture: a bad count or keyword is refused in moments
    PlanOptions.of(options)
    precision = options.get("mixed_precision")
    chain = analyze(
        model,
        tuple(example_inputs),
        dict(example_kwargs or {}),
        compute_dtype=precision.param_dtype if isinstance(precision, MixedPrecision) else None,
    )
    plan = _with_unread_parameters(
        solve(chain, world_size, model_name=type(model).__name__, **options), model
    )
    if (
        plan.inputs != chain.inputs
    ):  # a global batch split over the mesh's replicas: the graph of their shapes
        plan = replace(plan, fingerprint=fingerprint_of(model, plan.inputs))
    return plan


def _with_unread_parameters(plan: Plan, model: "nn.Module") -> Plan:
    """`plan` with the parameters the forward never reads (a bias a tie replaced, a table no input
    selects) in its last unit, with a warning: the blocks hold only what the graph reads, and every
    parameter must be in a unit for the runtime to hold, save and load it. They get no gradient."""
    covered = {id(model.get_parameter(name)) for unit in plan.units for name in unit.params}
    unread = tuple(
        name for name, parameter in model.named_parameters() if id(parameter) not in covered
    )
    if not unread:
        return plan
    warnings.warn(
        f"{len(unread)} parameters are never read by the forward (first: {list(unread[:3])}): they stay "
        f"in unit {plan.units[-1].name!r} and get no gradient; delete them from the model to save their "
        "memory",
        stacklevel=3,
    )
    last = replace(plan.units[-1], params=plan.units[-1].params + unread)
    return replace(plan, units=plan.units[:-1] + (last,))


@_solve_keywords(PlanOptions)
def solve(chain: BlockChain, world_size: int, model_name: str = "", **options: Any) -> Plan:
    """The plan for an analyzed chain: plain data in, Plan out (no capture, no torch); `options` are
    PlanOptions' fields."""
    _check_world_size(world_size)
    asked = PlanOptions.of(options)
    if not chain.blocks:
        raise ShardplanError("the model has no blocks to plan: does its forward do anything?")
    hw = get_hardware(asked.hardware)
    budget = (
        hw.usable_memory_bytes if asked.memory_budget is None else parse_bytes(asked.memory_budget)
    )
    precision = asked.mixed_precision or MixedPrecision(
        param_dtype=chain.computes_in, reduce_dtype=dtype_name(chain.param_dtype)
    )
    check_computes_in(chain, precision)
    space = replace(
        asked.space or default_space(len(chain.blocks)), allow_offload=asked.allow_offload
    )
    if asked.max_unit_blocks is not None:
        if asked.max_unit_blocks < 1:
            raise ShardplanError(
                f"max_unit_blocks={asked.max_unit_blocks} leaves units no blocks: give 1 or more"
            )
        space = replace(space, max_unit_blocks=asked.max_unit_blocks)
    if asked.global_batch_size is not None and asked.global_batch_size < 1:
        raise ShardplanError(
            f"global_batch_size={asked.global_batch_size} trains no samples: give 1 or more"
        )
    max_tp = asked.max_tensor_parallel
    if max_tp is None:
        max_tp = hw.devices_per_node if hw.overlaps_communication else 1
    if max_tp < 1:
        raise ShardplanError(
            f"max_tensor_parallel={max_tp} leaves no tensor-parallel degree to search: give 1 or "
            "more (1: no tensor parallelism)"
        )
    if max_tp > hw.devices_per_node:
        raise ShardplanError(
            f"max_tensor_parallel={max_tp} would put tp groups across nodes of "
            f"{hw.devices_per_node} devices ({hw.name}): use at most {hw.devices_per_node}"
        )
    setting = Setting(
        world_size=world_size,
        batch_size=_batch_size(chain),
        mixed_precision=precision,
        optimizer=asked.optimizer,
        allow_pipeline=asked.allow_pipeline,
        skip_edges=chain.skip_edges,
        tied_edges=chain.tied_edges,
        global_batch_size=asked.global_batch_size,
        tensor_parallel=tensor_parallel_options(chain.blocks, world_size, max_tp),
        replica_group_ranks=hw.devices_per_node if asked.allow_replica_groups else 0,
    )
    rules = _rules(chain, asked.constraints)
    memo = SearchMemo()  # the searches below try the same configurations
    candidates = search(chain.blocks, rules, setting, hw, budget, space, memo=memo)
    if not candidates:
        raise InfeasibleError(
            _constraints_blamed(chain, asked.constraints, setting, hw, budget, space)
            or _infeasible_message(chain, rules, setting, hw, budget, space)
        )
    best = candidates[0]
    units, stages = _units_and_stages(chain, best)
    return Plan(
        fingerprint=chain.fingerprint,
        signature=chain.signature,
        model=model_name or str(chain.extra.get("model", "")),
        world_size=world_size,
        hardware=hw.name,
        inputs=replica_inputs(chain, int(setting.replica_batch(best.configuration.mesh.dp))),
        mesh=best.configuration.mesh,
        schedule=best.configuration.schedule,
        tensor_parallel=tensor_parallel_section(chain, best.configuration),
        mixed_precision=precision,
        optimizer=asked.optimizer,
        units=units,
        stages=stages,
        predicted=predict(chain, best, setting, hw),
        reasoning=(
            _reasoning(chain, best, candidates, rules, setting, hw, budget, space, memo)
            if asked.explain
            else Reasoning(budget_bytes=budget, binding_constraint="not computed (explain=False)")
        ),
    )


def replica_inputs(chain: BlockChain, replica_batch: int) -> tuple[InputSpec, ...]:
    """The chain's example inputs with one replica's batch along dim 0 (the example's own without a
    global batch). A plan `solve` makes from the chain alone keeps the chain's fingerprint, which
    then names the example's shapes: `compile` fingerprints the replica's."""
    batch = _batch_size(chain)
    return tuple(
        replace(spec, shape=(replica_batch, *spec.shape[1:]))
        if spec.shape and spec.shape[0] == batch
        else spec
        for spec in chain.inputs
    )


def _check_world_size(world_size: object) -> None:
    if (
        not isinstance(world_size, int)
        or isinstance(world_size, bool)
        or not 1 <= world_size <= MAX_WORLD_SIZE
    ):
        raise ShardplanError(
            f"world_size must be a whole number of ranks from 1 to {MAX_WORLD_SIZE}, "
            f"got {world_size!r}: give the number of ranks you launch"
        )


def default_space(n_blocks: int) -> SearchSpace:
    """Units of up to 4 blocks on short chains; of single blocks past 16 blocks, where one
    block (a transformer layer) is already large enough to hide its gather and the DP's
    time grows with the square of the unit length. Prefetch is always on: turning it off
    only saves one unit's gathered parameters."""
    return SearchSpace(max_unit_blocks=4 if n_blocks <= 16 else 1, prefetch=(True,))


def _rules(chain: BlockChain, constraints: Constraints | None) -> tuple[BlockRule, ...]:
    return _split_at_frozen(chain, resolve_rules(chain.blocks, constraints, chain.module_classes))


def _split_at_frozen(chain: BlockChain, rules: tuple[BlockRule, ...]) -> tuple[BlockRule, ...]:
    """Start a unit wherever the blocks switch between frozen (requires_grad=False) and trainable
    parameters: a unit is one flat buffer with one requires_grad (runtime/sharded.py). A block without
    parameters joins either kind."""
    frozen = set(chain.frozen_params)
    if not frozen:
        return rules
    split, previous = [], None
    for block, rule in zip(chain.blocks, rules):
        kinds = {name in frozen for name in block.param_names}
        if len(kinds) > 1:
            raise ShardplanError(
                f"block {block.name!r} holds frozen parameters "
                f"({', '.join(n for n in block.param_names if n in frozen)[:200]}) beside trainable ones: a unit "
                "trains all its parameters or none; set requires_grad alike for the whole block"
            )
        kind = kinds.pop() if kinds else previous
        if previous is not None and kind != previous:
            if not rule.may_start_unit:
                raise ShardplanError(
                    f"a constraint forbids a unit boundary at block {block.name!r}, where the "
                    f"parameters turn {'frozen' if kind else 'trainable'}: a unit trains all its "
                    "parameters or none; remove that no_unit_boundary pattern"
                )
            rule = replace(rule, must_start_unit=True)
        split.append(rule)
        previous = kind
    return tuple(split)


def _batch_size(chain: BlockChain) -> int:
    return chain.inputs[0].shape[0] if chain.inputs and chain.inputs[0].shape else 1


def stage_costs(
    chain: BlockChain, candidate: Candidate, setting: Setting, hw: HardwareModel
) -> list[cost.StepCost]:
    """Every stage's StepCost, walked event by event (cost.evaluate_stage)."""
    return [
        _stage_cost(
            chain,
            index,
            cut.start,
            cut.end,
            tuple(b - cut.start for b in cut.solution.bounds),
            cut.solution.decisions,
            setting,
            candidate.configuration,
            hw,
        )
        for index, cut in enumerate(candidate.stages)
    ]


def _stage_cost(
    chain: BlockChain,
    index: int,
    start: int,
    end: int,
    bounds: tuple[int, ...],
    decisions: tuple[Decision, ...],
    setting: Setting,
    configuration: Configuration,
    hw: HardwareModel,
) -> cost.StepCost:
    """Stage `index` (blocks start..end, units starting at `bounds` within it) walked event by event."""
    return evaluate_stage(
        chain.blocks[start:end],
        bounds,
        decisions,
        context(setting, configuration, hw, index),
        boundary_s=boundary_time_s(chain.blocks, start, end, setting, configuration, hw),
        tied=tied_terms(chain.blocks, start, end, setting, configuration, hw),
    )


def predict(
    chain: BlockChain, candidate: Candidate, setting: Setting, hw: HardwareModel
) -> Predicted:
    """The peak stage's memory terms and the slowest stage's time terms."""
    costs = stage_costs(chain, candidate, setting, hw)
    names = [unit.name for unit in _units_and_stages(chain, candidate)[0]]
    return _predicted(chain, costs, names, candidate.configuration.mesh, setting, hw)


def evaluate(
    chain: BlockChain,
    plan: Plan,
    hardware: str | os.PathLike | HardwareProfile | None = None,
    *,
    runtime: cost.Runtime | None = None,
) -> Predicted:
    """What the cost model predicts for `plan`'s own decisions on `chain`, a plan written by hand
    (runtime.manual_plan) included: how predictions are checked against measurement. `runtime`: the
    kernels another runtime runs around its collectives, priced in place of shardplan's runtime's
    (cost.CostContext.runtime)."""
    return evaluate_stages(chain, plan, hardware, runtime=runtime)[0]


def evaluate_stages(
    chain: BlockChain,
    plan: Plan,
    hardware: str | os.PathLike | HardwareProfile | None = None,
    *,
    runtime: cost.Runtime | None = None,
) -> tuple[Predicted, tuple[cost.StepCost, ...]]:
    """evaluate's prediction and each pipeline stage's own cost, in stage order: a runtime that holds more than
    the plan on some stages (another framework's state) may have its peak on a stage that is not the plan's."""
    hw = get_hardware(hardware or plan.hardware)
    check_computes_in(chain, plan.mixed_precision)
    _check_tensor_parallel(chain, plan)
    chain = _sliced_as_planned(chain, plan)
    unit_of = {param: index for index, unit in enumerate(plan.units) for param in unit.params}
    owners: list[int] = []
    for block in chain.blocks:
        owned = [unit_of[p] for p in block.param_names if p in unit_of]
        if len(set(owned)) > 1 or (not owned and not owners):
            raise PlanError(
                f"block {block.name!r} is not inside one unit of the plan: units must be runs of "
                "whole blocks (see shardplan.frontend.passes.analyze) for the cost model to price them"
            )
        owners.append(owned[0] if owned else owners[-1])
    if owners != sorted(owners):
        raise PlanError(
            "the plan's units do not follow the model's execution order: list them in that order"
        )
    stage_of_unit = plan.stage_of_unit
    setting = Setting(
        world_size=plan.world_size,
        batch_size=_batch_size(chain),
        mixed_precision=plan.mixed_precision,
        optimizer=plan.optimizer,
        skip_edges=chain.skip_edges,
        tied_edges=chain.tied_edges,
        global_batch_size=plan.mesh.dp * plan.batch_per_replica if plan.inputs else None,
        runtime=runtime,
    )
    configuration = Configuration(
        mesh=plan.mesh,
        schedule=plan.schedule,
        sequence_parallel=plan.tensor_parallel.sequence_parallel,
    )
    steps, names = [], []
    for stage in range(plan.mesh.pp):
        blocks = [
            i for i, owner in enumerate(owners) if stage_of_unit[plan.units[owner].name] == stage
        ]
        start, end = blocks[0], blocks[-1] + 1
        unit_starts = [i for i in blocks if i == start or owners[i] != owners[i - 1]]
        decisions = tuple(plan.units[owners[i]] for i in unit_starts)  # a Unit is its Decision
        names += [unit.name for unit in decisions]
        steps.append(
            _stage_cost(
                chain,
                stage,
                start,
                end,
                tuple(i - start for i in unit_starts),
                decisions,
                setting,
                configuration,
                hw,
            )
        )
    return _predicted(chain, steps, names, plan.mesh, setting, hw), tuple(steps)


def check_computes_in(chain: BlockChain, precision: MixedPrecision) -> None:
    """The chain's activations are priced in the dtype the plan computes in: a chain analyzed in another
    dtype would price every activation byte at that dtype's size (twice bf16's in float32)."""
    if chain.computes_in != precision.param_dtype:
        raise PlanError(
            f"the model was analyzed computing in {chain.computes_in}, and the plan computes in "
            f"{precision.param_dtype} (mixed precision's param_dtype): analyze it with "
            f"analyze(model, ..., compute_dtype={precision.param_dtype!r}) (compile does so itself)"
        )


def _check_tensor_parallel(chain: BlockChain, plan: Plan) -> None:
    """A plan may slice a block's modules over tp only where the block's sizes divide by tp."""
    tp, named = plan.mesh.tp, {m.path for m in plan.tensor_parallel.sharded}
    for block in chain.blocks:
        facts = block.tensor_parallel
        refusal = facts.refusal(tp) if facts is not None else None
        if refusal and named.intersection(path for path, _ in facts.sharded):  # type: ignore[union-attr]
            raise PlanError(
                f"the plan slices {block.name!r} over tp={tp}, but {refusal}: choose such a tp, or "
                "list its modules as kept whole"
            )


def _predicted(
    chain: BlockChain,
    costs: list[cost.StepCost],
    unit_names: list[str],
    mesh: Mesh,
    setting: Setting,
    hw: HardwareModel,
) -> Predicted:
    peak = max(costs, key=lambda c: c.peak_bytes)
    slowest = max(costs, key=lambda c: c.step_time_s)
    samples = setting.replica_batch(mesh.dp) * mesh.dp
    samples_per_s = samples / slowest.step_time_s if slowest.step_time_s else 0.0
    # Peak FLOP/s is read from the profile's matmul table where it has one (MFU is for people only). The FLOPs
    # keep a causal mask's masked ones, which a profile may not time: the convention is Predicted.mfu's.
    matmul = getattr(hw, "matmul", {}).get(setting.mixed_precision.param_dtype)
    peak_flops = getattr(matmul, "peak_flops_per_s", 0.0)
    model_flops = (chain.fwd_flops + chain.bwd_flops) * samples / setting.batch_size
    mfu = (
        model_flops / (slowest.step_time_s * setting.world_size * peak_flops)
        if peak_flops and slowest.step_time_s
        else 0.0
    )
    return Predicted(
        peak_bytes=peak.peak_bytes,
        step_time_s=slowest.step_time_s,
        memory_bytes=dict(peak.memory_bytes),
        time_s=dict(slowest.time_s),
        samples_per_s=samples_per_s,
        mfu=mfu,
        units=tuple(
            replace(unit, unit=name)
            for name, unit in zip(unit_names, (u for c in costs for u in c.units), strict=True)
        ),
    )


def tensor_parallel_section(chain: BlockChain, configuration: Configuration) -> TensorParallel:
    """What the plan's tp ranks slice (TensorParallelFacts.sharded of each block that slices at tp),
    and the blocks that could slice and stay whole, with the reason."""
    tp = configuration.mesh.tp
    facts = [(b, b.tensor_parallel) for b in chain.blocks if b.tensor_parallel is not None]
    if tp == 1:
        return TensorParallel()
    sharded = tuple(
        ShardedModule(path=path, style=style)
        for _, f in facts
        if f.slices_at(tp)
        for path, style in f.sharded
    )
    return TensorParallel(
        sequence_parallel=configuration.sequence_parallel,
        vocab_parallel=any(m.style.startswith("vocab") for m in sharded),
        sharded=sharded,
        kept_whole=tuple(
            KeptWhole(module=b.name, reason=str(f.refusal(tp)))
            for b, f in facts
            if not f.slices_at(tp)
        ),
    )


def _sliced_as_planned(chain: BlockChain, plan: Plan) -> BlockChain:
    """`chain` with tensor-parallel facts on the blocks whose modules the plan slices only: a block it
    keeps whole (an embedding of a plan without vocab_parallel) is priced whole."""
    named = {m.path for m in plan.tensor_parallel.sharded}
    return replace(
        chain,
        blocks=tuple(
            b
            if b.tensor_parallel is None
            or named.intersection(path for path, _ in b.tensor_parallel.sharded)
            else replace(b, tensor_parallel=None)
            for b in chain.blocks
        ),
    )


def _unit_name(blocks: Sequence[Block]) -> str:
    first, last = blocks[0].name or "<root>", blocks[-1].name or "<root>"
    return first if len(blocks) == 1 else f"{first}..{last}"


def _units_and_stages(
    chain: BlockChain, candidate: Candidate
) -> tuple[tuple[Unit, ...], tuple[Stage, ...]]:
    units, stages, taken = [], [], set()
    for index, cut in enumerate(candidate.stages):
        names = []
        ends = cut.solution.bounds[1:] + (cut.end,)
        for start, end, decision in zip(cut.solution.bounds, ends, cut.solution.decisions):
            blocks = chain.blocks[start:end]
            name = _unit_name(blocks)
            if name in taken:  # blocks of the model's root share the name "<root>"
                name = f"{name}#{start}"
            taken.add(name)
            names.append(name)
            modules = tuple(m for b in blocks for m in (b.modules or (b.name,)))
            units.append(
                Unit(
                    name=name,
                    modules=modules,
                    params=tuple(p for b in blocks for p in b.param_names),
                    **dataclasses.asdict(decision),
                )
            )
        stages.append(Stage(index=index, units=tuple(names)))
    return tuple(units), tuple(stages)


def expert_defaults(
    chain: BlockChain, setting: Setting, hw: HardwareModel
) -> list[tuple[str, cost.StepCost]]:
    """What a person would write by hand: every block its own FULL_SHARD unit, dp = world,
    without and with full checkpointing (the baselines the solver must never lose to); none where a
    global batch does not split over the world's ranks."""
    if setting.replica_batch(setting.world_size) % 1:
        return []
    configuration = Configuration(mesh=Mesh(dp_shard=setting.world_size), schedule=Schedule())
    ctx = context(setting, configuration, hw, 0)
    bounds = tuple(range(len(chain.blocks)))
    found = []
    for label, checkpoint in (
        ("expert default: FULL_SHARD per block", Checkpoint.NONE),
        ("expert default: FULL_SHARD per block + full checkpointing", Checkpoint.FULL),
    ):
        decisions = tuple(Decision(checkpoint=checkpoint) for _ in bounds)
        found.append((label, evaluate_stage(chain.blocks, bounds, decisions, ctx)))
    return found


def _reasoning(
    chain: BlockChain,
    best: Candidate,
    candidates: list[Candidate],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
    memo: SearchMemo,
) -> Reasoning:
    share = best.peak_bytes / budget
    per_sample = best.step_time_s / samples_per_step(setting, best.configuration)
    faster = search(
        chain.blocks,
        rules,
        setting,
        hw,
        float("inf"),
        space,
        time_bound_s=per_sample,
        memo=memo,
        runner_ups=False,
    )
    if faster and (
        faster[0].step_time_s / samples_per_step(setting, faster[0].configuration)
        < per_sample * (1 - ROUNDING)
    ):
        unconstrained = faster[0]
        binding = (
            f"memory: peak {format_bytes(best.peak_bytes)} is {share:.0%} of the budget; with no budget "
            f"the step would take {unconstrained.step_time_s:.4g} s instead of {best.step_time_s:.4g} s "
            f"({unconstrained.configuration.describe()}, peak {format_bytes(unconstrained.peak_bytes)})"
        )
    else:
        binding = f"none: the fastest plan fits (peak {format_bytes(best.peak_bytes)}, {share:.0%} of the budget)"
    listed = candidates[1 : 1 + RUNNER_UPS]
    listed += [
        c
        for c in best_of_each_tp(chain, best, candidates, rules, setting, hw, budget, space, memo)
        if c not in listed
    ]
    runner_ups = [
        Alternative(
            description=f"{c.configuration.describe()}, "
            f"{samples_per_step(setting, c.configuration):g} samples a step",
            peak_bytes=c.peak_bytes,
            step_time_s=c.step_time_s,
        )
        for c in listed
    ]
    for label, step in expert_defaults(chain, setting, hw):
        fits = "fits" if step.peak_bytes <= budget else "over budget"
        runner_ups.append(
            Alternative(
                description=f"{label} ({fits})",
                peak_bytes=step.peak_bytes,
                step_time_s=step.step_time_s,
            )
        )
    return Reasoning(budget_bytes=budget, binding_constraint=binding, runner_ups=tuple(runner_ups))


def best_of_each_tp(
    chain: BlockChain,
    best: Candidate,
    candidates: list[Candidate],
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
    memo: SearchMemo,
) -> list[Candidate]:
    """The fastest plan of each tp degree searched other than the best's: from the candidates when
    one is among them, else searched at that degree alone."""
    found: list[Candidate] = []
    for option in setting.tensor_parallel:
        if option[0] == best.configuration.mesh.tp:
            continue
        mine = [c for c in candidates if c.configuration.mesh.tp == option[0]]
        found += (
            mine[:1]
            or search(
                chain.blocks,
                rules,
                replace(setting, tensor_parallel=(option,)),
                hw,
                budget,
                space,
                memo=memo,
                runner_ups=False,
            )[:1]
        )
    return found


def _constraints_blamed(
    chain: BlockChain,
    constraints: Constraints | None,
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
) -> str | None:
    """When the constraints alone make the plan infeasible, say which of them to relax."""
    if constraints is None or not constraint_patterns(constraints):
        return None
    if smallest_peak(chain.blocks, _rules(chain, None), setting, hw, space, budget) is None:
        return None
    blamed = [
        f"{field.name}={getattr(constraints, field.name)!r}"
        for field in dataclasses.fields(constraints)
        if getattr(constraints, field.name)
        and smallest_peak(
            chain.blocks,
            _rules(chain, replace(constraints, **{field.name: ()})),
            setting,
            hw,
            space,
            budget,
        )
        is not None
    ]
    return (
        f"no plan fits {format_bytes(budget)} per rank at world_size={setting.world_size} under the constraints, "
        "and one fits without them: relax "
        + (" or ".join(blamed) if blamed else "them (no one alone is to blame)")
    )


def _infeasible_message(
    chain: BlockChain,
    rules: tuple[BlockRule, ...],
    setting: Setting,
    hw: HardwareModel,
    budget: int,
    space: SearchSpace,
) -> str:
    """Name the smallest budget that fits and each option that would make the plan fit; or, where no mesh
    takes the batch at all, that cause."""
    least = smallest_peak(chain.blocks, rules, setting, hw, space)
    if least is None and not configurations(setting, len(chain.blocks)):
        return _batch_taken_by_no_mesh(setting, len(chain.blocks))
    head = f"no plan fits {format_bytes(budget)} per rank at world_size={setting.world_size}" + (
        f": the smallest peak any plan reaches is {format_bytes(least)}, so a budget of "
        f"{least / 2**30:.3g} GiB would fit"
        if least is not None
        else ""
    )
    options = []

    def fits_with(label: str, new_setting: Setting, new_space: SearchSpace) -> bool:
        peak = smallest_peak(chain.blocks, rules, new_setting, hw, new_space, budget)
        if peak is not None:
            options.append(f"{label} (needs {format_bytes(peak)})")
            return True
        return False

    if not space.allow_offload:
        fits_with("allow_offload=True", setting, replace(space, allow_offload=True))
    if not setting.allow_pipeline:
        fits_with("allow_pipeline=True", replace(setting, allow_pipeline=True), space)
    for factor in (2, 4, 8, 16, 32, 64):
        if fits_with(
            f"world_size={setting.world_size * factor}",
            replace(setting, world_size=setting.world_size * factor),
            space,
        ):
            break
    fits_with(
        "a smaller micro-batch (halve the per-replica batch or sequence)",
        replace(
            setting, batch_size=setting.batch_size * 2, max_micro_batches=2 * setting.batch_size
        ),
        space,
    )
    if not options:
        return head + (
            "; neither offload, a pipeline, 64x the ranks nor half the micro-batch would fit: "
            "raise memory_budget or use a smaller model"
        )
    return head + "; it would fit with " + ", or with ".join(options)


def _batch_taken_by_no_mesh(setting: Setting, n_blocks: int) -> str:
    """Why no mesh of the world was searched: an empty example batch, or a global batch that no mesh's
    data-parallel degree divides; memory has nothing to do with it."""
    if setting.batch_size < 1:  # else the example's batch fits a mesh of dp = world at least
        return EMPTY_BATCH
    batch = int(setting.global_batch_size or 0)
    degrees = sorted(
        {c.mesh.dp for c in configurations(replace(setting, global_batch_size=None), n_blocks)}
    )
    fits = min(dp * (batch // dp + 1) for dp in degrees)  # the next batch one of them divides
    pipeline = (
        "; or allow_pipeline=True, whose stages leave fewer replicas"
        if not setting.allow_pipeline
        and configurations(replace(setting, allow_pipeline=True), n_blocks)
        else ""
    )
    return (
        f"the global batch of {batch} samples splits evenly over none of the data-parallel degrees searched at "
        f"world_size={setting.world_size} ({', '.join(map(str, degrees))}): give a global batch one of them "
        f"divides (e.g. {fits}){pipeline}"
    )
