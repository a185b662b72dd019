"""SELECTIVE_ALTERNATE (torchtitan's selective op policy): of each checkpointed module call it keeps attention's
outputs and every second matmul's, counted from 1; the analysis counts what torch's selective checkpointing
keeps, the cost model prices it between SELECTIVE and FULL, and a plan carries it. Training with it next to
one process is in tests/test_runtime.py (both backends), its predicted memory in tests/test_predictions.py."""

import pytest
import torch
from op_calls import OpCalls

from shardplan import get_hardware
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Plan
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.manual import manual_plan
from shardplan.runtime.measure import forward_activation_bytes
from shardplan.solver.evaluate import evaluate

SELECTIVE_MODES = (Checkpoint.SELECTIVE, Checkpoint.SELECTIVE_ALTERNATE)


@pytest.fixture(scope="module")
def llama():
    entry = zoo.build("hf-llama")
    return entry, analyze(entry.model, entry.args, entry.kwargs)


def _layers(chain):
    return [block for block in chain.blocks if ".layers." in block.name]


def _kept(block, mode: Checkpoint) -> int:
    return block.selective_bytes if mode is Checkpoint.SELECTIVE else block.alternate_bytes


def test_a_llama_layer_keeps_the_query_value_gate_and_down_projections(llama):
    """Of q, k, v, o, gate, up, down it re-runs k, o and up: their outputs are not kept, their matmuls are
    the recompute's beyond SELECTIVE's."""
    entry, chain = llama
    config = entry.model.config
    tokens = entry.args[0].numel()
    hidden, inner = config.hidden_size, config.intermediate_size
    kv = config.num_key_value_heads * hidden // config.num_attention_heads
    rerun_widths = kv + hidden + inner  # k, o, up
    for layer in _layers(chain):
        assert layer.selective_bytes - layer.alternate_bytes == 4 * tokens * rerun_widths
        (kind,) = layer.alternate_recompute_kinds
        assert (kind.name, kind.calls, kind.flops) == ("mm", 3, 2 * tokens * hidden * rerun_widths)
        assert layer.alternate_saved_bytes < layer.selective_saved_bytes
    head = chain.blocks[-1]  # one matmul, the first of its call: kept
    assert head.alternate_bytes == head.selective_bytes > 0


@pytest.mark.parametrize("mode", SELECTIVE_MODES, ids=lambda mode: mode.value)
def test_kept_bytes_match_what_torchs_selective_checkpointing_keeps(llama, mode):
    """The layers' modules checkpointed as the runtime wraps them: the forward keeps what the other blocks
    save, and of each layer its input and the outputs the mode keeps (MemTracker)."""
    _, chain = llama
    entry = zoo.build("hf-llama")
    layers = _layers(chain)
    for path in (path for block in layers for path in block.modules):
        module = entry.model.get_submodule(path)
        module.forward = checkpointed(module.forward, mode)
    measured = forward_activation_bytes(entry.model, entry.args, entry.kwargs)
    predicted = (
        chain.saved_bytes
        + chain.returned_bytes
        + sum(block.input_bytes + _kept(block, mode) - block.saved_bytes for block in layers)
    )
    assert predicted == pytest.approx(measured, rel=0.005)


def test_the_runtime_reruns_every_second_matmul_of_each_call():
    """A Llama layer's forward and backward, twice through one checkpointed forward: each call counts its
    own matmuls from 1 (the recompute again), so each backward re-runs the same three."""
    entry = zoo.build("hf-llama")
    layer = entry.model.model.layers[0]
    hidden = torch.randn(*entry.args[0].shape, entry.model.config.hidden_size)
    position = entry.model.model.rotary_emb(hidden, torch.arange(hidden.shape[1])[None])

    def mm_calls(mode: Checkpoint) -> int:
        forward = checkpointed(layer.forward, mode)
        with OpCalls() as counted:
            for _ in range(2):
                x = hidden.clone().requires_grad_()
                output = forward(x, position_embeddings=position)
                (output[0] if isinstance(output, tuple) else output).sum().backward()
        return counted.calls["mm"]

    selective = mm_calls(Checkpoint.SELECTIVE)
    assert mm_calls(Checkpoint.SELECTIVE_ALTERNATE) == selective + 2 * 3
    # the count sees a recompute: FULL's re-runs all but the down projection (its early stop)
    assert mm_calls(Checkpoint.FULL) == selective + 2 * 6


@pytest.mark.parametrize("hardware", ["h100-80g", "cpu-gloo"])
def test_recompute_and_memory_lie_between_selective_and_full(llama, hardware):
    """On a GPU the recompute lies between SELECTIVE's and FULL's. On a CPU rank both selective modes pay
    their dispatch modes' fixed cost on every op (selective_op_overhead_s), above FULL's whole re-run of a
    layer this small: there SELECTIVE_ALTERNATE's recompute is SELECTIVE's and its matmuls'."""
    entry, chain = llama
    groups = [block.modules for block in chain.blocks]
    predicted = {
        mode: evaluate(
            chain,
            manual_plan(entry.model, groups, dp=2, checkpoints=(mode,)),
            get_hardware(hardware),
        )
        for mode in Checkpoint
    }
    recompute = {mode: p.time_s.get("recompute", 0.0) for mode, p in predicted.items()}
    activations = {mode: p.memory_bytes["activations"] for mode, p in predicted.items()}
    selective, alternate, full = (
        Checkpoint.SELECTIVE,
        Checkpoint.SELECTIVE_ALTERNATE,
        Checkpoint.FULL,
    )
    assert 0 < recompute[selective] < recompute[alternate], recompute
    if hardware != "cpu-gloo":
        assert recompute[alternate] < recompute[full], recompute
    assert activations[selective] > activations[alternate] > activations[full], activations


def test_a_plan_with_the_mode_round_trips_through_json(llama):
    entry, chain = llama
    plan = manual_plan(
        entry.model,
        [block.modules for block in chain.blocks],
        dp=2,
        checkpoints=(Checkpoint.SELECTIVE_ALTERNATE, Checkpoint.NONE),
    )
    text = plan.to_json()
    assert '"checkpoint": "selective_alternate"' in text
    loaded = Plan.from_json(text)
    assert loaded == plan and loaded.units[0].checkpoint is Checkpoint.SELECTIVE_ALTERNATE


def test_the_solver_searches_the_mode_where_asked():
    """Not in the default space (space.DEFAULT_CHECKPOINTS: it would multiply the solve time); a constraint
    allowing it, or a space naming it, lets the solver take it."""
    from shardplan import Constraints, SearchSpace, compile

    assert Checkpoint.SELECTIVE_ALTERNATE not in SearchSpace().checkpoints
    entry = zoo.build("hf-llama")
    pinned = compile(  # one rank: no pipeline, whose zero-bubble schedule takes no selective mode
        entry.model,
        1,
        entry.args,
        entry.kwargs,
        hardware="cpu-gloo",
        constraints=Constraints(checkpoint=((r"layers", (Checkpoint.SELECTIVE_ALTERNATE,)),)),
    )
    layers = [unit for unit in pinned.units if any(".layers." in m for m in unit.modules)]
    assert layers and {unit.checkpoint for unit in layers} == {Checkpoint.SELECTIVE_ALTERNATE}
