"""benchmarks/bench_published.py --breakdown: the single-node budget it prints is what the cost model prices."""

import dataclasses

import pytest

from shardplan.costmodel.cost import CostContext, _block_times_s, kind_time_s
from shardplan.costmodel.hardware import get_hardware


@pytest.mark.parametrize("model", ["playbook-1B", "playbook-3B"])
def test_a_layers_op_kinds_add_up_to_what_the_cost_model_prices_it(published_bench, model):
    hw = get_hardware("h100-80g")
    dims = published_bench.MODELS[model]
    chain = published_bench.llama_chain(dims, 1, 4096, pipelined=False)
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    breakdown = published_bench.op_breakdown(dims, hw)
    for part, block in (("layer", chain.blocks[1]), ("head", chain.blocks[-1])):
        fwd_s, bwd_s, _ = _block_times_s(block, ctx)
        assert sum(seconds for _, seconds, _, _ in breakdown[part]) == pytest.approx(
            fwd_s + bwd_s, rel=1e-9
        )
    assert {name for name, *_ in breakdown["layer"]} == {
        "mm",
        published_bench.ATTENTION,
        "rms_norm",
        "rotary",
        "add",
        "silu_mul",
        "layout_copy",
    }


def test_a_sequence_measured_and_predicted_comes_from_the_one_node_rows(published_bench):
    row = published_bench.Row(
        model="playbook-1B",
        n_gpus=8,
        dp=8,
        tp=1,
        pp=1,
        micro_batch_size=2,
        grad_accum=16,
        seq_len=4096,
        zero_stage="0",
        status="ok",
        tokens_per_s_per_gpu=40150.0,
        line=0,
    )
    elsewhere = [
        dataclasses.replace(row, n_gpus=16, dp=16, grad_accum=8),
        dataclasses.replace(row, tp=2, dp=4, grad_accum=32),
    ]
    hw = get_hardware("h100-80g")
    found = published_bench.per_sequence_s([row] + elsewhere, "playbook-1B", hw)
    (outcome,) = published_bench.predict([row], hw)
    assert list(found) == [2]
    measured, predicted = found[2]
    assert measured == pytest.approx(
        4096 / 40150.0
    )  # a sequence of 4096 tokens at the rank's tokens/s
    assert predicted == pytest.approx(4096 / outcome.tokens_per_s_per_gpu)


def test_flash_attention_runs_at_flashattention_2s_published_h100_rates_at_a_steps_clock(
    published_bench,
):
    """FlashAttention-2 on H100, causal, at 4096 keys, on the FLOPs it runs (the unmasked half): the 1B's heads of 64
    at forward 284 TFLOP/s, backward 247.6, both at the 0.848 of a burst a step holds, at one sequence a call and at
    32 alike (the rate is the sequence's, not the call's size)."""
    hw = get_hardware("h100-80g")
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    for sequences in (1, 4, 32):  # a call of 6.9e10, 2.7e11 and 2.2e12 forward FLOPs
        layer = published_bench.llama_chain(
            published_bench.MODELS["playbook-1B"], sequences, 4096, pipelined=False
        ).blocks[1]
        for kinds, published in ((layer.fwd_kinds, 284e12), (layer.bwd_kinds, 247.6e12)):
            (attention,) = [k for k in kinds if k.name.startswith(published_bench.ATTENTION)]
            rate = (attention.flops - attention.masked_flops) / (
                kind_time_s(attention, ctx) - hw.op_overhead_s
            )
            assert rate == pytest.approx(published * 0.848, rel=0.015)


def test_a_layer_and_the_loss_move_the_bytes_nanotrons_kernels_move(published_bench):
    """Per token, in bf16: the attention's layout copies 2 q + 6 k + 6 v forward, 4 q + 6 k + 6 v and the MLP's
    gate/up cat 4 i backward; the loss 38 bytes a logit forward and 14 backward (models/llama.py,
    tensor_parallel/functional.py)."""
    dims = published_bench.MODELS["playbook-1B"]
    tokens, h, i, v = 4096, dims.hidden, dims.intermediate, dims.vocab
    chain = published_bench.llama_chain(dims, 1, 4096, pipelined=False)
    layer, head = chain.blocks[1], chain.blocks[-1]

    def moved(kinds, name: str) -> int:
        return sum(k.bytes for k in kinds if k.name == name)

    assert moved(layer.fwd_kinds, "layout_copy") == 2 * tokens * (2 * h + 6 * h + 6 * h)
    assert moved(layer.bwd_kinds, "layout_copy_backward") == 2 * tokens * (
        4 * h + 6 * h + 6 * h + 4 * i
    )
    assert moved(head.fwd_kinds, "cross_entropy") == 38 * tokens * v
    assert moved(head.bwd_kinds, "cross_entropy_backward") == 14 * tokens * v
