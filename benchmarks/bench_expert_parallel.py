"""Expert parallelism: predicted vs measured on this machine, and what the solver picks for a mixture
of experts on GPUs.

    .venv/bin/python benchmarks/bench_expert_parallel.py                 # both parts
    .venv/bin/python benchmarks/bench_expert_parallel.py --measured      # the CPU part alone
    .venv/bin/python benchmarks/bench_expert_parallel.py --planned

--measured: the example-sized Hugging Face Mixtral (shardplan.calibration.accuracy.HF_WORKLOADS
"hf-mixtral": 4 layers, hidden 256, top-2 of 4 experts, each replica's batch 4 x 128 tokens) on 2 gloo
ranks at dp 2, at dp 2 × ep 2, and at dp 2 × ep 2 with every unit checkpointed; peak memory is
MemTracker's (every tensor on the rank, the largest over the ranks), one training step after a
warm-up, beside compile.evaluate on the built-in cpu-gloo profile. Step time is shown, not held
(other work on the cores lengthens it).

--planned: a Qwen3-MoE-shaped model (2 layers, hidden 1024, 32 experts of width 512, top-4, 4 x 512
tokens a replica) captured on CPU, planned by the solver for 8 x h100-80g in float32: the chosen mesh
and its figures, and the runner-ups (the fastest plan of every other tp, cp and ep degree). A
DeepSeek-V3 shape at 256 GPUs, captured on the meta device: bench_plans_at_scale.py.
"""

import argparse

from rich.console import Console
from rich.table import Table

from shardplan import get_hardware
from shardplan.calibration.accuracy import HF_WORKLOADS, accuracy_table, measure_hand_plans
from shardplan.common.sizes import format_bytes
from shardplan.compile import solve
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint

MEASURED_MESHES = {
    "dp2": (dict(dp=2), Checkpoint.NONE),
    "dp2 ep2": (dict(dp=2, ep=2), Checkpoint.NONE),
    "dp2 ep2 full checkpoint": (dict(dp=2, ep=2), Checkpoint.FULL),
}
"""Name → (runtime.manual_plan's mesh, every unit's checkpointing); every unit FULL_SHARD."""
PLANNED_SHAPE = dict(
    num_hidden_layers=2,
    hidden_size=1024,
    intermediate_size=3072,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=32000,
)
"""A Qwen3-MoE layout at half Qwen3-30B-A3B's width and a quarter of its experts, 2 layers: small
enough to build on CPU."""


def measured(console: Console) -> None:
    rows = measure_hand_plans(HF_WORKLOADS["hf-mixtral"], MEASURED_MESHES)
    console.print(
        accuracy_table(rows, "hf-mixtral, 2 gloo ranks (cpu-gloo): predicted vs measured")
    )


def planned(console: Console) -> None:
    length = 512
    entry = zoo.hf_architecture("qwen3-moe", batch=4, seq=length, **PLANNED_SHAPE)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    plan = solve(chain, 8, hardware=get_hardware("h100-80g"))
    predicted = plan.predicted
    table = Table(title=f"Qwen3-MoE-shaped, 4 x {length} tokens per replica, 8 x h100-80g")
    for column in ("plan", "step", "peak"):
        table.add_column(column, justify="left" if column == "plan" else "right")
    table.add_row(
        f"chosen: {plan.mesh.describe()}",
        f"{predicted.step_time_s:.3g} s",
        format_bytes(predicted.peak_bytes),
    )
    for alternative in plan.reasoning.runner_ups:
        table.add_row(
            alternative.description,
            f"{alternative.step_time_s:.3g} s",
            format_bytes(alternative.peak_bytes),
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measured", action="store_true", help="the CPU part alone")
    parser.add_argument("--planned", action="store_true", help="the GPU plans alone")
    options = parser.parse_args()
    console = Console(width=140)
    both = not (options.measured or options.planned)
    if options.measured or both:
        measured(console)
    if options.planned or both:
        planned(console)


if __name__ == "__main__":
    main()
