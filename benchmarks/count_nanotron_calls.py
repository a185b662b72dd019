"""Count the ATen calls nanotron's own code dispatches for one micro-batch, by running it on CPU.

    .venv/bin/python benchmarks/count_nanotron_calls.py                  # tp 1, ZeRO-0, the data's commit
    .venv/bin/python benchmarks/count_nanotron_calls.py --tp 2 --zero 1  # two gloo ranks, both printed
    .venv/bin/python benchmarks/count_nanotron_calls.py --pp 2           # two stages: a boundary's calls
    .venv/bin/python benchmarks/count_nanotron_calls.py --ops --time     # every op of a layer; its host time here

bench_published.py prices nanotron's host (NANOTRON_HOST_CALLS) from these counts. The code run is the
playbook's: nanotron at e24d2483 (`git archive` from a local mirror of github.com/huggingface/nanotron)
with the Python of flash-attn v2.5.8 (nanotron's pyproject asks for >=2.5.0,<2.7.0; mirror of
github.com/Dao-AILab/flash-attention), a LlamaForTraining in bf16 with the tied embedding, ParallelContext
on gloo, TP in REDUCE_SCATTER mode with async communication (scripts/scaling_benchmarks.py line 88), the
1F1B engine and the FP32GradientAccumulator; the second step is counted (the first builds caches and
buffers) and divided by its micro-batches.

Every ATen op that reaches the dispatcher below autograd is counted with a TorchDispatchMode: the forward's,
the ones the autograd engine runs for the backward (its nodes' formulas and nanotron's custom Functions), and
the fp32 accumulation loop that follows each backward. Only what needs a GPU is stubbed, and a stub's
kernel does nothing, so values are garbage and shapes true (no path here branches on a value):

- Triton (flash_attn.ops.triton.layer_norm's RMSNorm, flash_attn.ops.triton.rotary): `kernel[grid](...)`
  counts one Triton launch; flash-attn's Python around it runs as written, its allocations counted.
- flash_attn_2_cuda (the C++ extension): `varlen_fwd` makes the ATen calls csrc/flash_attn/flash_api.cpp
  makes at v2.5.8 (lines 640, 655, 707: out, softmax_lse, rng_state) and one CUDA launch (run_mha_fwd);
  `varlen_bwd` its two allocations (lines 1129, 1141: softmax_d, dq_accum; dq/dk/dv are passed in) and
  three launches (flash_bwd_launch_template.h lines 81, 107, 120: dot(dO, O), the dq/dk/dv kernel, dq's
  conversion).
- torch.cuda's device calls, "cuda" devices turned into "cpu", and imports nanotron makes only to read
  YAML configs (dacite, datasets) or that the counted paths never call (einops).

Prints, per block kind and phase, the ATen calls split into views (no kernel), allocations (no kernel),
collectives (c10d) and the rest (a kernel each on a GPU), and the Triton and flash-attn launches.
Skips with one line when a mirror is missing (CI has none).
"""

import argparse
import contextlib
import io
import os
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import types
from collections import Counter, defaultdict

NANOTRON_MIRROR = "/work/.mirror/huggingface+nanotron/repo"
FLASH_ATTN_MIRROR = "/work/.mirror/Dao-AILab+flash-attention/repo"
NANOTRON_COMMIT = "e24d2483"
"""The commit the playbook's runs were made with (the data set's model_configs.md)."""
FLASH_ATTN_TAG = "v2.5.8"
SEQ, MICRO_BATCH_SIZE, LAYERS = 32, 1, 2
"""A tiny model: how many calls a layer dispatches does not depend on its width or the sequence."""


def extract(mirror: str, ref: str, path: str, into: str) -> None:
    archive = subprocess.run(
        ["git", "-C", mirror, "archive", ref, path], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")


class Counting:
    """The TorchDispatchMode's bookkeeping: which block and phase an op belongs to, and whether it counts."""

    def __init__(self):
        self.ops: Counter = Counter()
        self.launches: Counter = Counter()
        self.where = ("engine", "forward")
        self.on = False

    def launch(self, kind: str, count: int = 1) -> None:
        if self.on:
            self.launches[self.where + (kind,)] += count


COUNT = Counting()
MICRO_BATCHES = 2
"""A step's micro-batches; the second step is counted (the first builds caches and buffers) and divided."""


def kind_of(func) -> str:
    name = func.name()
    if name.startswith(("c10d::", "_c10d_functional::")):
        return "collective"
    if func.is_view or name in ("aten::alias", "aten::_unsafe_view", "aten::as_strided"):
        return "view"
    if name.split("::")[1].split(".")[0] in ("empty", "empty_like", "empty_strided", "new_empty"):
        return "allocation"
    return "kernel"


def install_stubs() -> None:
    """What cannot run without a GPU, replaced as the module docstring says."""
    import torch
    import torch._dynamo  # noqa: F401  (hooks import it lazily; it must find the real Triton absent, not the stub)

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod
        return mod

    class Kernel:
        """A @triton.jit function: `kernel[grid](...)` launches nothing and counts one launch."""

        def __getitem__(self, grid):
            return lambda *args, **kwargs: COUNT.launch("triton")

    class Language(types.ModuleType):
        def __getattr__(self, name):
            return object

    language = Language("triton.language")
    sys.modules["triton.language"] = language
    module(
        "triton",
        jit=lambda fn=None, **kw: Kernel() if fn else (lambda fn: Kernel()),
        autotune=lambda *a, **kw: lambda kernel: kernel,
        heuristics=lambda *a, **kw: lambda kernel: kernel,
        Config=lambda *a, **kw: None,
        cdiv=lambda a, b: -(-a // b),
        next_power_of_2=lambda n: 1 << max(0, (n - 1).bit_length()),
        language=language,
    )

    def varlen_fwd(q, k, v, *args):  # shapes true enough: what reads them back is stubbed too
        out = torch.empty_like(q)
        softmax_lse = torch.empty((1, q.shape[1], q.shape[0]), dtype=torch.float32)
        rng_state = torch.empty((2,), dtype=torch.int64)
        COUNT.launch("flash-attn")
        return [out, q, k, v, out, softmax_lse, None, rng_state]

    def varlen_bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, *args):
        softmax_d = torch.empty((1, q.shape[1], q.shape[0]), dtype=torch.float32)
        torch.empty((q.shape[0] + 128, q.shape[1], q.shape[2]), dtype=torch.float32)  # dq_accum
        COUNT.launch("flash-attn", 3)
        return [dq, dk, dv, softmax_d]

    module("flash_attn_2_cuda", varlen_fwd=varlen_fwd, varlen_bwd=varlen_bwd)
    module("einops", rearrange=None, repeat=None)
    module("dacite", from_dict=None, Config=lambda *a, **kw: None)
    module("datasets")
    module("datasets.download")
    module("datasets.download.streaming_download_manager", xPath=object)

    class Properties:
        multi_processor_count = 132  # an H100 SXM

    torch.cuda.set_device = lambda device: None
    torch.cuda.device = lambda index: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_device_properties = lambda device=None: Properties()
    torch.cuda.get_device_capability = lambda device=None: (9, 0)


def dispatch_counter():
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class OnCpu(TorchFunctionMode):
        """nanotron asks for "cuda" by name; every such tensor is made on the CPU instead."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                kwargs["device"] = "cpu"
            if (
                func in (torch.Tensor.to, torch.Tensor.cuda)
                and args[1:2]
                and str(args[1]).startswith("cuda")
            ):
                args = args[:1] + ("cpu",) + args[2:]
            return func(*args, **kwargs)

    class Dispatched(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if COUNT.on:
                COUNT.ops[COUNT.where + (kind_of(func), func.name())] += 1
            return func(*args, **(kwargs or {}))

    return OnCpu(), Dispatched()


def build(tp: int, pp: int, zero: int, layers: int = LAYERS):
    import torch
    from nanotron.config import LlamaConfig, ParallelismArgs
    from nanotron.models import build_model
    from nanotron.models.llama import LlamaForTraining
    from nanotron.optim.gradient_accumulator import FP32GradientAccumulator
    from nanotron.parallel import ParallelContext
    from nanotron.parallel.pipeline_parallel.engine import OneForwardOneBackwardPipelineEngine
    from nanotron.parallel.tensor_parallel.enum import TensorParallelLinearMode
    from nanotron.trainer import mark_tied_parameters

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=layers,
        vocab_size=256,
        max_position_embeddings=SEQ,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    parallelism = ParallelismArgs(
        dp=1,
        pp=pp,
        tp=tp,
        pp_engine=OneForwardOneBackwardPipelineEngine(),
        tp_mode=TensorParallelLinearMode.REDUCE_SCATTER,
        tp_linear_async_communication=True,
    )
    context = ParallelContext(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=1
    )
    model = build_model(
        model_builder=lambda: LlamaForTraining(config, context, parallelism),
        parallel_context=context,
        dtype=torch.bfloat16,
        device=torch.device("cpu"),
    )
    mark_tied_parameters(model=model, parallel_context=context, parallel_config=parallelism)
    model.model.p2p.device = torch.device(
        "cpu"
    )  # used in backward too, where OnCpu is not in force
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    named = list(model.get_named_params_with_correct_tied())
    if not zero:
        return (
            model,
            FP32GradientAccumulator(named_parameters=named),
            context,
            parallelism.pp_engine,
        )
    # ZeRO-1 at dp 1 as helpers.py lines 363-404 build it: the optimizer's parameters are flat slices (the
    # whole of each here), every parameter keeps its gradient buffer, and the accumulator gets the offsets
    accumulator = FP32GradientAccumulator(
        named_parameters=[(name, p.view(-1)) for name, p in named], grad_buckets_named_params=named
    )
    accumulator.assign_param_offsets({name: {0: (0, p.numel())} for name, p in named}, dp_rank=0)
    return model, accumulator, context, parallelism.pp_engine


def tagged(fn, block: str):
    """`fn` with its ops counted as `block`'s, in the phase it runs in."""

    def run(*args, **kwargs):
        where = COUNT.where
        COUNT.where = (block, where[1])
        try:
            return fn(*args, **kwargs)
        finally:
            COUNT.where = where

    return run


def instrument(model, accumulator, engine) -> int:
    """Tag every op with its block and phase: forward by module hooks, backward by a hook on each block's
    output gradient (the engine runs a block's nodes once its output's gradient is complete, block by
    block), the accumulation by the parameter it adds, a stage boundary by nanotron's pipeline functions.
    Returns the rank's decoder layers."""
    from nanotron.parallel.pipeline_parallel import block as pipeline_block
    from nanotron.parallel.pipeline_parallel import functional, p2p

    blocks = [("embedding", model.model.token_position_embeddings)]
    blocks += [("layer", layer) for layer in model.model.decoder]
    blocks += [
        ("head", b)
        for b in (
            model.model.final_layer_norm,
            model.model.lm_head,
            model.model.cast_to_fp32,
            model.loss,
        )
    ]
    blocks = [
        (kind, block) for kind, block in blocks if hasattr(block, "pp_block")
    ]  # this rank's stage

    for kind, block in blocks:

        def enter(module, args, kwargs, kind=kind):
            COUNT.where = (kind, "forward")

        def leave(module, args, kwargs, output, kind=kind):
            COUNT.where = ("engine", "forward")
            for tensor in output.values():
                if getattr(tensor, "requires_grad", False):
                    tensor.register_hook(
                        lambda grad, kind=kind: COUNT.__setattr__("where", (kind, "backward"))
                    )

        block.register_forward_pre_hook(enter, with_kwargs=True)
        block.register_forward_hook(leave, with_kwargs=True)

    for name in ("send_to_pipeline_state_buffer", "recv_from_pipeline_state_buffer"):
        setattr(pipeline_block, name, tagged(getattr(functional, name), "boundary"))
    for function in (
        functional.SendTensorToPipelineBuffer,
        functional.SendTensorWithoutGradientToPipelineBuffer,
        functional.RecvTensorFromPipelineBuffer,
    ):
        function.backward = staticmethod(tagged(function.backward, "boundary"))
    for name in ("send_tensors", "recv_tensors"):
        setattr(p2p.P2P, name, tagged(getattr(p2p.P2P, name), "boundary"))

    backward, accumulate = engine.backward, accumulator._accumulate_grad

    def counted_backward(*args, **kwargs):
        COUNT.where = ("engine", "backward")
        return backward(*args, **kwargs)

    def counted_accumulate(name, half_param):
        where, COUNT.where = (
            COUNT.where,
            (
                "embedding"
                if "token_embedding" in name
                else "layer"
                if ".decoder." in name
                else "head",
                "accumulation",
            ),
        )
        try:
            return accumulate(name=name, half_param=half_param)
        finally:
            COUNT.where = where

    engine.backward, accumulator._accumulate_grad = counted_backward, counted_accumulate
    return sum(kind == "layer" for kind, _ in blocks)


def count(
    rank: int, world: int, port: int, tp: int, pp: int, zero: int, src: str, timed: bool = False
):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        CUDA_DEVICE_MAX_CONNECTIONS="1",
    )
    sys.path.insert(0, src)
    install_stubs()
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    on_cpu, dispatched = dispatch_counter()
    with on_cpu:
        model, accumulator, context, engine = build(tp, pp, zero)
        layers = instrument(model, accumulator, engine)
        batch = micro_batches(model, context)
        with dispatched:
            for step in range(2):
                COUNT.on = step == 1
                train_step(model, accumulator, context, engine, batch)
            COUNT.on = False  # time_a_layer's steps are not counted
        ms_a_layer = time_a_layer(on_cpu, zero) if timed else None
    dist.destroy_process_group()
    return COUNT.ops, COUNT.launches, layers, ms_a_layer


def micro_batches(model, context) -> list[dict]:
    """A step's MICRO_BATCHES micro-batches, data only where its stage reads it."""
    import torch
    import torch.distributed as dist
    from nanotron.parallel.pipeline_parallel.tensor_pointer import TensorPointer

    ids = torch.randint(0, 256, (MICRO_BATCH_SIZE, SEQ))
    mask = torch.ones(MICRO_BATCH_SIZE, SEQ, dtype=torch.bool)
    first, last = model.model.token_position_embeddings.rank, model.loss.rank
    stage = dist.get_rank(context.pp_pg)
    inputs = (
        {"input_ids": ids, "input_mask": mask}
        if stage == first
        else {"input_ids": TensorPointer(first), "input_mask": TensorPointer(first)}
    )
    labels = (
        {"label_ids": ids, "label_mask": mask}
        if stage == last
        else {"label_ids": TensorPointer(last), "label_mask": TensorPointer(last)}
    )
    return [inputs | labels] * MICRO_BATCHES


def train_step(model, accumulator, context, engine, batch: list[dict]) -> None:
    COUNT.where = ("engine", "forward")
    engine.train_batch_iter(
        model=model,
        pg=context.pp_pg,
        batch=batch,
        nb_microbatches=len(batch),
        grad_accumulator=accumulator,
    )


def time_a_layer(on_cpu, zero: int) -> float:
    """Milliseconds a decoder layer's micro-batch (forward, backward, accumulation) takes on this CPU, counting
    off: the difference between a model of LAYERS and one of 5 x LAYERS layers, best of 5 steps each. The
    stubbed kernels cost nothing and the real ones run on tiny tensors, so this is nearly all host."""
    import torch

    torch.set_num_threads(1)
    best = {}
    for layers in (LAYERS, 5 * LAYERS):
        with on_cpu:
            model, accumulator, context, engine = build(1, 1, zero, layers)
            batch = micro_batches(model, context)
        rounds = []
        for _ in range(5):
            start = time.perf_counter()
            train_step(model, accumulator, context, engine, batch)
            rounds.append((time.perf_counter() - start) / MICRO_BATCHES)
        best[layers] = min(rounds)
    return (best[5 * LAYERS] - best[LAYERS]) / (4 * LAYERS) * 1e3


def run_rank(rank, world, port, tp, pp, zero, src, results):
    results[rank] = count(rank, world, port, tp, pp, zero, src)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def report(ops: Counter, launches: Counter, layers: int, ms_a_layer, show_ops: bool) -> None:
    table = defaultdict(Counter)
    for (block, phase, kind, _), n in ops.items():
        table[(block, phase)][kind] += n
    for (block, phase, kind), n in launches.items():
        table[(block, phase)][kind] += n
    kinds = ("kernel", "view", "allocation", "collective", "triton", "flash-attn")
    print(f"| block | phase | ATen calls | {' | '.join(kinds)} |")
    print("|---|---|---:|" + "---:|" * len(kinds))
    totals = Counter()
    for (block, phase), row in sorted(table.items()):
        per = MICRO_BATCHES * (layers if block == "layer" else 1)
        aten = sum(row[k] for k in kinds[:4]) / per
        totals[block] += aten
        print(
            f"| {block}{' (a layer)' if block == 'layer' else ''} | {phase} | {aten:g} | "
            + " | ".join(f"{row[k] / per:g}" for k in kinds)
            + " |"
        )
    print(
        "ATen calls a micro-batch: "
        + ", ".join(f"{block} {n:g}" for block, n in sorted(totals.items()))
    )
    if ms_a_layer is not None:
        print(
            f"a layer's micro-batch on this CPU, counting off: {ms_a_layer:.3f} ms, "
            f"{ms_a_layer * 1e3 / totals['layer']:.1f} us an ATen call"
        )
    if show_ops:
        for phase in ("forward", "backward", "accumulation"):
            names = Counter(
                {
                    name: n / layers / MICRO_BATCHES
                    for (b, p, _, name), n in ops.items()
                    if b == "layer" and p == phase
                }
            )
            print(
                f"a layer's {phase}: "
                + ", ".join(f"{name.split('::')[1]} {n:g}" for name, n in names.most_common())
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--zero", type=int, choices=(0, 1), default=0)
    parser.add_argument("--ops", action="store_true", help="list a layer's ops by name")
    parser.add_argument(
        "--time", action="store_true", help="and time a layer's micro-batch here (tp = pp = 1)"
    )
    parser.add_argument("--nanotron", default=NANOTRON_MIRROR)
    parser.add_argument("--commit", default=NANOTRON_COMMIT)
    parser.add_argument("--flash-attn", default=FLASH_ATTN_MIRROR)
    parser.add_argument("--flash-attn-tag", default=FLASH_ATTN_TAG)
    args = parser.parse_args()
    if args.time and args.tp * args.pp > 1:
        parser.error("--time times one rank's layer: give it without --tp / --pp")
    for mirror in (args.nanotron, args.flash_attn):
        if not os.path.isdir(mirror):
            print(
                f"skipped: no git mirror at {mirror} (fetch github.com/huggingface/nanotron and "
                "Dao-AILab/flash-attention there, or pass --nanotron / --flash-attn)"
            )
            return
    world = args.tp * args.pp
    with tempfile.TemporaryDirectory(prefix="nanotron-") as tmp:
        extract(args.nanotron, args.commit, "src", tmp)
        extract(args.flash_attn, args.flash_attn_tag, "flash_attn", os.path.join(tmp, "src"))
        src = os.path.join(tmp, "src")
        if world == 1:
            results = {0: count(0, 1, free_port(), 1, 1, args.zero, src, args.time)}
        else:
            import torch.multiprocessing as mp

            results = mp.Manager().dict()
            mp.spawn(
                run_rank,
                args=(world, free_port(), args.tp, args.pp, args.zero, src, results),
                nprocs=world,
            )
    print(
        f"nanotron {args.commit}, flash-attn {args.flash_attn_tag}: tp {args.tp}, pp {args.pp}, ZeRO-{args.zero}, "
        f"{LAYERS} layers, {MICRO_BATCHES} micro-batches a step, the second step counted; per micro-batch"
    )
    for rank in sorted(results):
        print(f"\nrank {rank} (tp rank {rank % args.tp}, stage {rank // args.tp}):")
        report(*results[rank], args.ops)


if __name__ == "__main__":
    main()
