"""`compile`: model → Plan; `solve`: BlockChain → Plan (no torch: re-planning from a cached chain is fast).

`compile` captures and analyzes the model (shardplan.frontend.passes.analyze) and hands the
chain to `solve`, which searches meshes, micro-batches and schedules (solver/search.py),
cuts stages and chooses units exactly (solver/stages.py, solver/chain_dp.py), and
writes the decisions and predicted terms (solver/assemble.py) and the reasoning (solver/explain.py)
into a Plan. `evaluate` prices a given plan (solver/evaluate.py).
"""

import dataclasses
import difflib
import os
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ParamSpec, Protocol, cast

from shardplan.common.dtypes import dtype_name
from shardplan.common.files import is_finite_number
from shardplan.common.sizes import parse_bytes
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.errors import InfeasibleError, ShardplanError
from shardplan.frontend.chain import BlockChain
from shardplan.frontend.shapes import (
    MIN_FITTED_LENGTH,
    SequenceFit,
    fit_lengths,
    inputs_at,
    sequence_length,
)
from shardplan.plan import MAX_WORLD_SIZE, MixedPrecision, Plan, Reasoning, SequenceLimit
from shardplan.solver.assemble import (
    example_batch,
    predict,
    replica_inputs,
    tensor_parallel_section,
    units_and_stages,
)
from shardplan.solver.evaluate import check_computes_in, evaluate, evaluate_stages
from shardplan.solver.explain import constraints_blamed, infeasible_message, reasoning
from shardplan.solver.search import (
    Candidate,
    Configuration,
    SearchMemo,
    Setting,
    configurations,
    context_parallel_options,
    expert_parallel_options,
    search,
    simplest_near_the_fastest,
    tensor_parallel_options,
)
from shardplan.solver.shapes import evaluate_at, longest_sequence, sequence_limits
from shardplan.solver.space import (
    BlockRule,
    Constraints,
    SearchSpace,
    block_rules,
    default_space,
)

__all__ = [
    "PlanOptions",
    "compile",
    "solve",
    "best_of_each",
    "evaluate",
    "evaluate_stages",
    "sequence_fit",
    "evaluate_at",
    "longest_sequence",
]

if TYPE_CHECKING:
    from torch import nn


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
    max_context_parallel: int | None = None
    """The largest cp searched (among degrees dividing the world where the model attends over a
    sequence that 2 · cp chunks divide, and takes labels=: context_parallel_options); None: the world
    where the device overlaps communication with compute (GPUs), 1 on CPU ranks (gloo), where the
    gathers of keys and values take the cores the compute needs."""
    max_expert_parallel: int | None = None
    """The largest ep searched (among degrees dividing the world and every MoE block's experts:
    expert_parallel_options); None: the world where the device overlaps communication with compute
    (GPUs), 1 on CPU ranks (gloo), where the all-to-alls take the cores the compute needs."""
    allow_replica_groups: bool = True
    """Search HSDP (dp_replicate > 1) where each replica group's dp_shard × tp ranks fill whole nodes."""
    global_batch_size: int | None = None
    """Samples per step over all replicas, split evenly over dp (meshes whose dp does not divide it are
    not searched); None: every replica takes the chain's batch."""
    near_tie: float = 0.02
    """A simpler plan (no pipeline, then fewer distinct unit settings) predicted at most this share slower a
    sample than the fastest is chosen instead, and the reasoning says so ([Note: near ties] in
    solver/search.py); 0 takes the fastest."""
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
    contiguous = all(
        t.is_contiguous()
        for t in (*example_inputs, *(example_kwargs or {}).values())
        if hasattr(t, "is_contiguous")
    )
    return _with_sequence_limits(
        plan, model, PlanOptions.of(options).hardware, chain if contiguous else None
    )


def _with_sequence_limits(
    plan: Plan, model: "nn.Module", hardware: Any, analyzed: BlockChain | None
) -> Plan:
    """`plan` with the longest sequence each micro-batch size fits (solver/shapes.py), where its inputs
    have a sequence; where the model's chain is no polynomial of the length, without, and a warning."""
    if sequence_length(plan.inputs) < MIN_FITTED_LENGTH:
        return plan
    try:
        fit = sequence_fit(model, plan, analyzed=analyzed)
    except ShardplanError as error:
        warnings.warn(f"no sequence limits in the plan: {error}", stacklevel=3)
        return plan
    limits = sequence_limits(fit, plan, hardware=hardware)
    return replace(
        plan, sequence_limits=tuple(SequenceLimit(micro_batch=m, longest=n) for m, n in limits)
    )


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


@dataclass(frozen=True, kw_only=True, slots=True)
class _Searched:
    """What solve searches: the options it was asked, checked, and the search's inputs from them."""

    asked: PlanOptions
    hw: HardwareProfile
    budget: int
    precision: MixedPrecision
    space: SearchSpace
    setting: Setting
    rules: tuple[BlockRule, ...]


def _searched(chain: BlockChain, world_size: int, options: dict[str, Any]) -> _Searched:
    """The search `options` (PlanOptions' fields) ask for on `chain`; a ShardplanError naming an option
    that asks for nothing searchable."""
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
        asked.space or default_space(len(chain.blocks), asked.constraints),
        allow_offload=asked.allow_offload,
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
    if not (is_finite_number(asked.near_tie) and 0 <= asked.near_tie < 1):
        raise ShardplanError(
            f"near_tie={asked.near_tie!r} is no share of a step's time: give 0 (the fastest plan) up to "
            "below 1, e.g. 0.02"
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
    max_cp = asked.max_context_parallel
    if max_cp is None:
        max_cp = world_size if hw.overlaps_communication else 1
    if max_cp < 1:
        raise ShardplanError(
            f"max_context_parallel={max_cp} leaves no context-parallel degree to search: give 1 or "
            "more (1: no context parallelism)"
        )
    max_ep = asked.max_expert_parallel
    if max_ep is None:
        max_ep = world_size if hw.overlaps_communication else 1
    if max_ep < 1:
        raise ShardplanError(
            f"max_expert_parallel={max_ep} leaves no expert-parallel degree to search: give 1 or "
            "more (1: no expert parallelism)"
        )
    setting = Setting(
        world_size=world_size,
        batch_size=example_batch(chain),
        mixed_precision=precision,
        optimizer=asked.optimizer,
        allow_pipeline=asked.allow_pipeline,
        skip_edges=chain.skip_edges,
        tied_edges=chain.tied_edges,
        global_batch_size=asked.global_batch_size,
        tensor_parallel=tensor_parallel_options(chain.blocks, world_size, max_tp),
        context_parallel=context_parallel_options(chain, world_size, max_cp),
        expert_parallel=expert_parallel_options(chain, world_size, max_ep),
        replica_group_ranks=hw.devices_per_node if asked.allow_replica_groups else 0,
    )
    return _Searched(
        asked=asked,
        hw=hw,
        budget=budget,
        precision=precision,
        space=space,
        setting=setting,
        rules=block_rules(chain, asked.constraints),
    )


@_solve_keywords(PlanOptions)
def solve(chain: BlockChain, world_size: int, model_name: str = "", **options: Any) -> Plan:
    """The plan for an analyzed chain: plain data in, Plan out (no capture, no torch); `options` are
    PlanOptions' fields."""
    searched = _searched(chain, world_size, options)
    asked, hw, budget, setting = searched.asked, searched.hw, searched.budget, searched.setting
    rules, space = searched.rules, searched.space
    memo = SearchMemo()  # the searches below try the same configurations
    candidates = search(chain.blocks, rules, setting, hw, budget, space, memo=memo)
    if not candidates:
        raise InfeasibleError(
            constraints_blamed(chain, asked.constraints, setting, hw, budget, space)
            or infeasible_message(chain, rules, setting, hw, budget, space, memo)
        )
    candidates = simplest_near_the_fastest(candidates, setting, asked.near_tie)
    best = candidates[0]
    units, stages = units_and_stages(chain, best)
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
        mixed_precision=searched.precision,
        optimizer=asked.optimizer,
        units=units,
        stages=stages,
        predicted=predict(chain, best, setting, hw),
        reasoning=(
            reasoning(
                chain, best, candidates, rules, setting, hw, budget, space, memo, asked.near_tie
            )
            if asked.explain
            else Reasoning(budget_bytes=budget, binding_constraint="not computed (explain=False)")
        ),
    )


def best_of_each(
    chain: BlockChain,
    world_size: int,
    group: Callable[[Configuration], Hashable | None],
    **options: Any,
) -> dict[Hashable, Candidate]:
    """The fastest plan of each group of the configurations `solve` searches with these `options`
    (PlanOptions' fields), by `group`'s name for a configuration (e.g. its pp degree and schedule;
    None: not searched), in the order the groups first come in the search; a group none of whose plans
    fits is left out. What the reasoning's runner-ups show for each tp, cp and ep degree, for any
    grouping; each group is searched alone, the searches sharing what they price."""
    searched = _searched(chain, world_size, options)
    setting, memo = searched.setting, SearchMemo()
    names = dict.fromkeys(
        name for c in configurations(setting, len(chain.blocks)) if (name := group(c)) is not None
    )
    found = {}
    for name in names:

        def only(configuration: Configuration, name: Hashable = name) -> bool:
            return group(configuration) == name

        fastest = search(
            chain.blocks,
            searched.rules,
            setting,
            searched.hw,
            searched.budget,
            searched.space,
            memo=memo,
            runner_ups=False,
            only=only,
        )
        if fastest:
            found[name] = fastest[0]
    return found


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


def sequence_fit(
    model: "nn.Module", plan: Plan, *, analyzed: BlockChain | None = None
) -> SequenceFit:
    """`plan`'s chain at every sequence length, from analyses of `model` at three lengths (see
    [Note: a chain as a function of the sequence length]): what solver/shapes.py prices any shape
    with. The analyses run on contiguous inputs of ones, so the three see one layout (a sliced input
    is strided, and its copy to contiguous would be an op of one chain only). `analyzed`: the chain
    at the plan's length already, from contiguous inputs, whose batch the others take."""
    from shardplan.frontend.passes import analyze, example_tensors

    inputs = analyzed.inputs if analyzed is not None else plan.inputs
    device = next((p.device for p in model.parameters()), "cpu")
    lengths = fit_lengths(sequence_length(inputs))
    chains = [
        analyzed
        if analyzed is not None and length == lengths[-1]
        else analyze(
            model,
            *example_tensors(inputs_at(inputs, inputs[0].shape[0], length), device),
            compute_dtype=plan.mixed_precision.param_dtype,
        )
        for length in lengths
    ]
    return SequenceFit.of(lengths, chains)
