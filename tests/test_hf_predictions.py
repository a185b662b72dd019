"""Predicted against measured peak memory on Hugging Face architectures (issue 22): Llama and Mixtral
(grouped-query attention, rotary caches; Mixtral's experts) from tiny configs, trained
on 2 gloo ranks under hand-written plans (shardplan.accuracy.HF_WORKLOADS, one unit per block).

Held to ±5% on the kinds whose peak falls where the cost model's events place it. Not held here
(docs/benchmarks.md, "Hugging Face architectures"): full checkpointing and FULL_SHARD's peak at the
loss, whose backward runs before the head unit gathers its parameters (predicted up to 10% high), and
REPLICATE with checkpointing, whose fresh gradients beside the kept ones are not priced (up to 9% low)."""
import pytest
import torch

from shardplan import get_hardware, zoo
from shardplan.accuracy import HF_WORKLOADS, KINDS, compare, demo_chain_and_plans, measure_plans
from shardplan.capture import capture

HELD = ("shard_grad_op/none", "shard_optimizer/none", "replicate/none")


def test_capture_traces_the_attention_eager_training_runs():
    import transformers.masking_utils as masking

    packed = masking.find_packed_sequence_indices
    entry = zoo.hf_llama()
    gm = capture(entry.model, entry.args, entry.kwargs).gm
    attention = [node for node in gm.graph.nodes if node.target is torch.ops.aten.scaled_dot_product_attention.default]
    # SDPA on the kv heads as they are (no repeat_kv), causal, no materialized mask
    assert [(node.args[3:], node.kwargs.get("enable_gqa")) for node in attention] == [((None, 0.0, True), True)] * 2
    assert masking.find_packed_sequence_indices is packed  # transformers is left as it was


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf-llama", "hf-mixtral"])
def test_hugging_face_peak_memory_is_predicted_within_5_percent(name):
    workload = HF_WORKLOADS[name]
    chain, plans = demo_chain_and_plans(2, workload)
    names = [f"{strategy.value}/{checkpoint.value}" for strategy, checkpoint in KINDS]
    held = [plans[names.index(kind)] for kind in HELD]
    _, measured = measure_plans(held, 2, rounds=1, progress=False, workload=workload)
    rows = compare(chain, held, measured, get_hardware("cpu-gloo"), list(HELD))
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    assert all(abs(ratio - 1) <= 0.05 for ratio in ratios.values()), ratios
