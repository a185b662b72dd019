"""Selective checkpointing keeps a mixture of experts' grouped matmuls, and the analysis counts what it keeps.

Routed experts run eagerly as `_grouped_mm` and, captured by export, as transformers' `grouped_mm_fallback`
(tests/test_moe_cost.py). Before plan.SELECTIVE_SAVED_OPS named `_grouped_mm`, a selective layer's backward
reran every expert matmul of its forward, and the analysis' selective bytes left their outputs out.
"""

import torch
from op_calls import OpCalls

from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint
from shardplan.runtime.activation_checkpoint import checkpointed

BATCH, SEQ = 2, 16
TOKENS = BATCH * SEQ
FLOAT32_BYTES = 4


def _grouped_mm_calls(moe: torch.nn.Module, hidden: torch.Tensor, kind: Checkpoint) -> int:
    """`_grouped_mm` calls of one forward and backward of `moe` checkpointed as the runtime does."""
    with OpCalls() as mode:
        checkpointed(moe.forward, kind)(hidden).sum().backward()
    return mode.calls["_grouped_mm"]


def test_selective_backward_does_not_rerun_the_expert_matmuls():
    entry = zoo.hf_architecture("mixtral", batch=BATCH, seq=SEQ)
    moe = entry.model.model.layers[0].mlp
    hidden = torch.randn(BATCH, SEQ, entry.model.config.hidden_size, requires_grad=True)
    unchecked = _grouped_mm_calls(moe, hidden, Checkpoint.NONE)
    assert unchecked > 0
    assert _grouped_mm_calls(moe, hidden, Checkpoint.SELECTIVE) == unchecked
    assert (
        _grouped_mm_calls(moe, hidden, Checkpoint.FULL) > unchecked
    )  # the count can see a recompute


def test_selective_bytes_of_a_mixtral_layer_include_the_expert_matmul_outputs():
    entry = zoo.hf_architecture("mixtral", batch=BATCH, seq=SEQ)
    config = entry.model.config
    layer = next(
        b
        for b in analyze(entry.model, entry.args, entry.kwargs).blocks
        if b.name == "model.layers.1"
    )
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = hidden // heads
    projections = TOKENS * (2 * hidden + 2 * config.num_key_value_heads * head_dim)  # q, o; k, v
    router = TOKENS * config.num_local_experts
    attention = TOKENS * hidden + BATCH * heads * SEQ  # its output and log-sum-exp
    experts = (
        TOKENS * config.num_experts_per_tok * (2 * config.intermediate_size + hidden)
    )  # gate and up; down
    assert layer.selective_bytes == FLOAT32_BYTES * (projections + router + attention + experts)
