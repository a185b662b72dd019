"""benchmarks/bench_published.py --breakdown: the single-node budget it prints is what the cost model prices."""
import dataclasses

import pytest

from shardplan.cost import CostContext, _block_times_s
from shardplan.hardware import get_hardware
from test_published import bench  # noqa: F401 (the fixture: benchmarks/bench_published.py as a module)


@pytest.mark.parametrize("model", ["playbook-1B", "playbook-3B"])
def test_a_layers_op_kinds_add_up_to_what_the_cost_model_prices_it(bench, model):
    hw = get_hardware("h100-80g")
    dims = bench.MODELS[model]
    chain = bench.llama_chain(dims, 1, 4096, pipelined=False)
    ctx = CostContext(hardware=hw, dp=1, param_dtype="bfloat16")
    breakdown = bench.op_breakdown(dims, hw)
    for part, block in (("layer", chain.blocks[1]), ("head", chain.blocks[-1])):
        fwd_s, bwd_s, _ = _block_times_s(block, ctx)
        assert sum(seconds for _, seconds, _, _ in breakdown[part]) == pytest.approx(fwd_s + bwd_s, rel=1e-9)
    assert {name for name, *_ in breakdown["layer"]} == {"mm", "_scaled_dot_product_flash_attention", "rms_norm",
                                                         "rotary", "add", "silu_mul", "layout_copy"}


def test_a_sequence_measured_and_predicted_comes_from_the_one_node_rows(bench):
    row = bench.Row(model="playbook-1B", n_gpus=8, dp=8, tp=1, pp=1, micro_batch_size=2, grad_accum=16, seq_len=4096,
                    zero_stage="0", status="ok", tokens_per_s_per_gpu=40150.0, line=0)
    elsewhere = [dataclasses.replace(row, n_gpus=16, dp=16, grad_accum=8),
                 dataclasses.replace(row, tp=2, dp=4, grad_accum=32)]
    hw = get_hardware("h100-80g")
    found = bench.per_sequence_s([row] + elsewhere, "playbook-1B", hw)
    (outcome,) = bench.predict([row], hw)
    assert list(found) == [2]
    measured, predicted = found[2]
    assert measured == pytest.approx(4096 / 40150.0)  # a sequence of 4096 tokens at the rank's tokens/s
    assert predicted == pytest.approx(4096 / outcome.tokens_per_s_per_gpu)
