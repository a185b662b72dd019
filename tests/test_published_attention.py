"""A captured model's attention on the GPU profiles: priced as FlashAttention-2 runs it, at the published rates the
hand-built chains of bench_published.py price it at (benchmarks/bench_published.py --captured-attention)."""
import pytest
import torch

from shardplan import get_hardware, zoo
from shardplan.cost import CostContext, kind_time_s
from shardplan.passes import analyze
from shardplan.passes.execution import op_masked_flops
from test_published import bench  # noqa: F401 (the fixture: benchmarks/bench_published.py as a module)


@pytest.mark.parametrize("zoo_name, hardware, tp", [
    ("llama-7b", "h100-80g", 1), ("llama-7b", "h200", 1), ("llama-7b", "a100-80g", 1), ("llama-7b", "h100-80g", 2),
    ("llama-7b", "h100-80g", 4), ("llama-70b", "h100-80g", 1), ("llama-70b", "h100-80g", 8)])
def test_a_captured_llama_layers_attention_costs_what_the_hand_built_chains_does(bench, zoo_name, hardware, tp):
    """LLaMA-7B's layer captured as compile captures it (on meta, analysed on fake CPU tensors) names CPU's flash
    attention op and counts its FLOPs over every score; the chain built by hand names FlashAttention-2's and counts
    them causal-halved. On a GPU profile both cost the same, forward and backward, on a tp rank's heads too (before:
    the captured one at the plain matmul rate on twice the FLOPs, 0.76x and 0.67x the hand-built time on h100-80g).
    So does LLaMA-2-70B's, whose 64 query heads share 8 key-value heads (grouped-query attention)."""
    found = bench.attention_ms(get_hardware(hardware), tp=tp, zoo_name=zoo_name)
    for captured, built in zip(found["captured"], found["hand-built"]):
        assert captured == pytest.approx(built, rel=0.02)


def test_an_encoders_attention_runs_all_its_flops_at_flashattention_2s_published_rates(bench):
    """No causal mask (BERT): every FLOP torch counts runs, at FlashAttention-2's published H100 rates (forward 301
    TFLOP/s, backward 266, at the 0.848 of a burst a step holds), as the hand-built chains' causal calls run theirs."""
    entry = zoo.hf_bert(n_layer=1, d_model=2048, batch=1, seq=4096, device="meta")
    layer = next(block for block in analyze(entry.model, entry.args, entry.kwargs).blocks
                 if block.name == "bert.encoder.layer.0")
    hw = get_hardware("h100-80g")
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    for kinds, published in ((layer.fwd_kinds, 301e12), (layer.bwd_kinds, 266e12)):
        (attention,) = [kind for kind in kinds if kind.name.startswith(bench.ATTENTION)]
        assert attention.masked_flops == 0
        rate = attention.flops / (kind_time_s(attention, ctx) - hw.op_overhead_s)
        assert rate == pytest.approx(published * 0.848, rel=0.015)


def test_a_causal_calls_masked_flops_are_those_of_its_scores_above_the_diagonal():
    """torch's causal mask keeps query row i the keys 0..i: of 16 x 16 scores 120 are masked, of 16 rows over
    32 keys 376 (16 x 32 less 1 + 2 + ... + 16), of 32 rows over 16 keys 120 (the rows past the last key keep all)."""
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    short, long = torch.empty(2, 4, 16, 8), torch.empty(2, 4, 32, 8)
    assert op_masked_flops(forward, (short, short, short), {"is_causal": True}, 256 * 1000) == 120 * 1000
    assert op_masked_flops(forward, (short, long, long, 0.0, True), {}, 512 * 1000) == 376 * 1000
    assert op_masked_flops(forward, (long, short, short), {"is_causal": True}, 512 * 1000) == 120 * 1000
    assert op_masked_flops(forward, (short, short, short), {}, 256 * 1000) == 0
    assert op_masked_flops(backward, (short, short, short, short, short, short, 0.0, True), {}, 256 * 1000) == 120 * 1000


def test_masked_flops_are_read_only_off_attention_ops_laid_out_as_sdpa_takes_them():
    """CUDA's SDPA ops lay query and key out (batch, heads, sequence, head dim) as CPU's does; the flash kernel
    under them, `_flash_attention_forward`, lays them (batch, sequence, heads, head dim), where the second-last
    dimension is the heads (before: 32 heads of 128 read as 32 rows, 0.484 of its FLOPs masked). It, and any op
    outside SDPA_LAYOUT_ATTENTION, masks none."""
    short = torch.empty(2, 4, 16, 8)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert op_masked_flops(efficient, (short, short, short, None, False, 0.0, True), {}, 256 * 1000) == 120 * 1000
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    assert op_masked_flops(cudnn, (short, short, short, None, False), {"is_causal": True}, 256 * 1000) == 120 * 1000
    sequence_first = torch.empty(1, 4096, 32, 128)
    assert op_masked_flops(torch.ops.aten._flash_attention_forward.default,
                           (sequence_first, sequence_first, sequence_first, None, None, 4096, 4096, 0.0, True), {},
                           10**12) == 0


def test_cpu_gloo_prices_a_causal_call_on_every_flop_it_counts():
    """CPU's flash kernel computes every key block up to the diagonal's whole (512 keys wide), so all of a causal call
    of up to 512 keys: cpu-gloo's factors are against torch's count, and its price of a call ignores the mask."""
    entry = zoo.gpt(zoo.GPTConfig(n_layer=1))
    layer = next(block for block in analyze(entry.model, entry.args, entry.kwargs).blocks if block.name == "h.0")
    (attention,) = [kind for kind in layer.fwd_kinds if kind.name == "_scaled_dot_product_flash_attention_for_cpu"]
    assert 0 < attention.masked_flops < attention.flops
    cpu = get_hardware("cpu-gloo")
    assert cpu.compute_time_s(attention.flops, attention.bytes, op=attention.name, masked_flops=attention.masked_flops) \
        == cpu.compute_time_s(attention.flops, attention.bytes, op=attention.name)
