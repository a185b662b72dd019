"""The GPU cost model against llm-foundry's published FSDP throughput on A100 (MPT models, FSDP alone).

    .venv/bin/python benchmarks/bench_published_fsdp.py           # ../shared/data/published-fsdp/llm_foundry_a100.csv
    .venv/bin/python benchmarks/bench_published_fsdp.py --rows    # + every row's prediction and its terms
    .venv/bin/python benchmarks/bench_published_fsdp.py --data other.csv --models 125m 350m

Every row of llm-foundry's benchmark tables (scripts/train/benchmarking/README.md, January 2024; the data
set's README) becomes the plan it ran, written by hand (runtime.manual_plan): the MPT size as a GPT-2-style
`transformers` model (exact GELU, SDPA attention, vocabulary 50368, the embedding tied to the head, learned
positions as long as the sequence: its parameter count is the row's num_params) on the meta device in fp32
master weights, analyzed computing in bf16 (passes.analyze's compute_dtype) over one GPU's batch of a step
(micro_batch x grad_accum sequences); one unit per block of the chain (each embedding, each layer, the
final norm with the head and the loss), every unit the row's sharding strategy, full recomputation where
activation checkpointing is on, grad_accum micro-batches, dp = the row's GPUs, parameters gathered in bf16
and gradients reduced in fp32 (mp_mode DEFAULT) or bf16 (PURE), AdamW (OPTIMIZER). `compile.evaluate`
prices each plan on the GPU's profile (PROFILES) over the row's inter-node fabric (with_node_link_rate).

Printed per GPU type: predicted / measured tokens/s/GPU (median, p10, p90, p90 / p10), Kendall tau of
predicted against measured within each model size and their mean, and the rows predicted over the
device's usable memory (HardwareProfile.usable_memory_bytes: past the runtime's reservation, less the
allocator's fragmentation); then the median ratio by sequence length, and with --rows each row.

The model takes its loss as MPT does, with a fused cross entropy (FusedCrossEntropy: flash-attn's, llm-foundry's
default loss_fn), which keeps the bf16 logits alone, not transformers' causal LM loss, which keeps fp32 copies.
The rows' attention runs the kernel llm-foundry's benchmark script ran by default, the Triton FlashAttention, at
its published rates (ATTENTION_KERNELS; --attention-kernel sdpa prices it as the profile's FlashAttention-2, what
shardplan runs). What the plans leave out of the runs: Composer's FSDP (FSDP1) keeps the embeddings and the final norm in its root
unit; gradient clipping's norm is not priced.

Chains are analyzed once per distinct (size, sequence, batch) in a run and kept in --cache for later runs,
under a digest of the code that builds and analyzes them (analysis_digest: an edit to the cost model reuses
them, one to the analysis does not). The first run captures the data set's 107 chains on the meta device
(nothing allocated): 10-12 minutes on 2 busy cores; a rerun prices them in about 20 s.
"""

import argparse
import ast
import csv
import dataclasses
import functools
import hashlib
import inspect
import math
import os
import pickle
import re
import statistics
import sys
import time
from collections import defaultdict

import numpy as np
import torch
from scipy.stats import kendalltau

import shardplan
from shardplan.calibration.accuracy import Workload
from shardplan.compile import evaluate
from shardplan.costmodel.hardware import AttentionRate, HardwareProfile, SizeCurve, get_hardware
from shardplan.frontend.chain import BlockChain
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint, MixedPrecision, Plan, Predicted, ShardStrategy
from shardplan.runtime.manual import manual_plan

DEFAULT_DATA = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "shared",
    "data",
    "published-fsdp",
    "llm_foundry_a100.csv",
)
"""`<repo>/../shared/data/published-fsdp/llm_foundry_a100.csv`: the shared data set beside the checkout."""
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "shardplan", "bench_published_fsdp")
"""Where analyzed chains are kept between runs (analyzed), one folder per digest of the analysis's code."""
PACKAGE = os.path.dirname(os.path.abspath(shardplan.__file__))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MptSize:
    """An MPT model's shape (llm-foundry's scripts/train/yamls/pretrain/mpt-*.yaml)."""

    d_model: int
    layers: int
    heads: int


MPT_SIZES = {
    "125m": MptSize(d_model=768, layers=12, heads=12),
    "350m": MptSize(d_model=1024, layers=24, heads=16),
    "760m": MptSize(d_model=1536, layers=24, heads=12),
    "1b": MptSize(d_model=2048, layers=24, heads=16),
    "3b": MptSize(d_model=2560, layers=32, heads=20),
    "7b": MptSize(d_model=4096, layers=32, heads=32),
    "13b": MptSize(d_model=5120, layers=40, heads=40),
    "30b": MptSize(d_model=7168, layers=48, heads=56),
    "70b": MptSize(d_model=8192, layers=80, heads=64),
}
MPT_VOCAB = 50368
"""MPT's vocabulary: GPT-NeoX's tokenizer padded to a multiple of 64."""
PROFILES = {"a100_80gb": "a100-80g", "a100_40gb": "a100-40g", "h100_80gb": "h100-80g"}
"""The built-in profile of each GPU type the tables name."""
PROFILE_RAIL_GBPS = {"a100-80g": 200, "a100-40g": 200, "h100-80g": 400}
"""Line rate of one rail (a GPU's network port) that each profile's inter-node figures are for (their sources): HDR
InfiniBand on DGX A100, NDR InfiniBand or 4 x 100 Gb/s EFA on H100 nodes."""
PRECISIONS = {
    "DEFAULT": BF16_MIXED,
    "PURE": MixedPrecision(param_dtype="bfloat16", reduce_dtype="bfloat16"),
}
"""Composer's FSDP mixed precision modes: both compute in bf16 over fp32 master weights; PURE also reduces
gradients in bf16."""
STRATEGIES = {"FULL_SHARD": ShardStrategy.FULL_SHARD, "SHARD_GRAD_OP": ShardStrategy.SHARD_GRAD_OP}
OPTIMIZER = "adamw"
"""The MPT pretraining yamls train with Composer's DecoupledAdamW: AdamW's two fp32 moments, the same
state and step as torch's AdamW, which the cost model prices (LionW, which some yamls use, keeps one)."""
COMPUTE_DTYPE = "bfloat16"
"""What every row computes in (amp_bf16 and bf16 alike): the chain's activations are priced in it."""


IGNORE_INDEX = -100


class FusedCrossEntropy(torch.autograd.Function):
    """Cross entropy as llm-foundry's MPT takes its loss (`loss_fn: fused_crossentropy`, flash-attn's fused
    kernel): one pass over the logits in their own dtype, which it keeps with each row's log-sum-exp for
    backward, and one that writes their gradient in their dtype. transformers' causal LM loss instead makes an
    fp32 copy of the logits, keeps its log-softmax and makes two fp32 gradients: 12 bytes a logit beside the
    bf16 ones, up to three quarters of these rows' peak. The kernel accumulates in fp32 registers; this
    computes in the logits' dtype, whole tensors at a time, so that it holds and launches what the kernel
    does. The analysis runs a model's own Function as the Function (capture.tagged_autograd_functions)."""

    @staticmethod
    def forward(ctx, logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
        lse = logits.logsumexp(-1)
        valid = labels != IGNORE_INDEX
        picked = logits.gather(1, labels.clamp(min=0).unsqueeze(1)).squeeze(1)
        ctx.save_for_backward(logits, labels, lse)
        return ((lse - picked).float() * valid).sum() / valid.sum().clamp(min=1)

    @staticmethod
    def backward(ctx, grad: "torch.Tensor"):
        logits, labels, lse = ctx.saved_tensors
        valid = labels != IGNORE_INDEX
        scale = ((grad / valid.sum().clamp(min=1)) * valid).to(logits.dtype)
        out = (logits - lse.unsqueeze(1)).exp_()  # the softmax, in place: the gradient's one tensor
        out.scatter_add_(1, labels.clamp(min=0).unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
        return out.mul_(scale.unsqueeze(1)), None


def fused_causal_lm_loss(
    logits: "torch.Tensor", labels: "torch.Tensor", vocab_size: int, **kwargs
) -> "torch.Tensor":
    """transformers' causal LM loss (labels shifted by one, -100 ignored), through FusedCrossEntropy."""
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return FusedCrossEntropy.apply(logits.reshape(-1, vocab_size), shifted.reshape(-1))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Row:
    """One configuration of the tables, as far as the cost model reads it."""

    line: int
    """Line in the CSV file (the header is line 1)."""
    model: str
    """The MPT size (MPT_SIZES)."""
    seq_len: int
    n_gpus: int
    gpu: str
    micro_batch: int
    grad_accum: int
    mp_mode: str
    strategy: str
    activation_checkpointing: bool
    cpu_offload: bool
    num_params: int
    tokens_per_s_per_gpu: float
    node_link_gbps: float
    """The inter-node fabric's line rate per node, from the table's section title ("1600 Gbps node-node
    interconnect")."""

    @property
    def samples_per_gpu(self) -> int:
        """Sequences one GPU trains in a step: its micro-batches together."""
        return self.micro_batch * self.grad_accum

    def describe(self) -> str:
        return (
            f"{self.model} s={self.seq_len} n={self.n_gpus} {self.gpu} mb={self.micro_batch} "
            f"ga={self.grad_accum} {self.mp_mode} {self.strategy}{' ac' if self.activation_checkpointing else ''}"
            f" (line {self.line})"
        )


def _flag(text: str) -> bool:
    return text.strip().lower() == "true"


def read_rows(path: str) -> list[Row]:
    with open(path, newline="") as handle:
        return [
            Row(
                line=line,
                model=r["model"],
                seq_len=int(r["seq_len"]),
                n_gpus=int(r["n_gpus"]),
                gpu=r["gpu"],
                micro_batch=int(r["micro_batch"]),
                grad_accum=int(r["grad_accum"]),
                mp_mode=r["mp_mode"],
                strategy=r["fsdp_sharding_strategy"],
                activation_checkpointing=_flag(r["activation_checkpointing"]),
                cpu_offload=_flag(r["activation_cpu_offload"]),
                num_params=int(r["num_params"]),
                tokens_per_s_per_gpu=float(r["throughput_tok_per_s_per_gpu"]),
                node_link_gbps=_link_gbps(r["section"]),
            )
            for line, r in enumerate(csv.DictReader(handle), start=2)
        ]


def _link_gbps(section: str) -> float:
    found = re.search(r"(\d+(?:\.\d+)?)\s*Gbps", section)
    if found is None:
        raise ValueError(f'no inter-node line rate ("... Gbps") in the section title {section!r}')
    return float(found.group(1))


def workload(size: str, seq_len: int, samples: int) -> Workload:
    """The MPT size as a GPT-2-style `transformers` model on the meta device, its example one GPU's batch of
    a step (`samples` sequences of `seq_len` tokens, the labels the ids)."""
    shape = MPT_SIZES[size]
    return Workload(
        name="gpt2",
        options=(
            ("batch", samples),
            ("seq", seq_len),
            ("device", "meta"),
            ("vocab_size", MPT_VOCAB),
            ("n_embd", shape.d_model),
            ("n_layer", shape.layers),
            ("n_head", shape.heads),
            ("n_positions", seq_len),
            ("activation_function", "gelu"),
            ("attn_implementation", "sdpa"),
        ),
    )


@functools.lru_cache(maxsize=None)
def analyzed(
    size: str, seq_len: int, samples: int, cache: str | None = None
) -> tuple[zoo.ZooModel, BlockChain]:
    """The model and its chain at one GPU's batch of a step: analyzed once per distinct shape in a run, and
    with `cache` (a folder) kept there for later runs under the digest of the code that analyzed it."""
    spec = workload(size, seq_len, samples)
    entry = spec.build()
    entry.model.loss_function = fused_causal_lm_loss
    # the file's name holds every field of the model's config and its loss, its folder the code that builds and
    # analyzes it
    loss = inspect.getsource(FusedCrossEntropy) + inspect.getsource(fused_causal_lm_loss)
    fields = hashlib.sha256(f"{spec!r} {COMPUTE_DTYPE} {loss}".encode()).hexdigest()[:12]
    path = (
        os.path.join(cache, analysis_digest(), f"{size}-s{seq_len}-b{samples}-{fields}.pickle")
        if cache
        else None
    )
    if path and os.path.exists(path):
        with open(path, "rb") as handle:
            return entry, pickle.load(handle)
    chain = analyze(entry.model, entry.args, entry.kwargs, compute_dtype=COMPUTE_DTYPE)
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        written = (
            f"{path}.{os.getpid()}"  # whole or not at all: other runs may read the folder meanwhile
        )
        with open(written, "wb") as handle:
            pickle.dump(chain, handle)
        os.replace(written, path)
    return entry, chain


@functools.lru_cache(maxsize=None)
def analysis_digest() -> str:
    """What a cached chain depends on: the source of shardplan.frontend.passes, of the zoo that builds the model, and
    of every shardplan module they import, directly or not (a change to the cost model leaves the chains
    valid, one to the analysis does not), and the versions of Python, torch and transformers."""
    import torch
    import transformers

    digest = hashlib.sha256(
        f"{sys.version} {torch.__version__} {transformers.__version__}".encode()
    )
    for path in sorted(
        _imported_sources(os.path.join(PACKAGE, "frontend", "passes", "__init__.py"))
        | _imported_sources(os.path.join(PACKAGE, "models", "zoo.py"))
    ):
        with open(path, "rb") as handle:
            digest.update(os.path.relpath(path, PACKAGE).encode() + b"\0" + handle.read())
    return digest.hexdigest()[:16]


def _imported_sources(start: str) -> set[str]:
    """`start` and the shardplan source files it imports, transitively (relative and absolute imports,
    those inside functions included)."""
    found, pending = set(), [start]
    while pending:
        path = pending.pop()
        if path in found:
            continue
        found.add(path)
        with open(path) as handle:
            tree = ast.parse(handle.read())
        here = os.path.dirname(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = here
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
                modules = [os.path.join(base, *node.module.split("."))] if node.module else []
                modules += [
                    os.path.join(modules[0] if modules else base, alias.name)
                    for alias in node.names
                ]
            elif (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] == "shardplan"
            ):
                modules = [os.path.join(PACKAGE, *node.module.split(".")[1:])]
            else:
                continue
            for module in modules:
                pending += [
                    candidate
                    for candidate in (module + ".py", os.path.join(module, "__init__.py"))
                    if os.path.exists(candidate)
                ]
    return found


def plan_for(row: Row, entry: zoo.ZooModel, chain: BlockChain) -> Plan:
    """The plan `row` ran: one unit per block of `chain`, each under the row's strategy and checkpointing,
    recording the chain's inputs (one GPU's batch of a step) and fingerprint, the graph manual_plan would
    capture again from those inputs."""
    if row.cpu_offload:
        raise ValueError(f"{row.describe()}: activation CPU offload is not a plan's decision")
    plan = manual_plan(
        entry.model,
        Workload(name="gpt2").units(chain),
        dp=row.n_gpus,
        strategies=(STRATEGIES[row.strategy],),
        checkpoints=(Checkpoint.FULL if row.activation_checkpointing else Checkpoint.NONE,),
        micro_batches=row.grad_accum,
        precision=PRECISIONS[row.mp_mode],
    )
    return dataclasses.replace(
        plan, fingerprint=chain.fingerprint, inputs=chain.inputs, optimizer=OPTIMIZER
    )


def with_node_link_rate(hw: HardwareProfile, node_gbps: float, rail_gbps: float) -> HardwareProfile:
    """`hw` across nodes whose links carry `node_gbps` (line rate, per node), where its inter-node figures are for
    `rail_gbps` on each of its rails (LinkProfile.rails: one NIC per GPU): every collective's bus bandwidth scaled
    by the two line rates' ratio, so the profile keeps its own share of the line rate (the A100 profiles' 80%,
    the H100's measured 90%). `hw` itself where the rates are the same (the A100 profiles at 1600 Gbps: 8 rails
    of 200 Gb/s)."""
    link = hw.inter_node
    scale = node_gbps / (rail_gbps * link.rails)
    if math.isclose(scale, 1.0):
        return hw
    collectives = {
        kind: dataclasses.replace(
            cost, bus_bandwidth_bytes_per_s=cost.bus_bandwidth_bytes_per_s * scale
        )
        for kind, cost in link.collectives.items()
    }
    return dataclasses.replace(
        hw,
        name=f"{hw.name} at {node_gbps:g} Gbps a node",
        inter_node=dataclasses.replace(link, collectives=collectives),
    )


TRITON_FLASH_ATTENTION_A100 = {
    "causal": {
        "64": (
            (512, 59e12),
            (1024, 75e12),
            (2048, 79e12),
            (4096, 76e12),
            (8192, 79e12),
            (16384, 80e12),
        ),
        "128": (
            (512, 50e12),
            (1024, 61e12),
            (2048, 68e12),
            (4096, 74e12),
            (8192, 78e12),
            (16384, 80e12),
        ),
    },
    "full": {
        "64": (
            (512, 90e12),
            (1024, 102e12),
            (2048, 98e12),
            (4096, 98e12),
            (8192, 100e12),
            (16384, 100e12),
        ),
        "128": (
            (512, 78e12),
            (1024, 85e12),
            (2048, 90e12),
            (4096, 93e12),
            (8192, 95e12),
            (16384, 95e12),
        ),
    },
}
"""FLOP/s of the Triton FlashAttention on A100 80GB SXM4, forward + backward, bf16/fp16, batch x sequence = 16k
tokens: Dao 2023, "FlashAttention-2", arXiv 2307.08691, fig. 4, its "FlashAttention Triton" bars (the same figure and
FLOP count the a100 profiles read FlashAttention-2's rates from: a causal call's halved). The kernel measured is
flash-attn's flash_attn_triton.py on Triton's pre-MLIR compiler, the one llm-foundry copies and runs under
`attn_impl: triton` (its `triton-pre-mlir` dependency)."""

FLASH_ATTENTION_1_H100 = {
    "causal": {
        "64": (
            (512, 104e12),
            (1024, 123e12),
            (2048, 136e12),
            (4096, 138e12),
            (8192, 149e12),
            (16384, 156e12),
        ),
        "128": (
            (512, 98e12),
            (1024, 109e12),
            (2048, 108e12),
            (4096, 126e12),
            (8192, 135e12),
            (16384, 137e12),
        ),
    },
    "full": {
        "64": (
            (512, 157e12),
            (1024, 159e12),
            (2048, 161e12),
            (4096, 161e12),
            (8192, 166e12),
            (16384, 168e12),
        ),
        "128": (
            (512, 127e12),
            (1024, 127e12),
            (2048, 128e12),
            (4096, 131e12),
            (8192, 137e12),
            (16384, 139e12),
        ),
    },
}
"""FLOP/s of FlashAttention (the first, CUDA) on H100 80GB SXM5, forward + backward: the same paper's fig. 7. It stands
in for the Triton kernel on H100, which no published figure measured: on A100, where fig. 4 measured both, their
rates agree within 20% at every sequence (causal, 16k: 97 and 83 against Triton's 80 and 80)."""

TRITON_FORWARD_OVER_BACKWARD = 1.8
"""How much faster a Triton FlashAttention runs its forward than its backward, FLOPs counted alike: flash_attn_triton.py's
own notes say its forward is faster than the CUDA kernel's and its backward slower; Triton's fused-attention tutorial
(triton-lang.org, tutorials/06-fused-attention, its printed table: causal, head dim 64, fp16) measures a descendant of
the same kernel at 111.7, 136.5 and 150.0 TFLOP/s forward and 59.8, 76.2 and 87.5 backward at 1k, 2k and 4k, 1.87,
1.79 and 1.71 times. A recomputed forward then costs the forward's share of the published forward + backward time."""

ATTENTION_KERNELS = ("triton", "sdpa")
"""The fused attention a row is priced as running: "triton", what llm-foundry's benchmark script ran
(scripts/train/benchmarking/submit_benchmarks.py, `--attn_impl` default 'triton' from the tables' first commit
until March 2024, its A100 tables last refreshed in October 2023 at b2a43a147); "sdpa", the profile's own
FlashAttention-2, what SDPA, shardplan's runtimes and FSDP2 run."""


def _directional_rate(
    by_mask: dict[str, dict[str, tuple[tuple[float, float], ...]]], share: float
) -> AttentionRate:
    return AttentionRate(
        **{
            mask: {
                dim: SizeCurve(points=tuple((seq, rate * share) for seq, rate in points))
                for dim, points in by_dim.items()
            }
            for mask, by_dim in by_mask.items()
        }
    )


def with_attention_kernel(hw: HardwareProfile, kernel: str) -> HardwareProfile:
    """`hw` with its fused attention priced as `kernel` (ATTENTION_KERNELS) runs it. For "triton", each direction at
    its own rate: a forward and its backward (2.5x its FLOPs) take the published forward + backward time, the forward
    TRITON_FORWARD_OVER_BACKWARD times as fast (backward = forward + backward x (1 / ratio + 2.5) / 3.5)."""
    if kernel == "sdpa":
        return hw
    published = (
        TRITON_FLASH_ATTENTION_A100 if hw.name.startswith("a100") else FLASH_ATTENTION_1_H100
    )
    backward_share = (1 / TRITON_FORWARD_OVER_BACKWARD + 2.5) / 3.5
    rates = {
        op: _directional_rate(
            published,
            backward_share * (1 if op.endswith("_backward") else TRITON_FORWARD_OVER_BACKWARD),
        )
        for op in hw.attention_rates
    }
    return dataclasses.replace(
        hw, name=f"{hw.name} running Triton FlashAttention", attention_rates=rates
    )


def hardware_for(row: Row, attention_kernel: str = "triton") -> HardwareProfile:
    name = PROFILES[row.gpu]
    hw = with_node_link_rate(get_hardware(name), row.node_link_gbps, PROFILE_RAIL_GBPS[name])
    return with_attention_kernel(hw, attention_kernel)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """One row's plan and what the cost model predicts for it."""

    row: Row
    plan: Plan
    predicted: Predicted
    param_numel: int
    """Parameters of the model built for the row (the tied head's counted once, as num_params counts it)."""
    usable_bytes: int
    """The device's usable memory (HardwareProfile.usable_memory_bytes)."""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.row.samples_per_gpu * self.row.seq_len / self.predicted.step_time_s

    @property
    def ratio(self) -> float:
        """Predicted / measured throughput: above 1, the model is optimistic."""
        return self.tokens_per_s_per_gpu / self.row.tokens_per_s_per_gpu

    @property
    def over_memory(self) -> bool:
        return self.predicted.peak_bytes > self.usable_bytes


def predict_row(row: Row, cache: str | None = None, attention_kernel: str = "triton") -> Outcome:
    """`row`'s plan priced on its GPU, its fused attention as `attention_kernel` runs it
    (with_attention_kernel); `cache`: a folder of chains analyzed before (analyzed)."""
    entry, chain = analyzed(row.model, row.seq_len, row.samples_per_gpu, cache=cache)
    hw = hardware_for(row, attention_kernel)
    plan = plan_for(row, entry, chain)
    return Outcome(
        row=row,
        plan=plan,
        predicted=evaluate(chain, plan, hw),
        param_numel=sum(p.numel() for p in entry.model.parameters()),
        usable_bytes=hw.usable_memory_bytes,
    )


def predict(
    rows: list[Row], cache: str | None = None, attention_kernel: str = "triton"
) -> list[Outcome]:
    return [predict_row(row, cache, attention_kernel) for row in rows]


def _percentile(values: list[float], percent: float) -> float:
    return float(np.percentile(values, percent)) if values else math.nan


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GpuScore:
    """How the predictions of one GPU type's rows read against the measurements."""

    gpu: str
    rows: int
    ratio_median: float
    ratio_p10: float
    ratio_p90: float
    tau_by_size: dict[str, float]
    """Kendall tau of predicted against measured throughput among each model size's rows (NaN below 2 rows)."""
    over_memory: int
    """Rows predicted over the device's usable memory (every row ran)."""
    usable_bytes: int

    @property
    def spread(self) -> float:
        """p90 / p10 of the ratio: how far apart the model's misses lie, whatever their median."""
        return self.ratio_p90 / self.ratio_p10

    @property
    def mean_tau(self) -> float:
        taus = [tau for tau in self.tau_by_size.values() if not math.isnan(tau)]
        return statistics.mean(taus) if taus else math.nan


def score(outcomes: list[Outcome]) -> list[GpuScore]:
    by_gpu: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_gpu[outcome.row.gpu].append(outcome)
    scores = []
    for gpu, members in sorted(by_gpu.items()):
        ratios = [o.ratio for o in members]
        by_size: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in members:
            by_size[outcome.row.model].append(outcome)
        taus = {
            size: (
                float(
                    kendalltau(
                        [o.tokens_per_s_per_gpu for o in group],
                        [o.row.tokens_per_s_per_gpu for o in group],
                    )[0]
                )
                if len(group) > 1
                else math.nan
            )
            for size, group in _by_size_order(by_size)
        }
        scores.append(
            GpuScore(
                gpu=gpu,
                rows=len(members),
                ratio_median=_percentile(ratios, 50),
                ratio_p10=_percentile(ratios, 10),
                ratio_p90=_percentile(ratios, 90),
                tau_by_size=taus,
                over_memory=sum(o.over_memory for o in members),
                usable_bytes=members[0].usable_bytes,
            )
        )
    return scores


def _by_size_order(groups: dict[str, list]) -> list[tuple[str, list]]:
    """`groups` by model size, smallest first (MPT_SIZES' order)."""
    order = list(MPT_SIZES)
    return sorted(
        groups.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order)
    )


def ratio_by_seq_len(outcomes: list[Outcome]) -> dict[str, dict[int, float]]:
    """Median predicted / measured throughput by GPU type and sequence length."""
    groups: dict[tuple[str, int], list[float]] = defaultdict(list)
    for outcome in outcomes:
        groups[outcome.row.gpu, outcome.row.seq_len].append(outcome.ratio)
    found: dict[str, dict[int, float]] = defaultdict(dict)
    for (gpu, seq_len), ratios in sorted(groups.items()):
        found[gpu][seq_len] = statistics.median(ratios)
    return dict(found)


def print_by_size(outcomes: list[Outcome]) -> None:
    """Median predicted / measured throughput by model size, both GPU types together."""
    by_size: dict[str, list[float]] = defaultdict(list)
    for outcome in outcomes:
        by_size[outcome.row.model].append(outcome.ratio)
    print("\nMedian predicted / measured throughput by model size, every GPU type:\n")
    ordered = _by_size_order(by_size)
    print("| " + " | ".join(size for size, _ in ordered) + " |")
    print("|" + "---:|" * len(ordered))
    print("| " + " | ".join(f"{statistics.median(r):.2f}" for _, r in ordered) + " |")


GiB = 2**30


def print_summary(scores: list[GpuScore]) -> None:
    print(
        "| GPU | rows | pred/meas median | p10 | p90 | p90/p10 | mean tau within sizes | over usable memory |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for s in scores:
        print(
            f"| {s.gpu} | {s.rows} | {s.ratio_median:.2f} | {s.ratio_p10:.2f} | {s.ratio_p90:.2f} | {s.spread:.2f} "
            f"| {s.mean_tau:+.2f} | {s.over_memory}/{s.rows} (usable {s.usable_bytes / GiB:.1f} GiB) |"
        )
    sizes = [size for size in MPT_SIZES if any(size in s.tau_by_size for s in scores)]
    print("\nKendall tau of predicted against measured tokens/s/GPU within each model size:\n")
    print("| GPU | " + " | ".join(sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for s in scores:
        print(
            f"| {s.gpu} | "
            + " | ".join(_signed(s.tau_by_size.get(size, math.nan)) for size in sizes)
            + " |"
        )


def _signed(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:+.2f}"


def print_by_seq_len(ratios: dict[str, dict[int, float]]) -> None:
    lengths = sorted({seq_len for by_len in ratios.values() for seq_len in by_len})
    print("\nMedian predicted / measured throughput by sequence length:\n")
    print("| GPU | " + " | ".join(str(seq_len) for seq_len in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for gpu, by_len in ratios.items():
        print(
            f"| {gpu} | "
            + " | ".join(f"{by_len[n]:.2f}" if n in by_len else "-" for n in lengths)
            + " |"
        )


def print_rows(outcomes: list[Outcome]) -> None:
    """Every row: its plan, the throughput both ways, and the predicted terms (time: compute, recompute,
    exposed communication, optimizer; memory at the peak: sharded state, gathered parameters, activations,
    transients)."""
    print(
        "\n| line | GPU | size | seq | GPUs | mb x ga | mp | ckpt | measured tok/s | predicted | ratio "
        "| compute / recompute / comm / optim (ms) | peak GiB (state / gathered / act / transient) | over |"
    )
    print("|---:|---|---|---:|---:|---|---|---|---:|---:|---:|---|---|---|")
    for o in outcomes:
        r, p = o.row, o.predicted
        times = " / ".join(
            f"{p.time_s[term] * 1e3:.0f}"
            for term in ("compute", "recompute", "exposed_comm", "optimizer")
        )
        memory = " / ".join(
            f"{p.memory_bytes[term] / GiB:.1f}"
            for term in ("sharded_state", "gathered_params", "activations", "transient")
        )
        print(
            f"| {r.line} | {r.gpu} | {r.model} | {r.seq_len} | {r.n_gpus} | {r.micro_batch} x {r.grad_accum} | "
            f"{r.mp_mode} | {'full' if r.activation_checkpointing else 'none'} | {r.tokens_per_s_per_gpu:.0f} | "
            f"{o.tokens_per_s_per_gpu:.0f} | {o.ratio:.2f} | {times} | {p.peak_bytes / GiB:.1f} ({memory}) | "
            f"{'OVER' if o.over_memory else ''} |"
        )


def print_hardware(rows: list[Row]) -> None:
    for gpu, gbps in sorted({(row.gpu, row.node_link_gbps) for row in rows}):
        name = PROFILES[gpu]
        base = get_hardware(name)
        used = with_node_link_rate(base, gbps, PROFILE_RAIL_GBPS[name])
        link = used.inter_node
        bus_gbps = link.collectives["all_gather_into_tensor"].bus_bandwidth_bytes_per_s * 8 / 1e9
        how = (
            "the profile's own inter-node figures"
            if used is base
            else f"the profile's {PROFILE_RAIL_GBPS[name] * link.rails:g} Gbps a node scaled to the published {gbps:g}"
        )
        print(
            f"{gpu}: {used.name}: across nodes {link.rails} rails of {gbps / link.rails:g} Gb/s line rate, "
            f"{bus_gbps:g} Gb/s bus bandwidth each ({how}); usable memory {used.usable_memory_bytes / GiB:.1f} GiB "
            f"of {used.device_memory_bytes / GiB:.0f} (past {used.runtime_reserved_bytes / GiB:.1f} GiB reserved, "
            f"x{used.usable_memory_fraction})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=DEFAULT_DATA, help="the rows (default: %(default)s)")
    parser.add_argument("--models", nargs="+", choices=list(MPT_SIZES), help="only these sizes")
    parser.add_argument(
        "--rows", action="store_true", help="print every row's prediction and its terms"
    )
    parser.add_argument(
        "--cache",
        default=DEFAULT_CACHE,
        help="keep analyzed chains here for later runs, under the digest of the analysis's code "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--no-cache", action="store_true", help="analyze every chain again, keeping none"
    )
    parser.add_argument(
        "--attention-kernel",
        choices=ATTENTION_KERNELS,
        default="triton",
        help="price the rows' fused attention as the Triton FlashAttention llm-foundry's benchmarks ran, or as "
        "SDPA's FlashAttention-2 (the profiles' rates, what shardplan runs); default: %(default)s",
    )
    options = parser.parse_args()
    start = time.perf_counter()
    rows = [
        row for row in read_rows(options.data) if not options.models or row.model in options.models
    ]
    cache = None if options.no_cache else options.cache
    print_hardware(rows)
    outcomes = predict(rows, cache, options.attention_kernel)
    mismatched = [o for o in outcomes if o.param_numel != o.row.num_params]
    for o in mismatched:
        print(
            f"parameters differ: {o.row.describe()}: the model has {o.param_numel}, the row {o.row.num_params}"
        )
    where = f"kept in {os.path.join(cache, analysis_digest())}" if cache else "kept nowhere"
    print(
        f"\n{len(rows)} rows, {analyzed.cache_info().currsize} distinct chains computing in {COMPUTE_DTYPE} "
        f"({where}); parameter counts match on {len(rows) - len(mismatched)}/{len(rows)}\n"
    )
    print_summary(score(outcomes))
    print_by_seq_len(ratio_by_seq_len(outcomes))
    print_by_size(outcomes)
    if options.rows:
        print_rows(outcomes)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
