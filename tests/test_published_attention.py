"""A captured model's attention on the GPU profiles: priced as FlashAttention-2 runs it, at the published rates of
its sequence length (HardwareProfile.attention_rates), which the hand-built chains of bench_published.py are priced
at too (benchmarks/bench_published.py --captured-attention)."""

import pytest
import torch

from shardplan import get_hardware
from shardplan.costmodel.cost import CostContext, kind_time_s
from shardplan.costmodel.hardware import attention_sequence
from shardplan.frontend.passes import analyze
from shardplan.frontend.passes.execution import op_masked_flops
from shardplan.models import zoo

SEQUENCES = (512, 1024, 2048, 4096, 8192, 16384)
"""The sequence lengths FlashAttention's benchmarks ran, 16k tokens a batch, hidden 2048."""
A100_FWD_BWD = {
    ("causal", 64): (88, 119, 140, 156, 165, 171),
    ("causal", 128): (99, 133, 155, 173, 182, 189),
    ("full", 64): (132, 153, 162, 171, 175, 176),
    ("full", 128): (151, 173, 187, 196, 201, 203),
}
"""FlashAttention-2 forward + backward TFLOP/s on A100 80GB SXM4 by (mask, head dim), at SEQUENCES: Dao 2023,
FlashAttention-2, fig. 4 (flash-attention's assets/flash2_a100_fwd_bwd_benchmark.png)."""
H100_FWD = {
    ("causal", 64): (180, 229, 262, 284, 295, 299),
    ("causal", 128): (191, 260, 298, 319, 333, 335),
    ("full", 64): (282, 306, 318, 321, 322, 324),
    ("full", 128): (309, 350, 362, 368, 370, 370),
}
"""FlashAttention-2 forward TFLOP/s on H100 80GB SXM5: FlashAttention-3's fig. 5 (assets/flash3_fp16_fwd.png)."""
H100_FWD_BWD = {
    ("causal", 64): (141, 192, 232, 257, 273, 284),
    ("causal", 128): (163, 221, 265, 294, 308, 328),
    ("full", 64): (215, 254, 274, 288, 294, 296),
    ("full", 128): (248, 294, 320, 326, 335, 338),
}
"""FlashAttention-2 forward + backward TFLOP/s on H100 80GB SXM5: Dao 2023, fig. 7
(assets/flash2_h100_fwd_bwd_benchmark.png)."""
FORWARD, BACKWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
)


A100_FORWARD_OVER_BACKWARD = 73 / 63
"""FlashAttention-2 reaches up to 73% of the A100's peak forward and up to 63% backward (Dao 2023, sec. 1): on A100,
whose per-direction figures by sequence are not read, the forward runs at this multiple of the backward's rate."""


def published(hardware: str) -> tuple[dict, dict]:
    """(forward, forward + backward) TFLOP/s of `hardware` at SEQUENCES: on H100 (and H200) FlashAttention-3's forward
    figure; on A100 the forward what A100_FORWARD_OVER_BACKWARD makes of the forward + backward figure (the backward
    2.5 / (3.5 / both - 1 / forward) = forward / ratio)."""
    if not hardware.startswith("a100"):
        return H100_FWD, H100_FWD_BWD
    ratio = A100_FORWARD_OVER_BACKWARD
    forward = {
        key: tuple(both * (1 + 2.5 * ratio) / 3.5 for both in figures)
        for key, figures in A100_FWD_BWD.items()
    }
    return forward, A100_FWD_BWD


@pytest.mark.parametrize("hardware", ["a100-40g", "a100-80g", "h100-80g", "h200"])
def test_each_sequence_and_head_dims_rate_is_the_published_one(hardware):
    """At every sequence and head dim the benchmarks ran, causal or not: the forward at its published rate (on H100
    and H200, H100's die at its clocks, FlashAttention-3's figure; on A100 the forward + backward figure's split by
    A100_FORWARD_OVER_BACKWARD), and a forward with its backward (2.5x its FLOPs) take the time FlashAttention-2's
    forward + backward figure gives."""
    rates = get_hardware(hardware).attention_rates
    forward, both = published(hardware)
    for (mask, dim), figures in both.items():
        for index, sequence in enumerate(SEQUENCES):
            fwd, bwd = (
                rates[op].flops_per_s(sequence, causal=mask == "causal", head_dim=dim) / 1e12
                for op in (FORWARD, BACKWARD)
            )
            assert fwd == pytest.approx(forward[mask, dim][index], rel=1e-3)
            assert 3.5 / (1 / fwd + 2.5 / bwd) == pytest.approx(figures[index], rel=1e-3)


def causal_call(sequence: int, head_dim: int, *, backward: bool) -> tuple[int, int, int]:
    """(FLOPs as torch counts them, the masked ones, bytes) of one causal attention call in bf16 of the benchmarks'
    shape: 16k tokens a batch (one sequence past 16k), 2048 wide."""
    batch, heads = max(1, 16384 // sequence), 2048 // head_dim
    flops = (10 if backward else 4) * batch * heads * sequence**2 * head_dim
    masked = flops * (sequence - 1) // (2 * sequence)  # torch's mask keeps row i the keys 0..i
    return flops, masked, (8 if backward else 4) * batch * heads * sequence * head_dim * 2


@pytest.mark.parametrize("hardware", ["a100-80g", "h100-80g"])
def test_a_causal_call_is_priced_at_its_sequences_published_rate_between_and_past_the_published_ones(
    hardware,
):
    """A hand-made causal call of the benchmarks' shape, its head dim unknown, runs its unmasked FLOPs at the mean of
    the two head dims' published rates at its sequence, at the share of a burst a
    step sustains; a sequence between two published ones between their rates; one past 16k, as a 65k sequence of
    llm-foundry's MPT runs, on the published curve continued toward its ceiling: a few percent faster."""
    hw = get_hardware(hardware)
    sustained = hw.matmul["bfloat16"].sustained_share
    forward, both = published(hardware)

    def priced(sequence: int, head_dim: int, backward: bool) -> float:
        flops, masked, nbytes = causal_call(sequence, head_dim, backward=backward)
        time_s = hw.compute_time_s(
            flops, nbytes, "bfloat16", op=BACKWARD if backward else FORWARD, masked_flops=masked
        )
        return (flops - masked) / (time_s - hw.op_overhead_s) / 1e12

    for index, sequence in enumerate(SEQUENCES):
        expected_fwd = sum(forward["causal", dim][index] for dim in (64, 128)) / 2 * sustained
        for dim in (64, 128):
            fwd, bwd = priced(sequence, dim, False), priced(sequence, dim, True)
            assert fwd == pytest.approx(expected_fwd, rel=0.01)
            assert bwd <= fwd * (1 + 1e-9)  # FlashAttention-2's backward runs slower
    assert priced(1024, 128, False) < priced(1448, 128, False) < priced(2048, 128, False)
    longest = sum(forward["causal", dim][-1] for dim in (64, 128)) / 2 * sustained
    continued = sum(_continued(forward["causal", dim], 65536) for dim in (64, 128)) / 2
    assert longest < continued * sustained < 1.05 * longest
    assert priced(65536, 128, False) == pytest.approx(continued * sustained, rel=0.01)
    assert priced(65536, 128, True) <= priced(65536, 128, False) * (1 + 1e-9)


def _continued(rates: list[float], sequence: int) -> float:
    """A published curve past its longest sequence: rate = ceiling x S / (S + S0) through its last two points."""
    (s1, r1), (s2, r2) = zip(SEQUENCES[-2:], rates[-2:])
    # r = c S / (S + S0) at both points: S0 = s1 s2 (r2 - r1) / (r1 s2 - r2 s1), c = r2 (s2 + S0) / s2
    s0 = s1 * s2 * (r2 - r1) / (r1 * s2 - r2 * s1)
    return r2 * (s2 + s0) / s2 * sequence / (sequence + s0)


def test_a_captured_calls_sequence_is_read_off_its_flops_and_bytes_and_its_head_dim_recorded(
    published_bench,
):
    """LLaMA-7B's layer captured computing in bf16 (as compile captures it) and built by hand: its attention's
    forward and backward read as the sequence they run over, within the 0.4% the log-sum-exp adds to the bytes,
    and carry its head dim, 128 (4096 wide over 32 heads), which the FLOPs and bytes cannot tell."""
    for sequence in (1024, 4096):
        for layer in published_bench.captured_and_built_layer("llama-7b", sequence):
            for kind in (*layer.fwd_kinds, *layer.bwd_kinds):
                if kind.name.startswith(published_bench.ATTENTION):
                    assert attention_sequence(
                        kind.flops, kind.bytes, 2, backward=kind.name.endswith("_backward")
                    ) == pytest.approx(sequence, rel=0.005)
                    assert kind.head_dim_flops == 128 * kind.flops


@pytest.mark.parametrize(
    "zoo_name, hardware, tp",
    [
        ("llama-7b", "h100-80g", 1),
        ("llama-7b", "h200", 1),
        ("llama-7b", "a100-80g", 1),
        ("llama-7b", "h100-80g", 2),
        ("llama-7b", "h100-80g", 4),
        ("llama-70b", "h100-80g", 1),
        ("llama-70b", "h100-80g", 8),
    ],
)
def test_a_captured_llama_layers_attention_costs_what_the_hand_built_chains_does(
    published_bench, zoo_name, hardware, tp
):
    """LLaMA-7B's layer captured as compile captures it (on meta, analysed on fake CPU tensors) names CPU's flash
    attention op and counts its FLOPs over every score; the chain built by hand names FlashAttention-2's and counts
    them causal-halved. On a GPU profile both cost the same, forward and backward, on a tp rank's heads too (before:
    the captured one at the plain matmul rate on twice the FLOPs, 0.76x and 0.67x the hand-built time on h100-80g).
    So does LLaMA-2-70B's, whose 64 query heads share 8 key-value heads (grouped-query attention)."""
    found = published_bench.attention_ms(get_hardware(hardware), tp=tp, zoo_name=zoo_name)
    for captured, built in zip(found["captured"], found["hand-built"]):
        assert captured == pytest.approx(built, rel=0.02)


def test_an_encoders_attention_runs_all_its_flops_at_flashattention_2s_published_rates(
    published_bench,
):
    """No causal mask (BERT, 4 heads of 128): every FLOP torch counts runs, at FlashAttention-2's published H100
    rates without a mask for its head dim at its 4096 keys (forward 368 TFLOP/s, backward 312 from forward +
    backward's 326), at the 0.848 of a burst a step holds."""
    entry = zoo.hf_bert(n_layer=1, d_model=512, batch=1, seq=4096, device="meta")
    layer = next(
        block
        for block in analyze(entry.model, entry.args, entry.kwargs, compute_dtype="bfloat16").blocks
        if block.name == "bert.encoder.layer.0"
    )
    hw = get_hardware("h100-80g")
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    for kinds, published in (
        (layer.fwd_kinds, 368e12),
        (layer.bwd_kinds, 2.5 / (3.5 / 326 - 1 / 368) * 1e12),
    ):
        (attention,) = [kind for kind in kinds if kind.name.startswith(published_bench.ATTENTION)]
        assert attention.masked_flops == 0
        rate = attention.flops / (kind_time_s(attention, ctx) - hw.op_overhead_s)
        assert rate == pytest.approx(published * 0.848, rel=0.015)


def test_a_causal_calls_masked_flops_are_those_of_its_scores_above_the_diagonal():
    """torch's causal mask keeps query row i the keys 0..i: of 16 x 16 scores 120 are masked, of 16 rows over
    32 keys 376 (16 x 32 less 1 + 2 + ... + 16), of 32 rows over 16 keys 120 (the rows past the last key keep all)."""
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    short, long = torch.empty(2, 4, 16, 8), torch.empty(2, 4, 32, 8)
    assert (
        op_masked_flops(forward, (short, short, short), {"is_causal": True}, 256 * 1000)
        == 120 * 1000
    )
    assert op_masked_flops(forward, (short, long, long, 0.0, True), {}, 512 * 1000) == 376 * 1000
    assert (
        op_masked_flops(forward, (long, short, short), {"is_causal": True}, 512 * 1000)
        == 120 * 1000
    )
    assert op_masked_flops(forward, (short, short, short), {}, 256 * 1000) == 0
    assert (
        op_masked_flops(
            backward, (short, short, short, short, short, short, 0.0, True), {}, 256 * 1000
        )
        == 120 * 1000
    )


def test_masked_flops_are_read_only_off_attention_ops_laid_out_as_sdpa_takes_them():
    """CUDA's SDPA ops lay query and key out (batch, heads, sequence, head dim) as CPU's does; the flash kernel
    under them, `_flash_attention_forward`, lays them (batch, sequence, heads, head dim), where the second-last
    dimension is the heads (before: 32 heads of 128 read as 32 rows, 0.484 of its FLOPs masked). It, and any op
    outside SDPA_LAYOUT_ATTENTION, masks none."""
    short = torch.empty(2, 4, 16, 8)
    efficient = torch.ops.aten._scaled_dot_product_efficient_attention.default
    assert (
        op_masked_flops(efficient, (short, short, short, None, False, 0.0, True), {}, 256 * 1000)
        == 120 * 1000
    )
    cudnn = torch.ops.aten._scaled_dot_product_cudnn_attention.default
    assert (
        op_masked_flops(cudnn, (short, short, short, None, False), {"is_causal": True}, 256 * 1000)
        == 120 * 1000
    )
    sequence_first = torch.empty(1, 4096, 32, 128)
    assert (
        op_masked_flops(
            torch.ops.aten._flash_attention_forward.default,
            (sequence_first, sequence_first, sequence_first, None, None, 4096, 4096, 0.0, True),
            {},
            10**12,
        )
        == 0
    )


def test_cpu_gloo_prices_a_causal_call_on_every_flop_it_counts():
    """CPU's flash kernel computes every key block up to the diagonal's whole (512 keys wide), so all of a causal call
    of up to 512 keys: cpu-gloo's factors are against torch's count, and its price of a call ignores the mask."""
    entry = zoo.gpt(zoo.GPTConfig(n_layer=1))
    layer = next(
        block
        for block in analyze(entry.model, entry.args, entry.kwargs).blocks
        if block.name == "h.0"
    )
    (attention,) = [
        kind
        for kind in layer.fwd_kinds
        if kind.name == "_scaled_dot_product_flash_attention_for_cpu"
    ]
    assert 0 < attention.masked_flops < attention.flops
    cpu = get_hardware("cpu-gloo")
    assert cpu.compute_time_s(
        attention.flops, attention.bytes, op=attention.name, masked_flops=attention.masked_flops
    ) == cpu.compute_time_s(attention.flops, attention.bytes, op=attention.name)
