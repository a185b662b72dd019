"""A plan as the config of a stack people already run: a torchtitan job config (TOML) and an Accelerate
FSDP2 config (YAML), for `shardplan plan --emit torchtitan|accelerate`.

Neither stack decides per unit: torchtitan and Accelerate shard, reshard and checkpoint every block
alike. Each file takes the setting most of the model's parameters have, and lists as comments the
units the plan decides otherwise, with what the file does instead.
"""

from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from shardplan.common.sizes import format_bytes
from shardplan.plan import Checkpoint, Plan, ShardStrategy, Unit

T = TypeVar("T")

STACKS = ("torchtitan", "accelerate")
SUFFIXES = {"torchtitan": ".torchtitan.toml", "accelerate": ".accelerate.yaml"}


def emit(plan: Plan, stack: str, classes: dict[str, str], sizes: dict[str, int]) -> str:
    """The config text of `plan` for `stack`; `classes`: module path -> class name, `sizes`: parameter
    name -> elements (both from the model the plan was made for)."""
    return (_torchtitan if stack == "torchtitan" else _accelerate)(plan, classes, sizes)


def _weights(plan: Plan, sizes: dict[str, int]) -> dict[str, int]:
    """Each unit's weight in a majority: its parameters' elements (1 for a unit without any)."""
    return {
        unit.name: max(1, sum(sizes.get(name, 0) for name in unit.params)) for unit in plan.units
    }


def _majority(plan: Plan, sizes: dict[str, int], decision: Callable[[Unit], T]) -> T:
    """The decision most of the model's parameters take (by size where known, else by unit)."""
    votes: Counter = Counter()
    weights = _weights(plan, sizes)
    for unit in plan.units:
        votes[decision(unit)] += weights[unit.name]
    return votes.most_common(1)[0][0]


def _reshards(strategy: ShardStrategy) -> bool:
    return strategy is ShardStrategy.FULL_SHARD


def _header(plan: Plan, stack: str) -> list[str]:
    mesh = plan.mesh
    return [
        f"# {stack} config of a shardplan plan: {plan.model} on {plan.world_size} ranks of "
        f"{plan.hardware}",
        f"# mesh {mesh.describe()}; {plan.schedule.runs_as(mesh.pp)}; predicted step "
        f"{plan.predicted.step_time_s * 1e3:.2f} ms, peak {format_bytes(plan.predicted.peak_bytes)} "
        "per rank (on shardplan's runtime; this stack's figures differ)",
        "#",
    ]


def _strategy_notes(plan: Plan, sizes: dict[str, int], reshard: bool) -> list[str]:
    notes = []
    differing = [unit for unit in plan.units if _reshards(unit.strategy) != reshard]
    if differing or any(
        unit.strategy in (ShardStrategy.SHARD_OPTIMIZER, ShardStrategy.REPLICATE)
        for unit in plan.units
    ):
        notes.append(
            "# Cannot express per-unit strategies: every unit here "
            + (
                "reshards after forward (ZeRO-3)."
                if reshard
                else "keeps its gathered parameters (ZeRO-2)."
            )
        )
        notes += [
            f"#   {unit.name}: the plan says {unit.strategy.value}"
            for unit in plan.units
            if unit.strategy.value != ("full_shard" if reshard else "shard_grad_op")
        ]
        notes.append(
            "#   (shard_optimizer, ZeRO-1, and replicate have no FSDP2 setting: such units are "
            "sharded as above, using less memory and more communication than planned.)"
        )
    return notes


def _checkpoint_notes(plan: Plan, chosen: Checkpoint) -> list[str]:
    differing = [unit for unit in plan.units if unit.checkpoint is not chosen]
    if not differing:
        return []
    return [
        f"# Cannot express per-unit activation checkpointing: every block here is {chosen.value}."
    ] + [f"#   {unit.name}: the plan says {unit.checkpoint.value}" for unit in differing]


def _offload_notes(plan: Plan, offload: bool) -> list[str]:
    differing = [unit for unit in plan.units if unit.offload != offload]
    if not differing:
        return []
    return [
        f"# Cannot offload per unit: every unit here is {'offloaded' if offload else 'kept on the device'}."
    ] + [
        f"#   {unit.name}: the plan {'offloads' if unit.offload else 'keeps'} it"
        for unit in differing
    ]


def _shapes(plan: Plan) -> tuple[int, int | None]:
    """(samples per data-parallel rank a step, sequence length or None)."""
    shape = plan.inputs[0].shape if plan.inputs else ()
    return plan.batch_per_replica, (shape[1] if len(shape) >= 2 else None)


def _torchtitan(plan: Plan, classes: dict[str, str], sizes: dict[str, int]) -> str:
    mesh = plan.mesh
    reshard = _majority(plan, sizes, lambda u: _reshards(u.strategy))
    checkpoint = _majority(plan, sizes, lambda u: u.checkpoint)
    offload = _majority(plan, sizes, lambda u: u.offload)
    batch, seq = _shapes(plan)
    micro = plan.schedule.num_micro_batches
    schedule = {"gpipe": "GPipe", "1f1b": "1F1B"}.get(plan.schedule.name, plan.schedule.name)
    parallelism = {
        "data_parallel_replicate_degree": mesh.dp_replicate,
        "data_parallel_shard_degree": mesh.dp_shard,
        "tensor_parallel_degree": mesh.tp,
        "pipeline_parallel_degree": mesh.pp,
        "fsdp_reshard_after_forward": "always" if reshard else "never",
    }
    if mesh.tp > 1:
        parallelism["enable_sequence_parallel"] = plan.tensor_parallel.sequence_parallel
        parallelism["disable_loss_parallel"] = not plan.tensor_parallel.loss_parallel
    if mesh.pp > 1:
        parallelism["pipeline_parallel_schedule"] = schedule
        parallelism["pipeline_parallel_microbatch_size"] = max(1, batch // micro)
    # at pp = 1 the plan's micro-batches are torchtitan's gradient accumulation: global / (local x dp)
    training = {
        "local_batch_size": batch if mesh.pp > 1 else max(1, batch // micro),
        "global_batch_size": mesh.dp * batch,
        "mixed_precision_param": plan.mixed_precision.param_dtype,
        "mixed_precision_reduce": plan.mixed_precision.reduce_dtype,
        "enable_cpu_offload": offload,
    }
    if seq is not None:
        training["seq_len"] = seq
    lines = _header(plan, "torchtitan")
    lines += [
        "# torchtitan 0.3 takes its config from Python (--module, --config) and these as overrides:",
        "#   "
        + " ".join(
            f"--{section}.{key} {_toml(value)}"
            for section, values in (("parallelism", parallelism), ("training", training))
            for key, value in values.items()
        ),
        "# Older torchtitan reads this file itself (--job.config_file).",
        "#",
    ]
    lines += _strategy_notes(plan, sizes, reshard)
    if checkpoint is Checkpoint.SELECTIVE:
        lines.append(
            "# torchtitan's selective op policy keeps every second matmul's output "
            "(selective_alternate): less memory and more recomputation than the plan's selective, "
            "which keeps them all."
        )
    lines += _checkpoint_notes(plan, checkpoint)
    lines += _offload_notes(plan, offload)
    if micro > 1 and mesh.pp == 1:
        lines.append(
            f"# {micro} micro-batches: gradient accumulation, local_batch_size x dp "
            f"{mesh.dp} x {micro} = global_batch_size."
        )
    if plan.mixed_precision.reduce_dtype not in ("float32",):
        lines.append(
            "# torchtitan reduces in float32 only: mixed_precision_reduce will be refused."
        )
    lines += ["", "[parallelism]"]
    lines += [f"{key} = {_toml(value)}" for key, value in parallelism.items()]
    lines += ["", "[training]"]
    lines += [f"{key} = {_toml(value)}" for key, value in training.items()]
    # torchtitan's selective op policy is SELECTIVE_ALTERNATE's; SELECTIVE (every matmul kept) is closest to it
    mode = "selective" if checkpoint.selective else checkpoint.value
    lines += ["", "[activation_checkpoint]", f"mode = {_toml(mode)}"]
    if checkpoint.selective:
        lines.append('selective_ac_option = "op"')
    return "\n".join(lines) + "\n"


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return str(value)


_ACCELERATE_PRECISION = {"bfloat16": "bf16", "float16": "fp16", "float32": "'no'"}


def _accelerate(plan: Plan, classes: dict[str, str], sizes: dict[str, int]) -> str:
    mesh = plan.mesh
    reshard = _majority(plan, sizes, lambda u: _reshards(u.strategy))
    checkpoint = _majority(plan, sizes, lambda u: u.checkpoint)
    offload = _majority(plan, sizes, lambda u: u.offload)
    # the repeated blocks' classes (the transformer layer) wrap as Accelerate does; else each unit's first
    blocks = Counter(classes.get(module, "") for unit in plan.units for module in unit.modules)
    layer_classes = sorted(name for name, count in blocks.items() if name and count > 1) or sorted(
        {classes.get(unit.modules[0], "") for unit in plan.units} - {""}
    )
    lines = _header(plan, "Accelerate")
    lines += _strategy_notes(plan, sizes, reshard)
    if checkpoint.selective:
        lines.append(
            "# Accelerate checkpoints whole blocks only: the plan's selective checkpointing is "
            "written as full (more recomputation, less memory)."
        )
    lines += _checkpoint_notes(plan, checkpoint)
    lines += _offload_notes(plan, offload)
    lines.append(
        "# Units: Accelerate wraps every module of the classes below (TRANSFORMER_BASED_WRAP); "
        "the plan's units start at:"
    )
    lines += [f"#   {unit.name} ({classes.get(unit.modules[0], '?')})" for unit in plan.units]
    if any(len(unit.modules) > 1 for unit in plan.units):
        lines.append(
            "# Cannot express units of several blocks: Accelerate makes each module of those classes "
            "a unit of its own (more, smaller all-gathers than planned)."
        )
    if mesh.pp > 1:
        lines.append(
            f"# Cannot express pipeline parallelism (the plan has pp={mesh.pp}, "
            f"{plan.schedule.runs_as(mesh.pp)}): this file trains on dp x tp ranks of one stage; "
            "plan with --no-pipeline for a plan Accelerate runs as planned."
        )
    micro = plan.schedule.num_micro_batches
    batch, _ = _shapes(plan)
    lines.append(
        f"# Batch: {batch} samples per data-parallel rank a step, in {micro} micro-batch(es): "
        f"per_device_train_batch_size={max(1, batch // micro)}, gradient_accumulation_steps={micro}"
        " (training arguments, not this file)."
    )
    if (
        plan.mixed_precision.param_dtype != "float32"
        and plan.mixed_precision.reduce_dtype != "float32"
    ):
        lines.append(
            f"# Accelerate reduces gradients in float32 under mixed precision; the plan reduces in "
            f"{plan.mixed_precision.reduce_dtype}."
        )
    precision = _ACCELERATE_PRECISION.get(plan.mixed_precision.param_dtype, "'no'")
    lines += [
        "",
        "compute_environment: LOCAL_MACHINE",
        "distributed_type: FSDP",
        f"mixed_precision: {precision}",
        "num_machines: 1",
        f"num_processes: {mesh.dp * mesh.tp}",
        "machine_rank: 0",
        "main_training_function: main",
        "use_cpu: false",
        "debug: false",
        "fsdp_config:",
        "  fsdp_version: 2",
        "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP",
        f"  fsdp_transformer_layer_cls_to_wrap: {','.join(layer_classes) or 'null'}",
        f"  fsdp_reshard_after_forward: {'true' if reshard else 'false'}",
        f"  fsdp_activation_checkpointing: {'false' if checkpoint is Checkpoint.NONE else 'true'}",
        f"  fsdp_offload_params: {'true' if offload else 'false'}",
        "  fsdp_state_dict_type: SHARDED_STATE_DICT",
        "  fsdp_cpu_ram_efficient_loading: true",
    ]
    if mesh.dp_replicate > 1 or mesh.tp > 1:
        lines += [
            "parallelism_config:",
            f"  parallelism_config_dp_replicate_size: {mesh.dp_replicate}",
            f"  parallelism_config_dp_shard_size: {mesh.dp_shard}",
            f"  parallelism_config_tp_size: {mesh.tp}",
        ]
    return "\n".join(lines) + "\n"
