"""The decision space the solvers search, and the user's constraints resolved onto blocks.

The chain DP and the brute force take the same `SearchSpace` and the same
per-block `BlockRule`s, so whatever restricts one restricts the other and the
property test compares like with like. Restrictions by default:
- a unit spans at most `max_unit_blocks` consecutive blocks (default 4): larger
  units only add gathered memory and give up overlap on a chain of similar blocks;
- offload only when allowed, and only with a strategy that may offload (StrategyTraits.may_offload) and
  reshards after forward (ZeRO-3 with CPU offload, as FSDP's CPUOffload and ZeRO-Infinity): a unit
  kept gathered from forward to backward (SHARD_GRAD_OP) holds its parameters on the device anyway.
  Plans may name such a unit offloaded; the search leaves it out, so its plans stay as they were.
"""

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace

from shardplan.errors import ShardplanError
from shardplan.frontend.chain import Block, BlockChain
from shardplan.plan import Checkpoint, Decision, ShardStrategy


@dataclass(frozen=True, kw_only=True, slots=True)
class Constraints:
    """What a user pins or forbids, by regular expressions searched in a block's module paths and classes.

    A block matches a pattern when `re.search(pattern, text)` finds it in the block's name, any of its
    module paths, or any of those modules' class names ("LlamaDecoderLayer", as FSDP's
    transformer_layer_cls names them). A pattern that matches no block is an error.
    """

    unit_boundary: tuple[str, ...] = ()
    """A unit must start at each matching block."""
    no_unit_boundary: tuple[str, ...] = ()
    """No unit may start at a matching block: it joins the unit of the block before."""
    checkpoint: tuple[tuple[str, tuple[Checkpoint, ...]], ...] = ()
    """(pattern, allowed checkpoint modes) for the unit holding a matching block."""
    strategy: tuple[tuple[str, tuple[ShardStrategy, ...]], ...] = ()
    """(pattern, allowed shard strategies) for the unit holding a matching block."""
    stage_boundary: tuple[str, ...] = ()
    """A pipeline stage must start at each matching block (when pp > 1)."""
    no_stage_boundary: tuple[str, ...] = ()
    """No pipeline stage may start at a matching block."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockRule:
    """Constraints resolved onto one block."""

    must_start_unit: bool = False
    may_start_unit: bool = True
    must_start_stage: bool = False
    may_start_stage: bool = True
    checkpoints: frozenset = frozenset(Checkpoint)
    strategies: frozenset = frozenset(ShardStrategy)


DEFAULT_CHECKPOINTS = (Checkpoint.NONE, Checkpoint.FULL, Checkpoint.SELECTIVE)
"""The checkpoint modes searched unless asked for others. SELECTIVE_ALTERNATE is opt-in
(SearchSpace(checkpoints=tuple(Checkpoint)), or a constraint allowing it): a fourth mode on every unit
made LLaMA-70B's solve at world 8 with offload 7 times as long (benchmarks/bench_solver.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchSpace:
    strategies: tuple[ShardStrategy, ...] = tuple(ShardStrategy)
    checkpoints: tuple[Checkpoint, ...] = DEFAULT_CHECKPOINTS
    prefetch: tuple[bool, ...] = (True, False)
    allow_offload: bool = False
    max_unit_blocks: int = 4

    def decisions(self, rules: tuple[BlockRule, ...]) -> tuple[Decision, ...]:
        """Every decision a unit holding blocks with these rules may take, in a fixed order."""
        strategies = [s for s in self.strategies if all(s in r.strategies for r in rules)]
        checkpoints = [c for c in self.checkpoints if all(c in r.checkpoints for r in rules)]
        return tuple(
            Decision(strategy=s, checkpoint=c, offload=o, prefetch=p)
            for s in strategies
            for c in checkpoints
            for o in (
                (False, True) if self.allow_offload and self.searches_offload(s) else (False,)
            )
            for p in self.prefetch
        )

    @staticmethod
    def searches_offload(strategy: ShardStrategy) -> bool:
        """Whether offloading units of `strategy` is searched (see the module's restrictions)."""
        return strategy.traits.may_offload and strategy.traits.reshard_after_forward


def _matches(block: Block, patterns: Iterable[str], classes: Mapping[str, str]) -> bool:
    texts = (
        (block.name,)
        + tuple(block.modules)
        + tuple(classes[m] for m in block.modules if m in classes)
    )
    return any(re.search(pattern, text) for pattern in patterns for text in texts)


def resolve_rules(
    blocks: Sequence[Block],
    constraints: Constraints | None,
    classes: Mapping[str, str] | None = None,
) -> tuple[BlockRule, ...]:
    """One BlockRule per block; raises when the constraints contradict each other or a pattern matches nothing.

    `classes`: module path → class name (BlockChain.module_classes). Tied parameters do not restrict
    stage cuts: a stage reading another's parameter holds a copy, which the cost model prices
    (solver/search.py, tied_terms)."""
    constraints = constraints or Constraints()
    classes = classes or {}
    for field_name, pattern in constraint_patterns(constraints):
        try:
            re.compile(pattern)
        except re.error as error:
            raise ShardplanError(
                f"constraint pattern {pattern!r} is not a regular expression: {error}"
            ) from None
        if not any(_matches(block, (pattern,), classes) for block in blocks):
            raise ShardplanError(
                f"constraint {field_name}={pattern!r} matches no block, so it would change nothing: "
                f"match one of the blocks' module paths or classes ({_block_names(blocks, classes)})"
            )
    rules = []
    for i, block in enumerate(blocks):
        must_unit = i == 0 or _matches(block, constraints.unit_boundary, classes)
        may_unit = i == 0 or not _matches(block, constraints.no_unit_boundary, classes)
        must_stage = i == 0 or _matches(block, constraints.stage_boundary, classes)
        may_stage = i == 0 or not _matches(block, constraints.no_stage_boundary, classes)
        checkpoints = frozenset(Checkpoint).intersection(
            *[
                allowed
                for pattern, allowed in constraints.checkpoint
                if _matches(block, (pattern,), classes)
            ]
        )
        strategies = frozenset(ShardStrategy).intersection(
            *[
                allowed
                for pattern, allowed in constraints.strategy
                if _matches(block, (pattern,), classes)
            ]
        )
        if must_unit and not may_unit or must_stage and not may_stage:
            raise ShardplanError(
                f"constraints both pin and forbid a boundary at block {block.name!r}: "
                "remove one of the two patterns"
            )
        if not checkpoints or not strategies:
            raise ShardplanError(
                f"constraints leave no checkpoint mode or shard strategy for block "
                f"{block.name!r}: relax the patterns that match it"
            )
        rules.append(
            BlockRule(
                must_start_unit=must_unit,
                may_start_unit=may_unit,
                must_start_stage=must_stage,
                may_start_stage=may_stage,
                checkpoints=checkpoints,
                strategies=strategies,
            )
        )
    return tuple(rules)


def constraint_patterns(constraints: Constraints) -> list[tuple[str, str]]:
    """(field name, pattern) for every pattern the constraints hold."""
    return [
        (field.name, entry[0] if isinstance(entry, tuple) else entry)
        for field in fields(constraints)
        for entry in getattr(constraints, field.name)
    ]


def _block_names(blocks: Sequence[Block], classes: Mapping[str, str], shown: int = 6) -> str:
    named = [
        f"{block.name or '<root>'} ({classes[block.name]})"
        if block.name in classes
        else block.name or "<root>"
        for block in blocks
    ]
    return ", ".join(named[:shown]) + (
        f", ... {len(named) - shown} more" if len(named) > shown else ""
    )


def default_space(n_blocks: int, constraints: Constraints | None = None) -> SearchSpace:
    """Units of up to 4 blocks on short chains; of single blocks past 16 blocks, where one
    block (a transformer layer) is already large enough to hide its gather and the DP's
    time grows with the square of the unit length. Prefetch is always on: turning it off
    only saves one unit's gathered parameters. The checkpoint modes are DEFAULT_CHECKPOINTS and
    those a constraint allows (an opt-in mode asked for by `--checkpoint REGEX=selective_alternate`)."""
    allowed = {mode for _, modes in (constraints or Constraints()).checkpoint for mode in modes}
    return SearchSpace(
        max_unit_blocks=4 if n_blocks <= 16 else 1,
        prefetch=(True,),
        checkpoints=tuple(m for m in Checkpoint if m in DEFAULT_CHECKPOINTS or m in allowed),
    )


def block_rules(chain: BlockChain, constraints: Constraints | None) -> tuple[BlockRule, ...]:
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
