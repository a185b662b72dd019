"""Predicted against measured on this machine: the demo GPT trained on CPU ranks under every plan kind.

This is what holds the cost model's [Note: the cost model] and the runtime together. Each plan kind
(every shard strategy x activation checkpointing) is written by hand (runtime.manual_plan), priced
by compile.evaluate, and trained on gloo ranks: peak memory is MemTracker's (every tensor on the
rank, after a warm-up step has allocated the optimizer state), step time a whole training step
(forward, backward, optimizer step, zero_grad) of rank 0, the fastest of interleaved rounds
([Note: the fastest of interleaved rounds] in calibrate.py), so that other work on the machine
lengthens no plan more than another.

tests/test_predictions.py and `shardplan check --measure` hold every kind to MEMORY_TOLERANCE and
STEP_TIME_BAND; benchmarks/bench_estimates.py prints the same table against a fresh calibration.

The same plan kinds run on other models (a Workload: a zoo entry at one size, one unit per block of
its chain): HF_WORKLOADS are the Hugging Face architectures of the tables, which
benchmarks/bench_hf_memory.py prints and tests/test_hf_predictions.py holds to ±5% memory.

The mesh kinds (MESH_KINDS: tensor parallelism with and without sequence and vocabulary parallelism,
tp × dp, HSDP) are measured the same way, one world per world size, each rank's batch its replica's;
tests/test_predictions.py holds them to the same bands, benchmarks/bench_mesh.py prints them.
[Note: more ranks than cores] A world of more single-threaded ranks than the machine has cores (4 on
CI's 2) shares them: its ranks run in lock-step (every layer ends in a collective), so each gets
cores / ranks of a core and everything it does, compute and collectives alike, takes ranks / cores
times as long. Such a world's step time is priced on `shared_cores(profile, ranks, cores)`, the
profile of a rank holding that share of a core; its memory is the same as on enough cores.

The pipelined kinds (PIPELINE_KINDS: pp 2, GPipe and 1F1B) are held per stage: each rank's peak
memory against its stage's prediction (measure_pipeline_accuracy; memory only).
"""

import dataclasses
import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from rich.table import Table

from shardplan.common.sizes import format_bytes
from shardplan.costmodel.hardware import HardwareProfile, LinkProfile, SizeCurve, get_hardware
from shardplan.frontend.chain import BlockChain
from shardplan.models import zoo
from shardplan.plan import Checkpoint, MixedPrecision, Plan, ShardStrategy

KINDS = tuple((strategy, checkpoint) for strategy in ShardStrategy for checkpoint in Checkpoint)
KIND_NAMES = tuple(f"{strategy.value}/{checkpoint.value}" for strategy, checkpoint in KINDS)
"""KINDS' names, in its order: "strategy/checkpoint", e.g. "full_shard/selective"."""
MESH_KINDS: dict[str, dict[str, Any]] = {
    "tp2": dict(tp=2),
    "tp2 vocab": dict(tp=2, vocab_parallel=True),
    "tp2 sp vocab": dict(tp=2, sequence_parallel=True, vocab_parallel=True),
    "dp2 tp2 sp vocab": dict(dp=2, tp=2, sequence_parallel=True, vocab_parallel=True),
    "hsdp 2x2": dict(dp=2, dp_replicate=2),
}
"""The 4-D mesh's kinds, as runtime.manual_plan's mesh arguments (dp: dp_shard), every unit FULL_SHARD."""
MEMORY_TOLERANCE = 0.10
"""Largest |predicted / measured - 1| of peak memory: CPU memory is deterministic, so a miss is the model's."""
STEP_TIME_BAND = (0.7, 1.3)
"""Accepted predicted / measured step time: the built-in profile is another day's calibration."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Accuracy:
    """One plan kind's prediction beside its measurement."""

    kind: str
    """"strategy/checkpoint", e.g. "full_shard/selective"."""
    predicted_bytes: int
    measured_bytes: int
    predicted_s: float
    measured_s: float

    @property
    def memory_ratio(self) -> float:
        return self.predicted_bytes / self.measured_bytes

    @property
    def time_ratio(self) -> float:
        return self.predicted_s / self.measured_s

    def misses(self) -> list[str]:
        """One line per figure outside its accepted range."""
        return self.memory_misses() + self.time_misses()

    def memory_misses(self) -> list[str]:
        if abs(self.memory_ratio - 1) <= MEMORY_TOLERANCE:
            return []
        return [
            f"{self.kind}: predicted peak memory is {self.memory_ratio:.2f}x the measured "
            f"(accepted: within {MEMORY_TOLERANCE:.0%})"
        ]

    def time_misses(self) -> list[str]:
        low, high = STEP_TIME_BAND
        if low <= self.time_ratio <= high:
            return []
        return [
            f"{self.kind}: predicted step time is {self.time_ratio:.2f}x the measured "
            f"(accepted: {low}-{high}); on a busy machine run it again, else recalibrate"
        ]


def machine_cores() -> int:
    """Cores this process may run on (its affinity, which a container's CPU set narrows)."""
    return len(os.sched_getaffinity(0))


def shared_cores(hardware: HardwareProfile, ranks: int, cores: int) -> HardwareProfile:
    """`hardware` as one of `ranks` lock-step ranks sharing `cores` cores sees it ([Note: more ranks than
    cores]): every rate × cores / ranks, every fixed cost and wait × ranks / cores. `hardware` itself
    when every rank has a core."""
    if ranks <= cores:
        return hardware
    share = cores / ranks

    def link(profile: LinkProfile) -> LinkProfile:
        return dataclasses.replace(
            profile,
            in_step_wait_s=profile.in_step_wait_s / share,
            collectives={
                kind: dataclasses.replace(
                    cost,
                    latency_s=cost.latency_s / share,
                    bus_bandwidth_bytes_per_s=cost.bus_bandwidth_bytes_per_s * share,
                )
                for kind, cost in profile.collectives.items()
            },
        )

    return dataclasses.replace(
        hardware,
        name=f"{hardware.name}, {ranks} ranks on {cores} cores",
        matmul={
            dtype: dataclasses.replace(rate, peak_flops_per_s=rate.peak_flops_per_s * share)
            for dtype, rate in hardware.matmul.items()
        },
        memory_bandwidth_bytes_per_s=hardware.memory_bandwidth_bytes_per_s * share,
        op_overhead_s=hardware.op_overhead_s / share,
        selective_op_overhead_s=hardware.selective_op_overhead_s / share,
        view_overhead_s=hardware.view_overhead_s / share,
        op_fixed_costs_s={op: seconds / share for op, seconds in hardware.op_fixed_costs_s.items()},
        intra_node=link(hardware.intra_node),
        inter_node=link(hardware.inter_node),
        # an op's factor is read off its curve by a call's roofline seconds, which are now 1 / share as long
        op_time_factors={
            op: SizeCurve(
                points=tuple((seconds / share, factor) for seconds, factor in curve.points)
            )
            for op, curve in hardware.op_time_factors.items()
        },
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A zoo model at one size, as every rank builds it to train and the planner to analyse."""

    name: str
    """Its zoo name (zoo.ZOO)."""
    options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments of its zoo builder (one replica's batch among them)."""

    def build(self) -> zoo.ZooModel:
        if self.name in zoo.HF_ARCHITECTURES:
            return zoo.hf_architecture(self.name, **dict(self.options))
        return zoo.build(self.name, **dict(self.options))

    def units(self, chain: BlockChain) -> list[tuple[str, ...]]:
        """Modules of each unit: the demo GPT's by hand (zoo.gpt_units), else one unit per block of the
        chain, with the module holding each parameter it reads under a tied name (T5's `shared`, BERT's
        `cls.predictions` and its bias); a unit whose added module holds earlier units' modules joins them."""
        if self.name == "gpt":
            return zoo.gpt_units(
                len([block for block in chain.blocks if block.name.startswith("h.")])
            )
        units: list[tuple[str, ...]] = []
        for block in chain.blocks:
            owners = (name.rpartition(".")[0] for name in block.param_names)
            modules = block.modules + tuple(
                dict.fromkeys(owner for owner in owners if not _under(owner, block.modules))
            )
            while units and any(_under(module, modules) for module in units[-1]):
                modules = units.pop() + modules
            units.append(modules)
        return units


def _under(module: str, ancestors: tuple[str, ...]) -> bool:
    return any(module == ancestor or module.startswith(ancestor + ".") for ancestor in ancestors)


DEMO_WORKLOAD = Workload(name="gpt", options=(("config", zoo.DEMO_GPT), ("batch", zoo.DEMO_BATCH)))
_HF_SIZE = (("n_layer", 4), ("d_model", 256), ("batch", 4), ("seq", 128))
HF_WORKLOADS = {
    name: Workload(name=name, options=_HF_SIZE + extra)
    for name, extra in (
        ("hf-llama", (("ffn", 688), ("vocab", 2048))),
        ("hf-mixtral", ()),
        ("hf-gpt2", ()),
        ("hf-bert", ()),
        ("hf-t5", ()),
    )
}
"""Hugging Face architectures at the size of the example (4 layers, hidden 256; Llama with 4
query and 2 kv heads and a vocabulary of 2048), each rank's batch 4 x 128 tokens."""
HF_OTHER_ARCHITECTURES = (
    "qwen2",
    "phi3",
    "gemma",
    "gpt-neox",
    "opt",
    "bart",
    "falcon",
    "starcoder2",
)
"""Architectures of zoo.HF_ARCHITECTURES beside HF_WORKLOADS' five (biased GQA, fused projections, GeGLU
with its own head width, a parallel residual, learned positions, an encoder-decoder of another layout,
multi-query attention, a biased MLP with tied embeddings), which bench_hf_memory.py --extra measures
at the same size (hf_architecture_workload)."""
HF_WORKLOAD_NAMES = (*HF_WORKLOADS, *zoo.HF_ARCHITECTURES)
"""Every name hf_workload takes: HF_WORKLOADS', then zoo.HF_ARCHITECTURES'."""
_WIDTH_FIELDS = (
    "hidden_size",
    "n_embd",
    "d_model",
    "intermediate_size",
    "ffn_dim",
    "d_ff",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "word_embed_proj_dim",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "head_dim",
    "d_kv",
    "rotary_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)
_DEPTH_FIELDS = ("num_hidden_layers", "n_layer", "num_layers", "encoder_layers", "decoder_layers")
_POSITION_FIELDS = ("max_position_embeddings", "n_positions")


def hf_architecture_workload(architecture: str) -> Workload:
    """zoo.HF_ARCHITECTURES' `architecture` at HF_WORKLOADS' size: every width of its tiny config scaled
    as its hidden size goes to 256 (head counts and vocabulary kept), 4 layers (of each stack), positions
    for the 128 tokens of each rank's batch of 4."""
    _, tiny, _ = zoo.HF_ARCHITECTURES[architecture]
    (_, layers), (_, width), (_, batch), (_, seq) = _HF_SIZE
    scale = width // next(
        tiny[name] for name in _WIDTH_FIELDS if name in tiny
    )  # the first widths name the hidden size
    fields = {name: value * scale for name, value in tiny.items() if name in _WIDTH_FIELDS}
    fields |= {name: layers for name in tiny if name in _DEPTH_FIELDS}
    # RoBERTa counts positions from padding_idx + 1: two more than the tokens
    fields |= {
        name: max(value, seq + 2) for name, value in tiny.items() if name in _POSITION_FIELDS
    }
    return Workload(
        name=architecture, options=(("batch", batch), ("seq", seq), *sorted(fields.items()))
    )


def hf_workload(name: str) -> Workload:
    """HF_WORKLOADS' `name`, or zoo.HF_ARCHITECTURES' at the same size (hf_architecture_workload)."""
    return HF_WORKLOADS[name] if name in HF_WORKLOADS else hf_architecture_workload(name)


def demo_chain_and_plans(
    world_size: int,
    workload: Workload = DEMO_WORKLOAD,
    precision: MixedPrecision = MixedPrecision(),
) -> tuple[BlockChain, list[Plan]]:
    """`workload`'s analysed chain and one hand-written plan per kind (one unit per block, as KINDS orders),
    computing in `precision`."""
    from shardplan.frontend.passes import analyze
    from shardplan.runtime.manual import manual_plan

    entry = workload.build()
    chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=precision.param_dtype)
    groups = workload.units(chain)
    return chain, [
        manual_plan(
            entry.model,
            groups,
            dp=world_size,
            strategies=(strategy,),
            checkpoints=(checkpoint,),
            precision=precision,
        )
        for strategy, checkpoint in KINDS
    ]


def demo_mesh_plans(
    workload: Workload = DEMO_WORKLOAD,
    kinds: "list[str] | None" = None,
    precision: MixedPrecision = MixedPrecision(),
) -> tuple[BlockChain, dict[str, Plan]]:
    """A GPT workload's analysed chain (the demo GPT's by default) and a plan of every mesh kind of
    MESH_KINDS (or of `kinds`), one unit per block, computing in `precision`."""
    from shardplan.frontend.passes import analyze
    from shardplan.runtime.manual import manual_plan

    entry = workload.build()
    chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=precision.param_dtype)
    groups = workload.units(chain)
    return chain, {
        name: manual_plan(
            entry.model,
            groups,
            **{"dp": 1, **MESH_KINDS[name]},
            example_inputs=entry.args,
            example_kwargs=entry.kwargs,
            precision=precision,
        )
        for name in kinds or MESH_KINDS
    }


def trained_program(device, plan_json: str, workload: Workload) -> tuple:
    """On a rank: `workload`'s model (the same initial weights on every rank), parallelized by the plan, its
    AdamW and this replica's batch of ids (the tp ranks of a replica read the same one): (model, program,
    optimizer, ids)."""
    from shardplan.runtime import parallelize
    from shardplan.runtime.collectives import world

    torch.manual_seed(0)
    entry = workload.build()
    plan = Plan.from_json(plan_json)
    generator = torch.Generator().manual_seed(1 + plan.mesh.replica_of(world().rank))
    vocab_size = getattr(
        entry.model, "config"
    ).vocab_size  # the zoo's GPT and Hugging Face models keep one
    ids = torch.randint(0, vocab_size, entry.args[0].shape, generator=generator)
    program = parallelize(entry.model, plan, device=device)
    return entry.model, program, torch.optim.AdamW(program.parameters(), lr=1e-3), ids


def measure_plans_job(
    device,
    report,
    plan_jsons: list[str],
    rounds: int,
    sweep,
    workload: "Workload | tuple[Workload, ...]" = DEMO_WORKLOAD,
):
    """Rank job (see runtime.launch.run_world): every plan's peak memory by MemTracker and its training
    step timed in `rounds` interleaved rounds, the same as the calibration of `sweep` (None: no
    calibration); no rounds and no sweep measure memory alone, each step's seconds NaN.
    `workload`: the model every plan trains, or each plan's own (one per plan).

    Returns the calibration's Measurements (None without a sweep) and per plan (peak bytes over the
    ranks, the fastest round's step seconds)."""
    from shardplan.calibration.calibrate import Probe, measure_job
    from shardplan.runtime.collectives import all_reduce_max
    from shardplan.runtime.measure import peak_step_bytes

    timed = rounds > 0 or sweep is not None
    probes, peaks = {}, []
    workloads = workload if isinstance(workload, tuple) else (workload,) * len(plan_jsons)
    for index, (plan_json, planned) in enumerate(zip(plan_jsons, workloads, strict=True)):
        model, program, optimizer, ids = trained_program(device, plan_json, planned)
        step = functools.partial(_train_step, program, optimizer, ids)
        step()  # warm-up: allocates the optimizer state, as every later step has it
        grads = [p.grad for p in program.parameters() if p.grad is not None]  # kept between steps
        peak = peak_step_bytes(step, model, optimizer, *program.parameters(), *grads)
        peaks.append(int(all_reduce_max(torch.tensor(peak))))
        if timed:  # the program lives on to be timed; untimed, nothing holds it past its peak
            probes["plan", index] = Probe(call=step, loop=False)
    if not timed:
        return None, [(peak, math.nan) for peak in peaks]
    measurements, seconds = measure_job(device, report, rounds, sweep, lambda device: probes)
    return measurements, [(peak, seconds["plan", index]) for index, peak in enumerate(peaks)]


def _train_step(program, optimizer, ids) -> None:
    program.step(ids, labels=ids)
    optimizer.step()
    # Gradients stay allocated between steps, as the cost model counts them (sharded_state).
    optimizer.zero_grad(set_to_none=False)


def measure_plans(
    plans: list[Plan],
    world_size: int,
    rounds: int,
    sweep=None,
    progress: bool = True,
    workload: "Workload | tuple[Workload, ...]" = DEMO_WORKLOAD,
):
    """`measure_plans_job` on `world_size` spawned gloo ranks: (Measurements or None, [(peak bytes, step s)])."""
    from shardplan.calibration.calibrate import measure_steps
    from shardplan.runtime.launch import run_world

    return run_world(
        measure_plans_job,
        ([plan.to_json() for plan in plans], rounds, sweep, workload),
        world_size=world_size,
        backend="gloo",
        total_steps=measure_steps(rounds, sweep),
        progress=progress,
        description="training steps" + (" and calibration" if sweep else ""),
    )


def compare(
    chain: BlockChain,
    plans: list[Plan],
    measured: list[tuple[int, float]],
    hardware,
    kinds: "list[str] | None" = None,
) -> list[Accuracy]:
    """Each plan's prediction on `hardware` beside what `measure_plans` measured; `kinds` names the
    plans (default: KIND_NAMES). A world of more ranks than this machine's cores is priced on
    shared_cores ([Note: more ranks than cores])."""
    from shardplan.compile import evaluate

    rows = []
    for kind, plan, (peak_bytes, step_s) in zip(kinds or KIND_NAMES, plans, measured):
        predicted = evaluate(chain, plan, shared_cores(hardware, plan.world_size, machine_cores()))
        rows.append(
            Accuracy(
                kind=kind,
                predicted_bytes=predicted.peak_bytes,
                measured_bytes=peak_bytes,
                predicted_s=predicted.step_time_s,
                measured_s=step_s,
            )
        )
    return rows


def measure_by_world(
    plans: list[Plan],
    rounds: int,
    progress: bool = True,
    sweep=None,
    workload: Workload = DEMO_WORKLOAD,
):
    """`measure_plans` of every plan, in one world per world size, the calibration of `sweep` (None:
    none) in the rounds of the smallest: (its Measurements or None, [(peak bytes, step s)] in `plans`' order)."""
    measured: dict[int, tuple[int, float]] = {}
    measurements = None
    for world_size in sorted({plan.world_size for plan in plans}):
        indices = [index for index, plan in enumerate(plans) if plan.world_size == world_size]
        calibrated, found = measure_plans(
            [plans[index] for index in indices],
            world_size,
            rounds,
            None if measurements else sweep,
            progress=progress,
            workload=workload,
        )
        measurements = measurements or calibrated
        measured.update(zip(indices, found))
    return measurements, [measured[index] for index in range(len(plans))]


def measure_accuracy(
    hardware,
    world_size: int = 2,
    rounds: int = 3,
    progress: bool = True,
    workload: Workload = DEMO_WORKLOAD,
) -> list[Accuracy]:
    """Every plan kind of `workload` (the demo GPT), predicted on `hardware` and measured on `world_size` CPU ranks."""
    chain, plans = demo_chain_and_plans(world_size, workload)
    _, measured = measure_plans(plans, world_size, rounds, progress=progress, workload=workload)
    return _again_where_slow(chain, plans, measured, hardware, None, rounds, progress, workload)


def measure_memory_accuracy(
    hardware, precision: MixedPrecision, progress: bool = True
) -> list[Accuracy]:
    """Every plan kind of the demo GPT over 2 ranks, and every mesh kind of 2 ranks (MESH_KINDS), computing in
    `precision`: peak memory predicted on `hardware` beside the measured, in one world (step time is not
    measured: NaN; measure_accuracy and measure_mesh_accuracy time the steps)."""
    chain, plans = demo_chain_and_plans(2, DEMO_WORKLOAD, precision)
    two_ranks = [
        name
        for name, mesh in MESH_KINDS.items()
        if mesh.get("dp", 1) * mesh.get("dp_replicate", 1) * mesh.get("tp", 1) == 2
    ]
    _, meshes = demo_mesh_plans(DEMO_WORKLOAD, two_ranks, precision)
    plans += list(meshes.values())
    _, measured = measure_plans(plans, 2, 0, progress=progress)
    return compare(chain, plans, measured, hardware, [*KIND_NAMES, *meshes])


def measure_mesh_accuracy(hardware, rounds: int = 3, progress: bool = True) -> list[Accuracy]:
    """Every mesh kind of the demo GPT (MESH_KINDS), predicted on `hardware` and measured on CPU ranks."""
    chain, named = demo_mesh_plans()
    plans = list(named.values())
    _, measured = measure_by_world(plans, rounds, progress)
    return _again_where_slow(chain, plans, measured, hardware, list(named), rounds, progress)


def measure_hand_plans(
    workload: Workload, meshes: dict[str, tuple[dict[str, Any], Checkpoint]], rounds: int = 1
) -> list[Accuracy]:
    """Each named plan of `workload`, written by hand (manual_plan's mesh keywords, every unit's
    checkpointing), trained for `rounds` timed steps after a warm-up (none: memory alone, step time
    NaN) in one world per world size, beside its prediction on cpu-gloo."""
    from shardplan.frontend.passes import analyze
    from shardplan.runtime.manual import manual_plan

    entry = workload.build()
    chain = analyze(entry.model, entry.args, entry.kwargs)
    plans = [
        manual_plan(
            entry.model,
            workload.units(chain),
            **mesh,
            checkpoints=(checkpoint,),
            example_inputs=entry.args,
            example_kwargs=entry.kwargs,
        )
        for mesh, checkpoint in meshes.values()
    ]
    _, measured = measure_by_world(plans, rounds, progress=False, workload=workload)
    return compare(chain, plans, measured, get_hardware("cpu-gloo"), list(meshes))


def _again_where_slow(
    chain: BlockChain,
    plans: list[Plan],
    measured: list[tuple[int, float]],
    hardware,
    kinds: "list[str] | None",
    rounds: int,
    progress: bool,
    workload: Workload = DEMO_WORKLOAD,
) -> list[Accuracy]:
    """The rows of `compare`, where kinds whose step time misses STEP_TIME_BAND were measured once more
    in a world of their own and keep their faster time: a burst of other work on the machine lengthens
    one world's rounds, not the model's cost (memory is measured once: it does not depend on the
    machine's load)."""
    rows = compare(chain, plans, measured, hardware, kinds)
    low, high = STEP_TIME_BAND
    again = [index for index, row in enumerate(rows) if not low <= row.time_ratio <= high]
    if again:
        _, remeasured = measure_by_world(
            [plans[index] for index in again], rounds, progress, workload=workload
        )
        for index, (_, step_s) in zip(again, remeasured):
            measured[index] = (measured[index][0], min(measured[index][1], step_s))
        rows = compare(chain, plans, measured, hardware, kinds)
    return rows


def accuracy_table(rows: list[Accuracy], title: str) -> Table:
    table = Table(title=title)
    for column in (
        "plan kind",
        "memory pred",
        "memory meas",
        "ratio",
        "step pred ms",
        "step meas ms",
        "ratio",
    ):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row.kind,
            format_bytes(row.predicted_bytes),
            format_bytes(row.measured_bytes),
            f"{row.memory_ratio:.2f}",
            f"{row.predicted_s * 1e3:.0f}",
            f"{row.measured_s * 1e3:.0f}",
            f"{row.time_ratio:.2f}",
        )
    return table


PIPELINE_KINDS: dict[str, dict[str, Any]] = {
    "pp2 gpipe m4": dict(schedule="gpipe", micro_batches=4, checkpoints=(Checkpoint.NONE,)),
    "pp2 gpipe m2 selective": dict(
        schedule="gpipe", micro_batches=2, checkpoints=(Checkpoint.SELECTIVE,)
    ),
    "pp2 1f1b m8": dict(schedule="1f1b", micro_batches=8, checkpoints=(Checkpoint.NONE,)),
    "pp2 1f1b m4 full": dict(schedule="1f1b", micro_batches=4, checkpoints=(Checkpoint.FULL,)),
}
"""Pipelined kinds of the demo GPT: 2 stages of one rank each (dp 1), every unit FULL_SHARD (at dp 1 it
gathers nothing), as runtime.manual_plan's arguments. The demo's tight budget picks such a plan."""


def demo_pipeline_plans(
    precision: MixedPrecision = MixedPrecision(),
) -> tuple[BlockChain, dict[str, Plan]]:
    """The demo GPT's analysed chain and a plan of every pipelined kind (PIPELINE_KINDS), one unit per block,
    computing in `precision`."""
    from shardplan.frontend.passes import analyze
    from shardplan.runtime.manual import manual_plan

    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=precision.param_dtype)
    groups = zoo.gpt_units(zoo.DEMO_GPT.n_layer)
    return chain, {
        name: manual_plan(
            entry.model,
            groups,
            dp=1,
            pp=2,
            strategies=(ShardStrategy.FULL_SHARD,),
            example_inputs=entry.args,
            example_kwargs=entry.kwargs,
            precision=precision,
            **kind,
        )
        for name, kind in PIPELINE_KINDS.items()
    }


def stage_peaks_job(device, report, plan_jsons: list[str]) -> list[list[int]]:
    """Rank job: every plan's peak memory (MemTracker) on each rank, after a warm-up step. Only units that
    reduce-scatter: MemTracker does not see what lives before the step unless told, and a replicated
    unit's gradient accumulator (kept between steps) is first touched after a pipelined step's peak."""
    from shardplan.runtime import parallelize
    from shardplan.runtime.collectives import all_gather_object
    from shardplan.runtime.measure import peak_step_bytes

    peaks = []
    for plan_json in plan_jsons:
        torch.manual_seed(0)  # the same initial weights on every rank
        entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
        ids = torch.randint(
            0,
            zoo.DEMO_GPT.vocab_size,
            entry.args[0].shape,
            generator=torch.Generator().manual_seed(1),
        )
        program = parallelize(entry.model, Plan.from_json(plan_json), device=device)
        optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
        step = functools.partial(_train_step, program, optimizer, ids)
        step()  # warm-up: allocates the optimizer state, as every later step has it
        grads = [p.grad for p in program.parameters() if p.grad is not None]  # kept between steps
        peaks.append(
            all_gather_object(
                peak_step_bytes(step, entry.model, optimizer, *program.parameters(), *grads)
            )
        )
        report("plan")
    return peaks


def measure_pipeline_accuracy(
    hardware, progress: bool = True, precision: MixedPrecision = MixedPrecision()
) -> list[Accuracy]:
    """Every pipelined kind of the demo GPT (PIPELINE_KINDS) computing in `precision`: each stage's peak
    memory predicted on `hardware` beside its rank's measured one (a row per stage, "kind/stage i"); step
    time is not measured (NaN: bench_pipeline.py times pipelines)."""
    from shardplan.compile import evaluate
    from shardplan.runtime.launch import run_world

    chain, named = demo_pipeline_plans(precision)
    measured = run_world(
        stage_peaks_job,
        ([plan.to_json() for plan in named.values()],),
        world_size=2,
        backend="gloo",
        total_steps=len(named),
        progress=progress,
        description="pipelined steps",
    )
    rows = []
    for (kind, plan), peaks in zip(named.items(), measured):
        units = evaluate(
            chain, plan, hardware
        ).units  # each stage's peak is one of its units' forward or backward events
        for stage, peak in enumerate(peaks):
            predicted = max(
                max(unit.forward_bytes, unit.backward_bytes)
                for unit in units
                if plan.stage_of_unit[unit.unit] == stage
            )
            rows.append(
                Accuracy(
                    kind=f"{kind}/stage {stage}",
                    predicted_bytes=predicted,
                    measured_bytes=peak,
                    predicted_s=math.nan,
                    measured_s=math.nan,
                )
            )
    return rows


OTHER_SHAPES = ((2, 64), (4, 256), (8, 96))
"""(replica batch, sequence length) pairs beside HF_WORKLOADS' 4 x 128: fewer and shorter, longer,
more and shorter."""


def measure_shape_accuracy(
    workload: Workload,
    precision: MixedPrecision,
    kinds: tuple[str, ...] = ("full_shard/none", "shard_grad_op/full"),
    shapes: tuple[tuple[int, int], ...] = OTHER_SHAPES,
    progress: bool = True,
) -> list[Accuracy]:
    """Plans of `kinds` made at `workload`'s own shape and priced at each of `shapes` from one
    sequence fit (compile.sequence_fit, solver/shapes.py), beside training at that shape, all in one
    world of 2 ranks; a row's kind reads "kind @ batch x length"."""
    from shardplan.compile import sequence_fit
    from shardplan.frontend.shapes import inputs_at
    from shardplan.solver.shapes import evaluate_at

    chain, plans = demo_chain_and_plans(2, workload, precision)
    planned = [
        dataclasses.replace(plan, inputs=chain.inputs)
        for kind, plan in zip(KIND_NAMES, plans)
        if kind in kinds
    ]
    fit = sequence_fit(workload.build().model, planned[0])
    hardware = shared_cores(get_hardware("cpu-gloo"), 2, machine_cores())
    cases = [
        (kind, plan, batch, length)
        for batch, length in shapes
        for kind, plan in zip(kinds, planned)
    ]
    _, measured = measure_plans(
        [dataclasses.replace(plan, inputs=inputs_at(plan.inputs, b, n)) for _, plan, b, n in cases],
        2,
        1,
        progress=progress,
        workload=tuple(
            dataclasses.replace(workload, options=(*workload.options, ("batch", b), ("seq", n)))
            for _, _, b, n in cases
        ),
    )
    rows = []
    for (kind, plan, batch, length), (peak_bytes, step_s) in zip(cases, measured):
        predicted = evaluate_at(fit, plan, micro_batch=batch, length=length, hardware=hardware)
        rows.append(
            Accuracy(
                kind=f"{kind} @ {batch} x {length}",
                predicted_bytes=predicted.peak_bytes,
                measured_bytes=peak_bytes,
                predicted_s=predicted.step_time_s,
                measured_s=step_s,
            )
        )
    return rows
