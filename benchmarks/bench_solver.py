"""Planner benchmark: plan quality against the expert defaults, solve and re-plan times.

The whole decision space is searched, pipelines included.

    .venv/bin/python benchmarks/bench_solver.py            # hand-built LLaMA-70B chain
    .venv/bin/python benchmarks/bench_solver.py --analyze  # LLaMA-70B analyzed from zoo.llama_70b() on meta

Prints four tables: (1) on the zoo, at equal budget, the solver's predicted step time
against the expert defaults (every block its own FULL_SHARD unit, without and with full
checkpointing) as a ratio; (2) solve times of LLaMA-70B shapes at world 8, 64 and 1024,
against the target (10 s); (3) the same with 8 sequences of 1024 tokens, whose
micro-batch counts let 1F1B pipelines in (the outer enumeration at work); (4) re-planning
with a new budget from the cached chain, against its target (1 s).
"""

import argparse
import time

from shardplan.common.dtypes import dtype_name
from shardplan.common.sizes import format_bytes
from shardplan.compile import solve
from shardplan.costmodel.hardware import get_hardware
from shardplan.errors import InfeasibleError
from shardplan.frontend.chain import Block, BlockChain, InputSpec, TensorParallelFacts
from shardplan.plan import BF16_MIXED, MixedPrecision
from shardplan.solver.explain import expert_defaults
from shardplan.solver.search import Setting

ZOO_MODELS = ("gpt", "mlp", "cnn", "encoder-decoder", "hf-gpt2", "hf-llama")
BUDGET_FRACTIONS = (1.0, 0.75, 0.5)
"""Budgets as fractions of the expert default's peak (FULL_SHARD per block, no checkpointing)."""
SOLVE_TARGET_S = 10.0
"""LLaMA-70B shapes at world 8, 64 and 1024 compile in under 10 s each on this machine."""
REPLAN_TARGET_S = 1.0
"""Re-planning with a new budget from the cached analysis in under 1 s."""


def llama_70b_chain(batch: int = 1, seq: int = 4096) -> BlockChain:
    """LLaMA-2-70B as the front end reports it, from its shapes: fp32 parameters, as built on meta, computing in
    bf16, as analyze(compute_dtype="bfloat16") records it for a bf16 mixed-precision plan.

    Per layer: q, o 8192² + k, v 8192×1024 + gate, up, down 8192×28672 + 2 norms; FLOPs 2 × params
    × tokens + causal attention 4·s²·d; saved ≈ 20 bf16 activations of b·s·d (norm inputs, q/k/v,
    attention output, MLP gate/up/activation, residual stream); transients of the attention and MLP.
    Over tp ranks (chain.TensorParallelFacts): a layer slices all but its norms, every FLOP and 14 of
    its 20 saved activations (the norms' inputs and outputs and the residual stay whole), tp dividing
    its 8 kv heads; the embedding and the head slice over the 32000-row vocabulary."""
    tokens, width, vocab = batch * seq, 8192, 32000
    stream = tokens * width * 2
    layer_numel = 2 * width * width + 2 * width * 1024 + 3 * width * 28672 + 2 * width

    def block(index, name, numel, fwd, saved, transient, facts):
        return Block(
            index=index,
            name=name,
            modules=(name,),
            param_names=(f"{name}.weight",),
            param_numel=numel,
            param_bytes=4 * numel,
            buffer_bytes=0,
            fwd_flops=fwd,
            bwd_flops=2 * fwd,
            saved_bytes=saved,
            input_bytes=stream if index else tokens * 8,
            output_bytes=stream,
            fwd_transient_bytes=transient,
            bwd_transient_bytes=2 * transient,
            first_node=name,
            last_node=name,
            tensor_parallel=facts,
        )

    def sliced(divides, numel, fwd, saved, all_reduces, **more):
        return TensorParallelFacts(
            divides=divides,
            sliced_numel=numel,
            sliced_fwd_flops=fwd,
            sliced_bwd_flops=2 * fwd,
            sliced_saved_bytes=saved,
            all_reduces=all_reduces,
            exchange_bytes=stream,
            **more,
        )

    layer_fwd = 2 * layer_numel * tokens + 4 * seq * seq * width * batch
    blocks = [
        block(
            0,
            "model.embed_tokens",
            vocab * width,
            0,
            tokens * 8,
            stream,
            sliced(vocab, vocab * width, 0, 0, 1),
        )
    ]
    blocks += [
        block(
            i + 1,
            f"model.layers.{i}",
            layer_numel,
            layer_fwd,
            20 * stream,
            8 * stream,
            sliced(8, layer_numel - 2 * width, layer_fwd, 14 * stream, 4, sequence_layer=True),
        )
        for i in range(80)
    ]
    head_fwd = 2 * vocab * width * tokens
    blocks.append(
        block(
            81,
            "lm_head",
            vocab * width + width,
            head_fwd,
            stream + tokens * vocab * 2,
            2 * tokens * vocab * 2,
            sliced(vocab, vocab * width, head_fwd, tokens * vocab * 2, 1),
        )
    )
    return BlockChain(
        blocks=tuple(blocks),
        fingerprint="llama-70b-shapes",
        param_dtype="torch.float32",
        compute_dtype=BF16_MIXED.param_dtype,
        inputs=(InputSpec(name="0", shape=(batch, seq), dtype="int64"),),
        input_bytes=tokens * 8,
        extra={"model": "LlamaForCausalLM"},
    )


def analyzed(name: str, compute_dtype: str | None = None) -> BlockChain:
    import torch

    from shardplan.frontend.passes import analyze
    from shardplan.models import zoo

    torch.set_num_threads(1)
    entry = zoo.build(name)
    return analyze(entry.model, entry.args, entry.kwargs, compute_dtype=compute_dtype)


def quality_table(world_size: int, hardware: str) -> None:
    hw = get_hardware(hardware)
    print(
        f"\n(1) plan quality on the zoo, world_size={world_size}, {hardware}: predicted step time, "
        "solver vs expert defaults at equal budget"
    )
    print(
        f"{'model':<16} {'budget':>11} {'solver s':>11} {'plan':<34} {'FSDP/block s':>12} {'ratio':>6} "
        f"{'+ckpt s':>11} {'ratio':>6}"
    )
    for name in ZOO_MODELS:
        chain = analyzed(name)
        dtype = dtype_name(chain.param_dtype)
        setting = Setting(
            world_size=world_size,
            batch_size=chain.inputs[0].shape[0],
            mixed_precision=MixedPrecision(param_dtype=dtype, reduce_dtype=dtype),
        )
        (_, plain), (_, checkpointed) = expert_defaults(chain, setting, hw)
        for fraction in BUDGET_FRACTIONS:
            budget = int(plain.peak_bytes * fraction)
            try:
                plan = solve(chain, world_size, hardware=hw, memory_budget=budget)
            except InfeasibleError:
                print(f"{name:<16} {format_bytes(budget):>11} {'infeasible':>11}")
                continue
            shape = (
                f"dp={plan.mesh.dp} pp={plan.mesh.pp} m={plan.schedule.num_micro_batches} "
                f"{len(plan.units)} units"
            )
            cells = []
            for baseline in (plain, checkpointed):
                if baseline.peak_bytes <= budget:
                    assert plan.predicted.step_time_s <= baseline.step_time_s * (1 + 1e-9), (
                        name,
                        fraction,
                    )
                    cells.append(
                        f"{baseline.step_time_s:>12.4g} {baseline.step_time_s / plan.predicted.step_time_s:>6.2f}"
                    )
                else:
                    cells.append(f"{'over budget':>12} {'-':>6}")
            print(
                f"{name:<16} {format_bytes(budget):>11} {plan.predicted.step_time_s:>11.4g} {shape:<34} "
                + " ".join(cells)
            )


def solve_times(chain: BlockChain, title: str) -> None:
    print(
        f"\n{title}, {len(chain.blocks)} blocks, h100-80g, bf16 params, default budget (usable memory)"
    )
    print(f"{'world':>6} {'offload':>8} {'solve s':>8} {'target s':>9} {'ratio':>6}  result")
    for world, offload in ((8, False), (8, True), (64, False), (1024, False)):
        start = time.perf_counter()
        try:
            plan = solve(
                chain, world, hardware="h100-80g", mixed_precision=BF16_MIXED, allow_offload=offload
            )
            result = (
                f"{plan.mesh.describe()}, {len(plan.units)} units, peak "
                f"{format_bytes(plan.predicted.peak_bytes)}, step {plan.predicted.step_time_s:.3f} s, "
                f"MFU {plan.predicted.mfu:.1%}"
            )
        except InfeasibleError as error:
            result = f"InfeasibleError: {error}"
        took_s = time.perf_counter() - start
        print(
            f"{world:>6} {str(offload):>8} {took_s:>8.2f} {SOLVE_TARGET_S:>9.0f} {took_s / SOLVE_TARGET_S:>6.2f}  "
            f"{result}"
        )


def replan_times(chain: BlockChain) -> None:
    print("\n(4) re-plan from the cached chain (no capture): world 64, new budgets")
    print(f"{'budget':>8} {'solve s':>8} {'target s':>9} {'ratio':>6}  result")
    for budget in ("70GiB", "50GiB", "40GiB"):
        start = time.perf_counter()
        try:
            plan = solve(
                chain, 64, hardware="h100-80g", memory_budget=budget, mixed_precision=BF16_MIXED
            )
            result = f"peak {format_bytes(plan.predicted.peak_bytes)}, step {plan.predicted.step_time_s:.3f} s"
        except InfeasibleError as error:
            result = f"InfeasibleError: {error}"
        took_s = time.perf_counter() - start
        print(
            f"{budget:>8} {took_s:>8.2f} {REPLAN_TARGET_S:>9.0f} {took_s / REPLAN_TARGET_S:>6.2f}  {result}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--analyze",
        action="store_true",
        help="analyze zoo.llama_70b() instead of the hand-built chain",
    )
    parser.add_argument("--skip-zoo", action="store_true", help="only the LLaMA-70B tables")
    options = parser.parse_args()
    if not options.skip_zoo:
        quality_table(8, "cpu-gloo")
    if options.analyze:
        start = time.perf_counter()
        chain = analyzed("llama-70b", compute_dtype=BF16_MIXED.param_dtype)
        source = f"analyzed in {time.perf_counter() - start:.1f} s"
    else:
        chain, source = llama_70b_chain(), "hand-built shapes"
    solve_times(chain, f"(2) solve time, LLaMA-70B ({source}, 1 sequence of 4096)")
    solve_times(
        llama_70b_chain(batch=8, seq=1024),
        "(3) solve time, LLaMA-70B (hand-built shapes, 8 sequences of 1024: micro-batches and pipelines)",
    )
    replan_times(chain)


if __name__ == "__main__":
    main()
