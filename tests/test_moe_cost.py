"""The analysis prices routed experts: their grouped matmuls have FLOPs, forward and backward.

transformers 5 runs a mixture of experts' matmuls as grouped matmuls over the routed rows (sorted by
expert, split by offsets): `_grouped_mm` eagerly, its `grouped_mm_fallback` custom ops once captured.
torch's FlopCounterMode knows neither; before execution.EXTRA_FLOP_FORMULAS priced them, a Mixtral
layer counted fewer FLOPs than a Llama layer of the same width.
"""

import pytest

from shardplan.frontend.passes import analyze
from shardplan.frontend.passes.execution import flop_counter
from shardplan.models import zoo

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ


def _routed_expert_flops(config) -> int:
    """Every token through top-k experts, each a gated MLP: gate and up (hidden → inter), down (inter → hidden)."""
    inter = getattr(config, "moe_intermediate_size", config.intermediate_size)
    return config.num_experts_per_tok * TOKENS * 3 * 2 * config.hidden_size * inter


def _analytic_forward_flops(config) -> int:
    """Mixtral / Qwen2-MoE forward, matmuls only: per layer attention, router, routed (and shared) experts; the head."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    projections = (
        2 * TOKENS * hidden * (2 * hidden + 2 * config.num_key_value_heads * head_dim)
    )  # q, o; k, v
    attention = (
        2 * 2 * BATCH * heads * SEQ * SEQ * head_dim
    )  # scores, their product with v; torch counts no mask
    experts = getattr(config, "num_local_experts", None) or config.num_experts
    router = 2 * TOKENS * hidden * experts
    shared = getattr(config, "shared_expert_intermediate_size", 0)
    shared_expert = 3 * 2 * TOKENS * hidden * shared + (
        2 * TOKENS * hidden if shared else 0
    )  # and its 1-wide gate
    layer = projections + attention + router + _routed_expert_flops(config) + shared_expert
    return config.num_hidden_layers * layer + 2 * TOKENS * hidden * config.vocab_size


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"])
def test_routed_experts_are_priced_forward_and_backward(name):
    entry = zoo.hf_architecture(name, batch=BATCH, seq=SEQ)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    layer = next(
        b for b in chain.blocks if b.name == "model.layers.1"
    )  # DeepSeek-V3's layer 0 is dense
    forward = {k.name: k.flops for k in layer.fwd_kinds}
    backward = {k.name: k.flops for k in layer.bwd_kinds}
    routed = _routed_expert_flops(entry.model.config)
    # the grouped matmuls run (and are counted) as one mm per expert (execution.GROUPED_MATMULS), beside
    # the layer's linears (its 2-D weights; biased ones an addmm)
    dense = (
        2
        * TOKENS
        * sum(p.numel() for p in entry.model.model.layers[1].parameters() if p.dim() == 2)
    )
    assert forward["mm"] + forward.get("addmm", 0) == dense + routed
    assert backward["mm"] == 2 * (dense + routed)  # the input's gradient and the weights'


@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe"])
def test_moe_flops_match_the_analytic_count_and_eager(name):
    entry = zoo.hf_architecture(name, batch=BATCH, seq=SEQ)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    expected = _analytic_forward_flops(entry.model.config)
    assert chain.fwd_flops == pytest.approx(expected, rel=0.01)
    with flop_counter() as forward:  # eager runs torch's `_grouped_mm`, not the captured custom op
        output = entry.model(*entry.args, **entry.kwargs)
    assert forward.get_total_flops() == pytest.approx(expected, rel=0.01)
    with (
        flop_counter() as backward
    ):  # its backward: grouped matmuls of other shapes (2-D by 2-D for the weights)
        output.loss.backward()
    assert chain.bwd_flops == pytest.approx(backward.get_total_flops(), rel=0.01)
