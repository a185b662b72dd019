"""The GPU cost model against torchtitan's published FSDP2 runs: throughput on A100 and peak memory on H100.

    .venv/bin/python benchmarks/bench_published_torchtitan.py

torchtitan trains Llama models with FSDP2 (`fully_shard` on every transformer block and on the whole model),
bf16 parameters and fp32 gradient reduction, and has published two campaigns of plain FSDP runs, eager, in
bf16, without Float8 (ROWS, each with its source):
- docs/performance.md (mid 2024): Llama 3 8B and 70B at sequences of 8192, Llama 2 13B and 70B at 4096,
  each on 64 A100 80GB, tokens/s/GPU;
- benchmarks/llama3_h100_202412_torchtitan.md (December 2024), tables 1 and 3, first rows: Llama 3.1 8B at
  8192 on 8 and on 128 H100s of 96 GB HBM2e at 500 W, tokens/s/GPU and memory, the largest
  `torch.cuda.max_memory_reserved` of a run (torchtitan's logged "memory").

Every row becomes the plan it ran (runtime.manual_plan): the Llama shape as a `transformers` Llama on the meta
device, fp32 master weights, analyzed computing in bf16 over one GPU's batch; one unit per block, each
FULL_SHARD; its activation checkpointing: "full" every block, "selective layer" every second block (torchtitan's
`selective_ac_option = "2"`: blocks 1, 3, 5, ... counting from 0), "selective op" shardplan's selective_alternate
mode on every block (torchtitan's op policy: it keeps attention's outputs and every second matmul's of a block,
and recomputes the rest); AdamW; the loss as torchtitan takes it, cross entropy over fp32 logits, as
transformers' is.

What the plans leave out of the runs: torchtitan's root unit (the embedding, the final norm and the head under
one `fully_shard`) keeps the embedding gathered through the forward; the gradient clipping's norm.

The H100s ran at 500 W with HBM2e (2.4 TB/s): slower than the h100-80g profile's SXM5 at 700 W, by how much the
source does not say (its peak lies "between SXM and NVL"). Their throughput is printed against the profile's,
not scored; their memory is priced on the profile with the runs' 96 GB.
"""

import argparse
import dataclasses
import functools
import re
import statistics

from shardplan.calibration.accuracy import Workload
from shardplan.compile import evaluate
from shardplan.costmodel.hardware import get_hardware
from shardplan.frontend.chain import BlockChain
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint, Plan, Predicted, ShardStrategy
from shardplan.runtime.manual import manual_plan

GiB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LlamaShape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int


LLAMAS = {
    "llama3-8b": LlamaShape(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "llama3-70b": LlamaShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    "llama2-13b": LlamaShape(layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000),
    "llama2-70b": LlamaShape(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000),
}
"""torchtitan's Llama configurations (models/llama*/__init__.py: the feed-forward width is 8/3 of the hidden
times ffn_dim_multiplier, rounded up to multiple_of)."""

CHECKPOINTING = ("none", "selective layer", "selective op", "full")
PERFORMANCE_MD = "torchtitan docs/performance.md at 0413364"
H100_2024 = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    model: str
    seq: int
    local_batch: int
    gpus: int
    checkpointing: str
    tokens_per_s_per_gpu: float
    hardware: str
    memory_gib: float | None = None
    """The run's largest reserved memory (GiB), where published."""
    device_memory_bytes: int | None = None
    """The run's GPU memory where the profile's differs."""
    scored: bool = True
    """Whether the profile is the GPU the row ran on (its throughput is comparable)."""
    source: str

    def describe(self) -> str:
        return (
            f"{self.model} s={self.seq} lb={self.local_batch} n={self.gpus} {self.checkpointing} "
            f"on {self.hardware}"
        )


H100_96GB = 96 * 10**9
ROWS = (
    Row(model="llama3-8b", seq=8192, local_batch=1, gpus=64, checkpointing="selective layer",
        tokens_per_s_per_gpu=2904, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama3-8b", seq=8192, local_batch=1, gpus=64, checkpointing="selective op",
        tokens_per_s_per_gpu=2973, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama3-70b", seq=8192, local_batch=1, gpus=64, checkpointing="full",
        tokens_per_s_per_gpu=331, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama2-13b", seq=4096, local_batch=2, gpus=64, checkpointing="none",
        tokens_per_s_per_gpu=2162, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama2-13b", seq=4096, local_batch=2, gpus=64, checkpointing="selective layer",
        tokens_per_s_per_gpu=1914, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama2-13b", seq=4096, local_batch=2, gpus=64, checkpointing="selective op",
        tokens_per_s_per_gpu=1904, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama2-70b", seq=4096, local_batch=1, gpus=64, checkpointing="selective op",
        tokens_per_s_per_gpu=355, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama2-70b", seq=4096, local_batch=2, gpus=64, checkpointing="full",
        tokens_per_s_per_gpu=353, hardware="a100-80g", source=PERFORMANCE_MD),
    Row(model="llama3-8b", seq=8192, local_batch=2, gpus=8, checkpointing="selective op",
        tokens_per_s_per_gpu=5762, hardware="h100-80g", memory_gib=82.4,
        device_memory_bytes=H100_96GB, scored=False, source=H100_2024 + ", table 1"),
    Row(model="llama3-8b", seq=8192, local_batch=2, gpus=128, checkpointing="selective op",
        tokens_per_s_per_gpu=5605, hardware="h100-80g", memory_gib=67.0,
        device_memory_bytes=H100_96GB, scored=False, source=H100_2024 + ", table 3"),
)  # fmt: skip


def workload(row: Row) -> Workload:
    shape = LLAMAS[row.model]
    return Workload(
        name="hf-llama",
        options=(
            ("batch", row.local_batch),
            ("seq", row.seq),
            ("device", "meta"),
            ("n_layer", shape.layers),
            ("d_model", shape.hidden),
            ("ffn", shape.ffn),
            ("heads", shape.heads),
            ("kv_heads", shape.kv_heads),
            ("vocab", shape.vocab),
        ),
    )


def checkpoints(row: Row, units: list[tuple[str, ...]]) -> list[Checkpoint]:
    """Each unit's checkpointing: a decoder block (`model.layers.<i>`) as CHECKPOINTING's name says, any other
    unit (the embedding, the final norm, the head with the loss) none, as torchtitan wraps only the blocks."""
    per_block = {
        "none": lambda block: Checkpoint.NONE,
        "full": lambda block: Checkpoint.FULL,
        "selective op": lambda block: Checkpoint.SELECTIVE_ALTERNATE,
        "selective layer": lambda block: Checkpoint.FULL if block % 2 == 1 else Checkpoint.NONE,
    }[row.checkpointing]
    blocks = [re.fullmatch(r"model\.layers\.(\d+)", modules[0]) for modules in units]
    return [per_block(int(b.group(1))) if b else Checkpoint.NONE for b in blocks]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    row: Row
    plan: Plan
    predicted: Predicted

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.row.local_batch * self.row.seq / self.predicted.step_time_s

    @property
    def ratio(self) -> float:
        return self.tokens_per_s_per_gpu / self.row.tokens_per_s_per_gpu


@functools.lru_cache(maxsize=None)
def analyzed(spec: Workload) -> tuple[zoo.ZooModel, BlockChain]:
    """The model and its chain, analyzed once per shape in a run (rows differ in their plans alone)."""
    entry = spec.build()
    return entry, analyze(
        entry.model, entry.args, entry.kwargs, compute_dtype=BF16_MIXED.param_dtype
    )


def predict_row(row: Row) -> Outcome:
    spec = workload(row)
    entry, chain = analyzed(spec)
    units = spec.units(chain)
    plan = manual_plan(
        entry.model,
        units,
        dp=row.gpus,
        strategies=(ShardStrategy.FULL_SHARD,),
        checkpoints=checkpoints(row, units),
        precision=BF16_MIXED,
    )
    plan = dataclasses.replace(
        plan, fingerprint=chain.fingerprint, inputs=chain.inputs, optimizer="adamw"
    )
    hw = get_hardware(row.hardware)
    if row.device_memory_bytes:
        hw = dataclasses.replace(hw, device_memory_bytes=row.device_memory_bytes)
    return Outcome(row=row, plan=plan, predicted=evaluate(chain, plan, hw))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(LLAMAS), help="only these models")
    options = parser.parse_args()
    rows = [row for row in ROWS if not options.models or row.model in options.models]
    outcomes = [predict_row(row) for row in rows]
    print(
        "| model | seq | local batch | GPUs | checkpointing | GPU | published tok/s/GPU | predicted | "
        "pred / pub | published memory | predicted peak | pred / pub | peak GiB: state / gathered / "
        "activations / transient |"
    )
    print("|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---|")
    for o in outcomes:
        r, peak = o.row, o.predicted.peak_bytes / GiB
        memory = (
            f"{r.memory_gib} GiB | {peak:.1f} GiB | {peak / r.memory_gib:.2f}"
            if r.memory_gib
            else f"- | {peak:.1f} GiB | -"
        )
        ratio = f"{o.ratio:.2f}" if r.scored else f"({o.ratio:.2f})"
        terms = " / ".join(
            f"{o.predicted.memory_bytes[term] / GiB:.1f}"
            for term in ("sharded_state", "gathered_params", "activations", "transient")
        )
        print(
            f"| {r.model} | {r.seq} | {r.local_batch} | {r.gpus} | {r.checkpointing} | {r.hardware} | "
            f"{r.tokens_per_s_per_gpu:.0f} | {o.tokens_per_s_per_gpu:.0f} | {ratio} | {memory} | {terms} |"
        )
    scored = [o.ratio for o in outcomes if o.row.scored]
    if scored:
        print(f"\nscored rows' pred / pub throughput: median {statistics.median(scored):.2f}, "
              f"{min(scored):.2f}-{max(scored):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
