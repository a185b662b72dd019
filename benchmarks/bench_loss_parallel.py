"""Predicted vs measured peak memory of the loss on vocabulary-sharded logits, on this machine.

    .venv/bin/python benchmarks/bench_loss_parallel.py                  # vocabulary 8192
    .venv/bin/python benchmarks/bench_loss_parallel.py --vocab 32768 --layers 2

A Hugging Face Llama (hidden 256, MLP 688, 4 query and 2 kv heads, 4 x 128 tokens a rank) over tp 2
with its embedding and head vocab-parallel, trained on 2 gloo ranks in float32 and in bf16 mixed
precision: its logits gathered whole before the model's loss (loss_parallel off), the loss on the
head's vocabulary slices, and the same under sequence parallelism ([Note: loss on sharded logits] in
shardplan/runtime/vocab_parallel_loss.py). Peak memory is MemTracker's after a warm-up step, the largest
over the ranks; the prediction is compile.evaluate on the built-in cpu-gloo profile. Step times come
from one step each (shown, not held).
"""

import argparse

from rich.console import Console

from shardplan import get_hardware
from shardplan.calibration.accuracy import Workload, accuracy_table, compare, measure_plans
from shardplan.frontend.passes import analyze
from shardplan.plan import BF16_MIXED, MixedPrecision
from shardplan.runtime.manual import manual_plan

KINDS = {
    "tp2 vocab, logits gathered": dict(tp=2, vocab_parallel=True, loss_parallel=False),
    "tp2 vocab, sharded loss": dict(tp=2, vocab_parallel=True),
    "tp2 sp vocab, sharded loss": dict(tp=2, sequence_parallel=True, vocab_parallel=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=8192, help="the vocabulary's size")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers")
    options = parser.parse_args()
    workload = Workload(
        name="hf-llama",
        options=(
            ("n_layer", options.layers),
            ("d_model", 256),
            ("ffn", 688),
            ("vocab", options.vocab),
            ("batch", 4),
            ("seq", 128),
        ),
    )
    entry = workload.build()
    console = Console()
    for precision in (MixedPrecision(), BF16_MIXED):
        chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=precision.param_dtype)
        plans = [
            manual_plan(
                entry.model,
                workload.units(chain),
                dp=1,
                **mesh,
                precision=precision,
                example_inputs=entry.args,
                example_kwargs=entry.kwargs,
            )
            for mesh in KINDS.values()
        ]
        _, measured = measure_plans(plans, 2, 1, workload=workload)
        rows = compare(chain, plans, measured, get_hardware("cpu-gloo"), list(KINDS))
        console.print(
            accuracy_table(
                rows, f"Llama, vocabulary {options.vocab}, computing in {precision.param_dtype}"
            )
        )


if __name__ == "__main__":
    main()
