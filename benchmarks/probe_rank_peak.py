"""Where a plan's peak is on a rank: live bytes after every op of one training step, around the peak.

    .venv/bin/python benchmarks/probe_rank_peak.py --kind tp2                      # hidden 512, 2 layers, 4 x 512 tokens
    .venv/bin/python benchmarks/probe_rank_peak.py --kind full_shard/full --checkpoints none full full full
    .venv/bin/python benchmarks/probe_rank_peak.py --model hf-gpt2 --kind full_shard/full

The GPT of `bench_mesh.py --gpt` (or a Hugging Face workload of shardplan.calibration.accuracy) under a plan kind, on
2 gloo ranks, trained as `bench_mesh.py --memory-only` trains it (shardplan.calibration.accuracy.trained_program, a
warm-up step, then the step measured, with what lives before it registered): MemTracker's total after
each op rank 0 dispatches (every tensor on the rank, MiB, and the change since the op before), from
`--before` ops before its peak to `--after` ops after it, beside compile.evaluate's prediction on the
built-in cpu-gloo profile (the peak, its terms and each unit's forward and backward event).
`--checkpoints` sets the units' checkpointing in turn (a plain kind's; unit i takes the (i mod n)th), to see
what one unit's checkpointing changes in the measured peak and in the predicted one.
"""

import argparse
import functools

import torch

from shardplan.calibration.accuracy import (
    HF_WORKLOAD_NAMES,
    KIND_NAMES,
    KINDS,
    MESH_KINDS,
    Workload,
    _train_step,
    demo_chain_and_plans,
    demo_mesh_plans,
    hf_workload,
    trained_program,
)
from shardplan.compile import evaluate
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint, MixedPrecision
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.measure import _TotalsOnly

MiB = 2**20


class _OpTrace(_TotalsOnly):
    """MemTracker's totals, read after each op: (op, live bytes on the rank's devices, its outputs' shapes)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, int, list[tuple[int, ...]]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        live = sum(
            snapshot["Total"]
            for device, snapshot in self._curr_mem_snap.items()
            if torch.device(device).type != "meta"
        )  # meta: the runtime's placeholders
        outputs = result if isinstance(result, (tuple, list)) else [result]
        self.ops.append(
            (str(func), live, [tuple(t.shape) for t in outputs if isinstance(t, torch.Tensor)][:2])
        )
        return result


def trace_job(device, report, plan_json: str, workload: Workload):
    """Rank job: rank 0's op trace of a step after a warm-up step (None on the other ranks)."""
    from shardplan.runtime.collectives import world

    model, program, optimizer, ids = trained_program(device, plan_json, workload)
    step = functools.partial(_train_step, program, optimizer, ids)
    step()
    grads = [p.grad for p in program.parameters() if p.grad is not None]
    tracker = _OpTrace()
    tracker.track_external(model, optimizer, *program.parameters(), *grads)
    with tracker:
        step()
    report(1)
    return tracker.ops if world().rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--gpt",
        type=int,
        nargs=5,
        metavar=("D_MODEL", "SEQ", "LAYERS", "VOCAB", "BATCH"),
        default=(512, 512, 2, 64, 4),
        help="the GPT at this shape (8 heads)",
    )
    parser.add_argument(
        "--model", choices=HF_WORKLOAD_NAMES, help="a Hugging Face workload instead"
    )
    parser.add_argument(
        "--kind", default="full_shard/full", choices=list(KIND_NAMES) + list(MESH_KINDS)
    )
    parser.add_argument(
        "--checkpoints",
        nargs="+",
        choices=[c.value for c in Checkpoint],
        help="each unit's checkpointing (a plain kind only)",
    )
    parser.add_argument(
        "--bf16", action="store_true", help="in bf16 mixed precision (fp32 master weights)"
    )
    parser.add_argument("--before", type=int, default=40, help="ops shown before the peak")
    parser.add_argument("--after", type=int, default=4, help="ops shown after the peak")
    options = parser.parse_args()
    torch.set_num_threads(1)
    if options.model:
        workload = hf_workload(options.model)
    else:
        d_model, seq, layers, vocab, batch = options.gpt
        config = zoo.GPTConfig(
            vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=8, d_model=d_model
        )
        workload = Workload(name="gpt", options=(("config", config), ("batch", batch)))
    precision = BF16_MIXED if options.bf16 else MixedPrecision()
    if options.kind in MESH_KINDS:
        if options.checkpoints:
            parser.error("--checkpoints takes a plain kind")
        chain, named = demo_mesh_plans(workload, [options.kind], precision)
        plan = named[options.kind]
    else:
        chain, plans = demo_chain_and_plans(2, workload, precision)
        plan = plans[KIND_NAMES.index(options.kind)]
        if options.checkpoints:
            entry = workload.build()
            strategy = KINDS[KIND_NAMES.index(options.kind)][0]
            plan = manual_plan(
                entry.model,
                workload.units(chain),
                dp=2,
                strategies=(strategy,),
                checkpoints=[Checkpoint(value) for value in options.checkpoints],
                precision=precision,
            )
    from shardplan.runtime.launch import run_world

    predicted = evaluate(chain, plan, "cpu-gloo")
    ops = run_world(
        trace_job,
        (plan.to_json(), workload),
        world_size=2,
        backend="gloo",
        total_steps=1,
        progress=False,
    )
    peak = max(range(len(ops)), key=lambda index: ops[index][1])
    print(
        f"{workload.options}, {options.kind}, units checkpointed {[unit.checkpoint.value for unit in plan.units]}"
    )
    print(
        f"predicted peak {predicted.peak_bytes / MiB:.2f} MiB: "
        + ", ".join(f"{name} {size / MiB:.2f}" for name, size in predicted.memory_bytes.items())
    )
    print(
        "each unit's forward / backward event: "
        + ", ".join(
            f"{unit.forward_bytes / MiB:.2f} / {unit.backward_bytes / MiB:.2f}"
            for unit in predicted.units
        )
    )
    print(f"measured peak on rank 0 {ops[peak][1] / MiB:.2f} MiB, op {peak} of {len(ops)}")
    first, last = max(0, peak - options.before), min(len(ops), peak + options.after + 1)
    previous = ops[first - 1][1] if first else 0
    for index in range(first, last):
        name, live, shapes = ops[index]
        print(
            f"{index:6d} {name:58s} {live / MiB:9.2f} {(live - previous) / MiB:+8.2f}  {shapes}"
            + ("  <- peak" if index == peak else "")
        )
        previous = live


if __name__ == "__main__":
    main()
