"""Context parallelism: predicted vs measured on this machine, and what the solver picks for a long
sequence on GPUs.

    .venv/bin/python benchmarks/bench_context_parallel.py                 # both parts
    .venv/bin/python benchmarks/bench_context_parallel.py --measured      # the CPU part alone
    .venv/bin/python benchmarks/bench_context_parallel.py --planned --seq 32768 131072

--measured: the example-sized Hugging Face LLaMA (shardplan.calibration.accuracy.HF_WORKLOADS
"hf-llama": 4 layers, hidden 256, each replica's batch 4 x 128 tokens) on 2 gloo ranks at dp 2, at
cp 2 and at cp 2 with every unit checkpointed; peak memory is MemTracker's (every tensor on the rank,
the largest over the ranks), one training step after a warm-up, beside compile.evaluate on the
built-in cpu-gloo profile. Step time is shown, not held (other work on the cores lengthens it).

--planned: a Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 query and 8 kv heads, ffn 14336,
vocabulary 128256) captured on the meta device at each --seq, one sequence per replica, planned by the
solver for 8 x h100-80g in bf16 mixed precision: the chosen mesh and its figures, and the runner-ups
(the fastest plan of every other tp and cp degree).
"""

import argparse
import re

from rich.console import Console
from rich.table import Table

from shardplan import get_hardware
from shardplan.calibration.accuracy import HF_WORKLOADS, accuracy_table, measure_hand_plans
from shardplan.common.sizes import format_bytes
from shardplan.compile import solve
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint

SAMPLES_A_STEP = re.compile(r", (\d+(?:\.\d+)?) samples a step")
"""Where a runner-up's description (solver/explain.py) says how many samples its step trains."""
MEASURED_MESHES = {
    "dp2": (dict(dp=2), Checkpoint.NONE),
    "cp2": (dict(dp=1, cp=2), Checkpoint.NONE),
    "cp2 full checkpoint": (dict(dp=1, cp=2), Checkpoint.FULL),
}
"""Name → (runtime.manual_plan's mesh, every unit's checkpointing); every unit FULL_SHARD."""


def measured(console: Console) -> None:
    rows = measure_hand_plans(HF_WORKLOADS["hf-llama"], MEASURED_MESHES)
    console.print(accuracy_table(rows, "hf-llama, 2 gloo ranks (cpu-gloo): predicted vs measured"))


def planned(console: Console, lengths: list[int]) -> None:
    hardware = get_hardware("h100-80g")
    for length in lengths:
        entry = zoo.hf_llama(
            n_layer=32,
            d_model=4096,
            ffn=14336,
            heads=32,
            kv_heads=8,
            vocab=128256,
            batch=1,
            seq=length,
            device="meta",
        )
        chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype="bfloat16")
        plan = solve(chain, 8, hardware=hardware, mixed_precision=BF16_MIXED)
        predicted = plan.predicted
        table = Table(
            title=f"Llama-3.1-8B shape, one {length}-token sequence per replica, 8 x h100-80g"
        )
        for column in ("plan", "step", "tokens/s/GPU", "peak"):
            table.add_column(column, justify="left" if column == "plan" else "right")
        tokens = plan.mesh.dp * length
        table.add_row(
            f"chosen: {plan.mesh.describe()}",
            f"{predicted.step_time_s:.3g} s",
            f"{tokens / predicted.step_time_s / 8:.0f}",
            format_bytes(predicted.peak_bytes),
        )
        for alternative in plan.reasoning.runner_ups:
            if alternative.description.startswith("expert default"):
                continue
            found = SAMPLES_A_STEP.search(alternative.description)
            assert found, f"no samples a step in {alternative.description!r}"
            samples = float(found.group(1))
            table.add_row(
                alternative.description[: found.start()] + alternative.description[found.end() :],
                f"{alternative.step_time_s:.3g} s",
                f"{samples * length / alternative.step_time_s / 8:.0f}",
                format_bytes(alternative.peak_bytes),
            )
        console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", action="store_true", help="the CPU part alone")
    parser.add_argument("--planned", action="store_true", help="the GPU plans alone")
    parser.add_argument(
        "--seq", type=int, nargs="+", default=[131072], help="sequence lengths planned"
    )
    options = parser.parse_args()
    console = Console(width=120)
    both = not (options.measured or options.planned)
    if options.measured or both:
        measured(console)
    if options.planned or both:
        planned(console, options.seq)


if __name__ == "__main__":
    main()
