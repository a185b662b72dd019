"""Repeated blocks analyzed once (repeats.py, passes/splice.py): the chain equals a full analysis."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from shardplan.frontend.passes import analyze, fingerprint_of
from shardplan.frontend.repeats import capture_repeated
from shardplan.models import zoo

TIMINGS = ("capture_s", "analyze_s", "reused_blocks")

MODELS = {  # enough layers that one is a copy (a class's first, second and last are traced)
    "gpt": lambda: zoo.gpt(zoo.GPTConfig(n_layer=4)),
    "mlp": lambda: zoo.residual_mlp(depth=5),
    "cnn": zoo.residual_cnn,
    "encoder-decoder": zoo.encoder_decoder,
    "hf-gpt2": lambda: zoo.hf_gpt2(n_layer=4),
    "hf-llama": lambda: zoo.hf_llama(n_layer=4),
    "hf-bert": lambda: zoo.hf_bert(n_layer=4),
    "hf-t5": lambda: zoo.hf_t5(n_layer=5),
    "hf-mixtral": lambda: zoo.hf_mixtral(n_layer=4),
}
REUSES = {
    "gpt": 1,
    "mlp": 1,
    "hf-gpt2": 1,
    "hf-llama": 1,
    "hf-bert": 1,
    "hf-t5": 2,
    "hf-mixtral": 1,
}
"""Copies stamped from a representative; the others have no block repeated often enough."""


def _without_timings(chain):
    return dataclasses.replace(
        chain, extra={k: v for k, v in chain.extra.items() if k not in TIMINGS}
    )


@pytest.mark.parametrize("name", MODELS)
def test_chain_equals_a_full_analysis(name):
    torch.manual_seed(0)
    entry = MODELS[name]()
    reused = analyze(entry.model, entry.args, entry.kwargs)
    full = analyze(entry.model, entry.args, entry.kwargs, reuse_blocks=False)
    assert reused.extra["reused_blocks"] == REUSES.get(name, 0)
    assert _without_timings(reused) == _without_timings(
        full
    )  # every block, field for field, names included
    assert fingerprint_of(entry.model, reused.inputs) == full.fingerprint


class Layer(nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.scale = scale
        """Not a parameter: only the captured ops tell layers of other scales apart."""

    def forward(self, x):
        return x + self.scale * torch.relu(self.fc(x))


class Stack(nn.Module):
    def __init__(self, scales):
        super().__init__()
        self.layers = nn.ModuleList(Layer(scale) for scale in scales)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def test_a_block_computing_otherwise_is_not_a_copy_and_changes_the_fingerprint():
    x = torch.randn(4, 16)
    plain, odd = Stack([1.0] * 6), Stack([1.0, 1.0, 1.0, 0.5, 1.0, 1.0])
    chain = analyze(odd, (x,))
    assert chain.extra["reused_blocks"] == 1  # layers.2 only: layers.3 computes another graph
    assert _without_timings(chain) == _without_timings(analyze(odd, (x,), reuse_blocks=False))
    assert fingerprint_of(odd, chain.inputs) != fingerprint_of(plain, chain.inputs)


def test_shared_or_reentered_layers_are_traced_whole():
    x = torch.randn(4, 16)
    shared = Stack([1.0] * 5)
    shared.layers[3] = shared.layers[2]  # one module under two names: tied layers
    chain = analyze(shared, (x,))
    assert chain.extra["reused_blocks"] == 0
    assert _without_timings(chain) == _without_timings(analyze(shared, (x,), reuse_blocks=False))


@pytest.mark.parametrize("build", [zoo.residual_cnn, lambda: zoo.hf_llama(n_layer=3)])
def test_a_model_without_enough_repeats_is_captured_once_as_before(build):
    entry = build()
    assert (
        capture_repeated(entry.model, entry.args, entry.kwargs) is None
    )  # no patched trace, no second export


def test_tensor_parallel_pairs_equal_those_of_a_whole_capture():
    from shardplan.frontend.capture import capture
    from shardplan.frontend.passes import tensor_parallel_candidates
    from shardplan.frontend.passes.ownership import annotate_ownership_pass
    from shardplan.frontend.passes.tensor_parallel import find_tensor_parallel_pairs

    entry = zoo.gpt(zoo.GPTConfig(n_layer=4))
    whole = capture(entry.model, entry.args, entry.kwargs).gm
    annotate_ownership_pass(whole)
    assert tensor_parallel_candidates(
        entry.model, entry.args, entry.kwargs
    ) == find_tensor_parallel_pairs(whole)
