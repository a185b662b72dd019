"""Predicted vs measured memory at shapes other than the plan's: one sequence fit prices them all.

    .venv/bin/python benchmarks/bench_shapes.py            # fp32 and bf16 mixed precision

Hugging Face Llama (accuracy.HF_WORKLOADS' size: 4 layers, hidden 256) under hand-written plans made
at 4 x 128 tokens per replica, priced at accuracy.OTHER_SHAPES by compile.sequence_fit +
solver.shapes.evaluate_at (three analyses at 32, 64 and 128 tokens), and trained at each shape on 2
gloo ranks; peak memory is MemTracker's over a step after a warm-up step, the largest over the ranks.
"""

from rich.console import Console

from shardplan.calibration.accuracy import HF_WORKLOADS, accuracy_table, measure_shape_accuracy
from shardplan.plan import BF16_MIXED, MixedPrecision


def main() -> None:
    console = Console(width=120)
    for precision in (MixedPrecision(), BF16_MIXED):
        rows = measure_shape_accuracy(HF_WORKLOADS["hf-llama"], precision)
        console.print(
            accuracy_table(
                rows,
                f"Llama planned at 4 x 128, priced at other shapes, {precision.param_dtype} compute, "
                "2 gloo ranks (cpu-gloo; step time from one step)",
            )
        )
        ratios = [row.memory_ratio for row in rows]
        console.print(f"memory predicted / measured: {min(ratios):.3f} - {max(ratios):.3f}")


if __name__ == "__main__":
    main()
