"""Costs as formulas of batch and sequence length."""
import pytest
import sympy
import torch

from shardplan import ShardplanError, zoo
from shardplan.passes import analyze
from shardplan.passes.symbolic import BLOCK_COSTS, analyze_dynamic

DIMS = {"0": {0: "batch", 1: "seq"}, "labels": {0: "batch", 1: "seq"}}


@pytest.fixture(scope="module")
def llama():
    entry = zoo.hf_llama(seq=32, batch=4)
    return entry, analyze_dynamic(entry.model, entry.args, entry.kwargs, DIMS)


def test_formulas_equal_a_fresh_analysis_at_other_sizes(llama):
    entry, symbolic = llama
    ids = torch.randint(0, 512, (3, 24))
    fresh = analyze(entry.model, (ids,), {"labels": ids})
    predicted = symbolic.at(batch=3, seq=24)
    for mine, theirs in zip(predicted.blocks, fresh.blocks):
        for name in ("fwd_flops", "bwd_flops", "saved_bytes", "input_bytes", "output_bytes"):
            assert getattr(mine, name) == getattr(theirs, name), (mine.name, name)
    # Every cost, op kinds included, equals the dynamic graph's run at that size. (The static graph
    # a fresh analysis captures drops slices that are no-ops at static sizes: its backward runs 4
    # slice_backward ops a layer, the dynamic graph's 8.)
    measured = symbolic.measure({"batch": 3, "seq": 24})
    for mine, theirs in zip(predicted.blocks, measured.blocks):
        for name in BLOCK_COSTS + ("fwd_kinds", "bwd_kinds"):
            assert getattr(mine, name) == getattr(theirs, name), (mine.name, name)
    assert predicted.inputs[0].shape == (3, 24)


def test_llama_attention_is_quadratic_in_sequence_and_keeps_linear_bytes(llama):
    _, symbolic = llama
    batch, seq = symbolic.symbols["batch"], symbolic.symbols["seq"]
    layer_saved, layer_flops = symbolic.formulas["blocks[1].saved_bytes"], symbolic.formulas["blocks[1].fwd_flops"]
    # as eager training runs it (capture.eager_branches): flash attention, no seq x seq mask to keep
    assert sympy.degree(layer_saved, seq) == 1 and sympy.degree(layer_saved, batch) == 1
    assert sympy.degree(layer_flops, seq) == 2 and sympy.degree(layer_flops, batch) == 1


def test_largest_batch_that_fits_is_found_by_inverting_the_formulas(llama):
    _, symbolic = llama
    budget = symbolic.at(batch=37).saved_bytes

    def fits(chain):
        return chain.saved_bytes <= budget

    assert symbolic.largest("batch", fits) == 37
    assert symbolic.largest("batch", lambda chain: False) is None


def test_sizes_outside_the_captured_range_are_refused(llama):
    _, symbolic = llama
    with pytest.raises(ShardplanError, match="outside the range"):
        symbolic.at(batch=1)
