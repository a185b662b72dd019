"""The flags of `shardplan plan`, and the planner's options they give: shared by `plan` and by the
cases of `shardplan check`, which take the same flags."""

import argparse
import dataclasses
import re

from shardplan.common.dtypes import FLOAT_DTYPES
from shardplan.costmodel.cost import OPTIMIZER_STEPS
from shardplan.errors import ShardplanError
from shardplan.plan import Checkpoint, MixedPrecision, ShardStrategy


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """SPEC, --world-size and every planning flag (not -o)."""
    parser.add_argument(
        "spec", help="a zoo name, package.module:factory, or a Hugging Face config JSON"
    )
    parser.add_argument("--world-size", type=int, required=True)
    hardware_options(parser)
    parser.add_argument(
        "--batch",
        type=int,
        help="samples each data-parallel rank takes a step (the example input's dim 0; default 1 for "
        "a Hugging Face config); with --global-batch only the shape the model is analyzed at, "
        "scaled to global / data-parallel ranks per rank",
    )
    parser.add_argument(
        "--global-batch",
        type=int,
        dest="global_batch_size",
        help="samples per step over all data-parallel ranks, whatever the mesh (default: --batch "
        "per data-parallel rank, so meshes with fewer of them train fewer); the solver chooses "
        "the micro-batches",
    )
    parser.add_argument(
        "--max-tp",
        type=int,
        dest="max_tensor_parallel",
        help="the largest tensor-parallel degree searched (default: a node's devices on GPUs, 1 on CPU)",
    )
    parser.add_argument(
        "--max-cp",
        type=int,
        dest="max_context_parallel",
        help="the largest context-parallel degree searched, each sequence split over that many ranks "
        "(default: the world on GPUs, 1 on CPU)",
    )
    parser.add_argument(
        "--max-ep",
        type=int,
        dest="max_expert_parallel",
        help="the largest expert-parallel degree searched, a mixture of experts' routed experts split "
        "over that many ranks (default: the world on GPUs, 1 on CPU)",
    )
    parser.add_argument(
        "--seq",
        "--seq-len",
        type=int,
        dest="seq",
        help="sequence length (of a Hugging Face config, or a model that takes one)",
    )
    parser.add_argument(
        "--headroom",
        type=float,
        metavar="FRACTION",
        help="share of the device's usable memory (past the runtime's reserve) kept free below the "
        "default budget (default: the profile's, 5%% on GPU profiles, 10%% on CPU); not with "
        "--memory-budget, which is used to the byte",
    )
    parser.add_argument(
        "--near-tie",
        type=float,
        default=0.02,
        metavar="FRACTION",
        help="choose the simpler plan (no pipeline, then fewer unit settings) when it is predicted at "
        "most this share slower a sample than the fastest (default: %(default)s; 0: the fastest)",
    )
    parser.add_argument(
        "--no-pipeline",
        dest="allow_pipeline",
        action="store_false",
        help="plan data parallelism only (pp = 1): no pipeline stages",
    )
    parser.add_argument(
        "--offload",
        "--allow-offload",
        dest="allow_offload",
        action="store_true",
        help="let the solver keep shards and their optimizer state in CPU memory (FSDP's CPUOffload)",
    )
    parser.add_argument(
        "--param-dtype",
        choices=FLOAT_DTYPES,
        help="dtype parameters are gathered and computed in (FSDP's MixedPrecision param_dtype); "
        "default: float32 with --reduce-dtype, else the parameters' own. With either flag a "
        "Hugging Face config's model is built in float32 (fp32 master weights)",
    )
    parser.add_argument(
        "--reduce-dtype",
        choices=FLOAT_DTYPES,
        help="dtype gradients are reduced in (MixedPrecision reduce_dtype); default: float32 with "
        "--param-dtype, else the parameters' own",
    )
    parser.add_argument(
        "--optimizer",
        choices=sorted(OPTIMIZER_STEPS),
        default="adamw",
        help="the optimizer whose state and step are priced (default: adamw)",
    )
    parser.add_argument(
        "--wrap",
        metavar="REGEX",
        action="append",
        default=[],
        help="a unit starts at each block whose module path or class name matches (FSDP's "
        "auto_wrap_policy / transformer_layer_cls); repeatable",
    )
    parser.add_argument(
        "--no-wrap",
        metavar="REGEX",
        action="append",
        default=[],
        help="no unit starts at a matching block: it joins the unit of the block before; repeatable",
    )
    parser.add_argument(
        "--pin",
        metavar="REGEX=STRATEGY[,STRATEGY]",
        action="append",
        default=[],
        help=f"the unit holding a matching block uses one of these strategies "
        f"({', '.join(s.value for s in ShardStrategy)}); repeatable",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="REGEX=MODE[,MODE]",
        action="append",
        default=[],
        help=f"the unit holding a matching block checkpoints its activations in one of these modes "
        f"({', '.join(c.value for c in Checkpoint)}; selective_alternate is searched only where "
        "named); repeatable",
    )
    parser.add_argument(
        "--stage-cut",
        metavar="REGEX",
        action="append",
        default=[],
        help="a pipeline stage starts at each matching block (when the plan has pp > 1); repeatable",
    )
    parser.add_argument(
        "--no-stage-cut",
        metavar="REGEX",
        action="append",
        default=[],
        help="no pipeline stage starts at a matching block; repeatable",
    )
    parser.add_argument(
        "--max-unit-blocks",
        type=int,
        metavar="N",
        help="the most blocks one unit holds (default: 4 on chains of up to 16 blocks, else 1)",
    )
    parser.add_argument(
        "--no-replica-groups",
        dest="allow_replica_groups",
        action="store_false",
        help="shard every unit over all data-parallel ranks: no HSDP replica groups",
    )
    parser.add_argument(
        "--emit",
        action="append",
        default=[],
        choices=("torchtitan", "accelerate"),
        help="also write the plan as that stack's config beside -o (plan.torchtitan.toml, "
        "plan.accelerate.yaml), with comments listing what the stack cannot express; repeatable",
    )
    parser.add_argument(
        "--no-reasoning",
        dest="explain",
        action="store_false",
        help="skip the runner-ups and the binding constraint (most of a solve's time): the same plan",
    )


def hardware_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hardware", default="h100-80g", help="a built-in profile name or a calibrated JSON"
    )
    parser.add_argument(
        "--memory-budget", help="per rank, e.g. 40GiB (default: the device's usable memory)"
    )


def plan_options(options) -> dict:
    """compile's keywords (PlanOptions' fields) from the plan command's flags."""
    precision = None
    if options.param_dtype or options.reduce_dtype:
        precision = MixedPrecision(
            param_dtype=options.param_dtype or "float32",
            reduce_dtype=options.reduce_dtype or "float32",
        )
    return {
        "hardware": _with_headroom(options),
        "memory_budget": options.memory_budget,
        "mixed_precision": precision,
        "optimizer": options.optimizer,
        "allow_pipeline": options.allow_pipeline,
        "allow_offload": options.allow_offload,
        "constraints": _constraints(options),
        "max_unit_blocks": options.max_unit_blocks,
        "allow_replica_groups": options.allow_replica_groups,
        "global_batch_size": options.global_batch_size,
        "max_tensor_parallel": options.max_tensor_parallel,
        "max_context_parallel": options.max_context_parallel,
        "max_expert_parallel": options.max_expert_parallel,
        "near_tie": options.near_tie,
        "explain": options.explain,
    }


def _constraints(options):
    """Constraints from the plan command's pattern flags; None without any."""
    from shardplan.solver.space import Constraints

    constraints = Constraints(
        unit_boundary=_regexes(options.wrap, "--wrap"),
        no_unit_boundary=_regexes(options.no_wrap, "--no-wrap"),
        strategy=_pins(options.pin, "--pin", ShardStrategy, "strategy"),
        checkpoint=_pins(options.checkpoint, "--checkpoint", Checkpoint, "mode"),
        stage_boundary=_regexes(options.stage_cut, "--stage-cut"),
        no_stage_boundary=_regexes(options.no_stage_cut, "--no-stage-cut"),
    )
    return None if constraints == Constraints() else constraints


def _with_headroom(options):
    """The --hardware profile, its usable memory share 1 - --headroom when that is given."""
    if options.headroom is None:
        return options.hardware
    from shardplan.costmodel.hardware import get_hardware

    if options.memory_budget is not None:
        raise ShardplanError(
            "--headroom shapes the default budget, --memory-budget replaces it: pass one of them"
        )
    if not 0 <= options.headroom < 1:
        raise ShardplanError(
            f"--headroom {options.headroom} is not a share of memory: pass a number from 0 to "
            "below 1, e.g. 0.1 to keep 10% free"
        )
    return dataclasses.replace(
        get_hardware(options.hardware), usable_memory_fraction=1 - options.headroom
    )


def _pins(texts: list[str], flag: str, kind, noun: str) -> tuple:
    """(pattern, allowed members of the enum `kind`) for each REGEX=NAME[,NAME] of `flag`; `noun` names a member."""
    pins = []
    for text in texts:
        pattern, equals, names = text.rpartition("=")
        if not equals or not pattern:
            raise ShardplanError(
                f"{flag} {text!r} is not REGEX={noun.upper()}: write e.g. "
                f"{flag} 'layers\\.0$={next(iter(kind)).value}'"
            )
        pins.append(
            (
                _regex(pattern, flag),
                tuple(_member(kind, name, f"{flag} {noun}") for name in names.split(",")),
            )
        )
    return tuple(pins)


def _member(kind, name: str, what: str):
    try:
        return kind(name)
    except ValueError:
        raise ShardplanError(
            f"{what} {name!r} is unknown: use one of {', '.join(member.value for member in kind)}"
        ) from None


def _regexes(patterns: list[str], flag: str) -> tuple[str, ...]:
    return tuple(_regex(pattern, flag) for pattern in patterns)


def _regex(pattern: str, flag: str) -> str:
    try:
        re.compile(pattern)
    except re.error as error:
        raise ShardplanError(
            f"{flag} {pattern!r} is not a regular expression ({error}): fix or quote it"
        ) from None
    return pattern
