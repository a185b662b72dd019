"""Predicted against measured on one CUDA GPU: a ~1B Llama's peak memory and step time under six plan kinds.

    .venv/bin/python benchmarks/gpu_check.py --hardware h200 --out gpu_check.json   # one H200 (h100-80g: one H100)
    .venv/bin/python benchmarks/gpu_check.py --cpu --out /tmp/gpu_check.json        # the same code on CPU, gloo, tiny

What no published table gives: CUDA's own allocator statistics (torch.cuda.max_memory_allocated and
max_memory_reserved) and the step time of each plan kind of KINDS, on shardplan's runtime and on
backend "fsdp2" (torch's fully_shard on the same units; it runs REPLICATE as SHARD_GRAD_OP), beside
compile.evaluate's prediction on the built-in profile (--hardware). The model is a Hugging Face Llama
of GPU_SIZE (hidden 2048, 16 layers, 32 query and 8 kv heads, MLP 8192, vocabulary 32000 untied:
1.10B parameters, Llama-3.2-1B's shape with Llama-2's vocabulary), each step 8 x 2048 tokens, trained
with AdamW over fp32 master weights computing in bfloat16 and reducing in float32, one unit per block
of the chain analysed in bfloat16, at world 1 over NCCL: what one lent GPU can hold. Predicted peaks
run 24-51 GiB on h100-80g, so every kind fits an 80 GiB GPU.

Each kind builds the model on the meta device and lets parallelize materialize it on the GPU; after
WARMUP steps (the first allocates the optimizer state), every timed step runs between
torch.cuda.synchronize calls and its peak is read after resetting the allocator's peak statistics,
the largest kept; the step time is the median. Everything is freed (gc, empty_cache) before the next
kind. A kind that fails prints its error and the run moves on; a rank that dies takes only its kind:
the rest run in a new world. Each row is printed and written to --out as it is measured, so a run cut
short keeps what it measured.

--cpu (the default without CUDA) runs the same code over gloo at CPU_SIZE, where no allocator counts
memory: the measured peak is MemTracker's (shardplan.runtime.measure) and reserved memory is absent.
tests/test_gpu_check.py runs it, so the GPU path keeps working between the days a GPU is lent.

Estimated on one H100 (an H200 computes as fast, with more memory): about 20 s to start and
analyse, then per kind about 10 s to build, materialize and shard the model and WARMUP + STEPS steps
of 0.4-0.9 s; 12 runs in 3-4 minutes, under 5 minutes in all.
"""

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardplan.calibration.accuracy import Workload  # noqa: E402
from shardplan.common.files import parse_json, read_text, write_text_atomically  # noqa: E402
from shardplan.common.sizes import format_bytes  # noqa: E402
from shardplan.compile import evaluate  # noqa: E402
from shardplan.costmodel.hardware import get_hardware  # noqa: E402
from shardplan.frontend.passes import analyze  # noqa: E402
from shardplan.plan import BF16_MIXED, Checkpoint, Plan, ShardStrategy  # noqa: E402
from shardplan.runtime.launch import run_world  # noqa: E402
from shardplan.runtime.manual import manual_plan  # noqa: E402

KINDS = (
    (ShardStrategy.FULL_SHARD, Checkpoint.NONE),
    (ShardStrategy.FULL_SHARD, Checkpoint.SELECTIVE),
    (ShardStrategy.FULL_SHARD, Checkpoint.FULL),
    (ShardStrategy.SHARD_GRAD_OP, Checkpoint.NONE),
    (ShardStrategy.SHARD_GRAD_OP, Checkpoint.FULL),
    (ShardStrategy.REPLICATE, Checkpoint.NONE),
)
"""Every checkpointing under FULL_SHARD (the activations' share of the peak), and the other ways to hold
parameters at world 1: SHARD_GRAD_OP keeps each unit's gathered bfloat16 copy from its forward to its
backward, REPLICATE (DDP, NO_SHARD) gathers nothing (backend fsdp2 runs it as SHARD_GRAD_OP). ZeRO-1
(SHARD_OPTIMIZER) is left out: at world 1 the cost model prices it within 2% of REPLICATE."""
BACKENDS = ("shardplan", "fsdp2")


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaSize:
    """A Hugging Face Llama's shape and one step's batch (zoo.hf_llama's arguments)."""

    n_layer: int
    d_model: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    batch: int
    seq: int


GPU_SIZE = LlamaSize(
    n_layer=16, d_model=2048, ffn=8192, heads=32, kv_heads=8, vocab=32000, batch=8, seq=2048
)
"""1.10B parameters; 8 x 2048 tokens make activations the larger part of the peak without checkpointing
(FULL_SHARD: 49 GiB predicted, 16.5 GiB of it fp32 parameters, gradients and AdamW states)."""
CPU_SIZE = LlamaSize(
    n_layer=2, d_model=128, ffn=344, heads=4, kv_heads=2, vocab=512, batch=2, seq=128
)
"""Small enough that twelve runs on one CPU rank take seconds."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Run:
    """One plan kind on one backend, as the rank job measures it."""

    kind: str
    """"strategy/checkpoint", as accuracy.KIND_NAMES spells it."""
    backend: str
    plan_json: str
    predicted_bytes: int
    predicted_s: float


def workload(size: LlamaSize) -> Workload:
    """`size` as a zoo workload on the meta device: planning allocates nothing, parallelize materializes it."""
    return Workload(
        name="hf-llama", options=(*dataclasses.asdict(size).items(), ("device", "meta"))
    )


def planned_runs(size: LlamaSize, hardware: str) -> tuple[list[Run], dict[str, Any]]:
    """Every (kind, backend) of KINDS x BACKENDS with its prediction on `hardware`, and the model's facts."""
    entry = workload(size).build()
    start = time.perf_counter()
    chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=BF16_MIXED.param_dtype)
    analysis_s = time.perf_counter() - start
    groups = workload(size).units(chain)
    runs = []
    for strategy, checkpoint in KINDS:
        plan = manual_plan(
            entry.model,
            groups,
            dp=1,
            strategies=(strategy,),
            checkpoints=(checkpoint,),
            precision=BF16_MIXED,
        )
        predicted = evaluate(chain, plan, hardware)
        runs += [
            Run(
                kind=f"{strategy.value}/{checkpoint.value}",
                backend=backend,
                plan_json=plan.to_json(),
                predicted_bytes=predicted.peak_bytes,
                predicted_s=predicted.step_time_s,
            )
            for backend in BACKENDS
        ]
    model = dict(
        dataclasses.asdict(size),
        parameters=sum(p.numel() for p in entry.model.parameters()),
        units=len(groups),
        analysis_s=round(analysis_s, 2),
    )
    return runs, model


def check_job(
    device: torch.device,
    report,
    runs: list[Run],
    size: LlamaSize,
    warmup: int,
    steps: int,
    out: str,
    document: dict[str, Any],
) -> None:
    """Rank job (runtime.launch.run_world, world 1; `report` unused): measure every run in turn, printing
    each row and rewriting `out` with `document` and the rows so far after each."""
    document["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for run in runs:
        start = time.perf_counter()
        try:
            row = measure(device, run, size, warmup, steps)
        except (
            Exception
        ) as error:  # one kind's failure (out of memory, say) must not cost the others
            traceback.print_exc()
            row = failed_row(run, f"{type(error).__name__}: {error}")
        release(device)
        row["elapsed_s"] = round(time.perf_counter() - start, 2)
        document["rows"].append(row)
        write_text_atomically(out, json.dumps(document, indent=2) + "\n")
        print(table_line(row), flush=True)


def measure(
    device: torch.device, run: Run, size: LlamaSize, warmup: int, steps: int
) -> dict[str, Any]:
    """`run`'s plan trained on this rank: its peak memory and median step time beside the prediction."""
    from shardplan.runtime import parallelize
    from shardplan.runtime.measure import peak_step_bytes, synchronize

    held_before = (
        torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    )  # 0 unless a kind leaked
    torch.manual_seed(0)
    entry = workload(size).build()
    ids = torch.randint(
        0, size.vocab, (size.batch, size.seq), generator=torch.Generator().manual_seed(1)
    ).to(device)
    program = parallelize(
        entry.model, Plan.from_json(run.plan_json), backend=run.backend, device=device
    )
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-4)

    def train_step() -> None:
        program.step(ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad(
            set_to_none=False
        )  # gradients stay allocated between steps, as the cost model counts them

    for _ in range(warmup):
        train_step()
    seconds, allocated, reserved = [], 0, 0
    for _ in range(steps):
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        started = time.perf_counter()
        train_step()
        synchronize(device)
        seconds.append(time.perf_counter() - started)
        if device.type == "cuda":
            allocated = max(allocated, torch.cuda.max_memory_allocated(device))
            reserved = max(reserved, torch.cuda.max_memory_reserved(device))
    if (
        device.type != "cuda"
    ):  # no allocator statistics: MemTracker counts every tensor, once more and untimed
        grads = [p.grad for p in program.parameters() if p.grad is not None]
        allocated = peak_step_bytes(
            train_step, entry.model, optimizer, *program.parameters(), *grads
        )
    measured_s = statistics.median(seconds)
    return dict(
        kind=run.kind,
        backend=run.backend,
        predicted_bytes=run.predicted_bytes,
        allocated_bytes=allocated,
        reserved_bytes=reserved if device.type == "cuda" else None,
        allocated_ratio=run.predicted_bytes / allocated,
        reserved_ratio=run.predicted_bytes / reserved if reserved else None,
        predicted_s=run.predicted_s,
        measured_s=measured_s,
        step_times_s=seconds,
        time_ratio=run.predicted_s / measured_s,
        held_before_bytes=held_before,
        error=None,
    )


def failed_row(run: Run, error: str) -> dict[str, Any]:
    return dict(
        kind=run.kind,
        backend=run.backend,
        predicted_bytes=run.predicted_bytes,
        allocated_bytes=None,
        reserved_bytes=None,
        allocated_ratio=None,
        reserved_ratio=None,
        predicted_s=run.predicted_s,
        measured_s=None,
        step_times_s=[],
        time_ratio=None,
        held_before_bytes=None,
        error=error,
    )


def release(device: torch.device) -> None:
    """Free what the last kind held: programs are reference cycles ([Note: shutdown] in collectives.py),
    and the caching allocator keeps freed blocks reserved until emptied."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


COLUMNS = (
    ("plan kind", 22),
    ("backend", 9),
    ("pred peak", 10),
    ("max alloc", 10),
    ("ratio", 5),
    ("max resv", 10),
    ("ratio", 5),
    ("pred ms", 8),
    ("meas ms", 8),
    ("ratio", 5),
    ("took s", 6),
)


def table_header() -> str:
    return "  ".join(f"{name:>{width}}" for name, width in COLUMNS)


def table_line(row: dict[str, Any]) -> str:
    """One row of the table; ratios are predicted / measured, "-" where nothing was measured."""

    def size(value):
        return format_bytes(value) if value is not None else "-"

    def ratio(value):
        return f"{value:.2f}" if value is not None else "-"

    def ms(value):
        return f"{value * 1e3:.1f}" if value is not None else "-"

    cells = (
        row["kind"],
        row["backend"],
        size(row["predicted_bytes"]),
        size(row["allocated_bytes"]),
        ratio(row["allocated_ratio"]),
        size(row["reserved_bytes"]),
        ratio(row["reserved_ratio"]),
        ms(row["predicted_s"]),
        ms(row["measured_s"]),
        ratio(row["time_ratio"]),
        f"{row['elapsed_s']:.1f}",
    )
    line = "  ".join(f"{cell:>{width}}" for cell, (_, width) in zip(cells, COLUMNS))
    return line + (f"\n    failed: {row['error'].splitlines()[0]}" if row["error"] else "")


def measure_all(
    runs: list[Run], size: LlamaSize, options, document: dict[str, Any], backend: str
) -> dict[str, Any]:
    """Every run in one world; where a rank dies (a crash no exception reaches), the run it was on is
    recorded as failed and the rest go on in a new world. Returns the document with every row."""
    write_text_atomically(options.out, json.dumps(document, indent=2) + "\n")  # no older run's rows
    while len(document["rows"]) < len(runs):
        done = len(document["rows"])
        try:
            run_world(
                check_job,
                (runs[done:], size, options.warmup, options.steps, options.out, document),
                world_size=1,
                backend=backend,
                total_steps=len(runs) - done,
                progress=False,
            )
            death = None
        except Exception as error:  # the rank died: the file holds every row it finished
            death = f"the rank died: {type(error).__name__}: {error}"
        document = parse_json(read_text(options.out, "gpu check"), "gpu check")
        if death:
            row = failed_row(runs[len(document["rows"])], death)
            row["elapsed_s"] = 0.0
            document["rows"].append(row)
            write_text_atomically(options.out, json.dumps(document, indent=2) + "\n")
            print(table_line(row), flush=True)
    return document


def summary(rows: list[dict[str, Any]]) -> str:
    """The ranges of every ratio over the measured rows, and the failed ones."""
    lines = []
    for name in ("allocated_ratio", "reserved_ratio", "time_ratio"):
        values = [row[name] for row in rows if row[name] is not None and math.isfinite(row[name])]
        if values:
            lines.append(
                f"{name.replace('_', ' ')} (predicted / measured): {min(values):.2f}-{max(values):.2f}"
            )
    failed = [f"{row['kind']} on {row['backend']}" for row in rows if row["error"]]
    lines.append(f"failed: {', '.join(failed) or '-'}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
    )
    parser.add_argument(
        "--cpu",
        action="store_true",
        help="run on CPU over gloo at the tiny size (the default without CUDA)",
    )
    parser.add_argument(
        "--hardware",
        help="the profile predictions use: a built-in name (h100-80g, h200, ...) or "
        "a calibrated profile's JSON (default: h100-80g on CUDA, cpu-gloo on CPU)",
    )
    parser.add_argument(
        "--out", default="gpu_check.json", help="the JSON written as rows are measured"
    )
    parser.add_argument("--batch", type=int, help="sequences a step (default: 8 on CUDA, 2 on CPU)")
    parser.add_argument(
        "--seq", type=int, help="tokens a sequence (default: 2048 on CUDA, 128 on CPU)"
    )
    parser.add_argument(
        "--warmup", type=int, default=2, help="untimed steps before the timed ones, per kind"
    )
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps per kind (their median is kept)"
    )
    options = parser.parse_args()
    on_cuda = torch.cuda.is_available() and not options.cpu
    size = GPU_SIZE if on_cuda else CPU_SIZE
    size = dataclasses.replace(size, batch=options.batch or size.batch, seq=options.seq or size.seq)
    hardware = options.hardware or ("h100-80g" if on_cuda else "cpu-gloo")
    backend = "nccl" if on_cuda else "gloo"
    started = time.perf_counter()
    runs, model = planned_runs(size, hardware)
    document: dict[str, Any] = dict(
        model=model,
        hardware=get_hardware(hardware).name,
        process_group=backend,
        world_size=1,
        precision=dataclasses.asdict(BF16_MIXED),
        optimizer="torch.optim.AdamW, its default implementation",
        warmup_steps=options.warmup,
        timed_steps=options.steps,
        rows=[],
    )
    print(
        f"Llama of {model['parameters']:,} parameters ({size.n_layer} layers, hidden {size.d_model}, "
        f"MLP {size.ffn}, {size.heads}/{size.kv_heads} heads, vocabulary {size.vocab}), "
        f"{size.batch} x {size.seq} tokens a step, {model['units']} units; bfloat16 compute, fp32 master weights "
        f"and reduction; world 1 over {backend}; "
        f"predicted on {hardware}; analysed in {model['analysis_s']:.1f} s; median of {options.steps} steps "
        f"after {options.warmup}",
        flush=True,
    )
    print(table_header(), flush=True)
    document = measure_all(runs, size, options, document, backend)
    print(summary(document["rows"]))
    print(f"took {time.perf_counter() - started:.0f} s; the table is in {options.out}", flush=True)


if __name__ == "__main__":
    main()
