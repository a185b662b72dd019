"""Front end: capture and analysis passes against eager measurement."""

import dataclasses

import pytest
import torch

from shardplan import CaptureError
from shardplan.calibration.accuracy import hf_workload
from shardplan.calibration.op_factors import time_op_calls_s
from shardplan.frontend.chain import OpKind, merge_op_kinds
from shardplan.frontend.passes import analyze, fingerprint_of
from shardplan.frontend.passes.blocks import block_name
from shardplan.frontend.passes.execution import flop_counter
from shardplan.models import zoo
from shardplan.plan import Checkpoint
from shardplan.runtime.activation_checkpoint import checkpointed
from shardplan.runtime.measure import forward_activation_bytes

SMALL = [
    "gpt",
    "mlp",
    "cnn",
    "encoder-decoder",
    "hf-gpt2",
    "hf-llama",
    "hf-bert",
    "hf-t5",
    "hf-mixtral",
]


def _loss(output):
    return output if isinstance(output, torch.Tensor) else output.loss


@pytest.mark.parametrize("name", SMALL)
def test_flops_and_parameter_bytes_match_eager(name):
    entry = zoo.build(name)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    with flop_counter() as counter:  # torch's counter plus the CPU attention kernels it lacks
        _loss(entry.model(*entry.args, **entry.kwargs)).backward()
    assert chain.fwd_flops + chain.bwd_flops == pytest.approx(counter.get_total_flops(), rel=0.01)
    assert chain.param_bytes == sum(p.numel() * p.element_size() for p in entry.model.parameters())
    assert sorted(p for b in chain.blocks for p in b.param_names) == sorted(
        n for n, _ in entry.model.named_parameters()
    )


@pytest.mark.parametrize("name", SMALL)
def test_activation_bytes_match_mem_tracker(name):
    entry = zoo.build(name)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    measured = forward_activation_bytes(entry.model, entry.args, entry.kwargs)
    # Hugging Face models too: capture traces the attention eager training runs (capture.eager_branches)
    assert chain.saved_bytes + chain.returned_bytes == pytest.approx(measured, rel=0.005)


@pytest.mark.parametrize("name", ["gpt", "hf-gpt2", "hf-llama", "hf-t5"])
def test_checkpointed_activation_bytes_match_mem_tracker(name):
    """Every block's modules checkpointed on their own, as the runtime wraps a unit's: the forward keeps what
    the blocks' input_bytes say, not the blocks' inputs (the GPTs' token embedding output, which only the
    sum at the model's root reads, is not kept; a loss's saved bytes at the root are)."""
    entry = zoo.build(name)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    for module in (
        entry.model.get_submodule(path) for block in chain.blocks for path in block.modules
    ):
        module.forward = checkpointed(module.forward, Checkpoint.FULL)
    measured = forward_activation_bytes(entry.model, entry.args, entry.kwargs)
    assert sum(b.input_bytes for b in chain.blocks) + chain.returned_bytes == pytest.approx(
        measured, rel=0.005
    )


def test_gpt_blocks_follow_its_modules():
    entry = zoo.gpt(zoo.GPTConfig(n_layer=3))
    chain = analyze(entry.model, entry.args, entry.kwargs)
    assert [b.name for b in chain.blocks] == ["wte", "wpe", "h.0", "h.1", "h.2", "ln_f", "lm_head"]
    layers = chain.blocks[2:5]
    assert len({(b.param_bytes, b.fwd_flops, b.bwd_flops, b.saved_bytes) for b in layers}) == 1
    assert (
        chain.blocks[-1].bwd_flops == 2 * chain.blocks[-1].fwd_flops
    )  # a linear layer: input and weight grads
    assert all(b.input_bytes > 0 for b in chain.blocks[1:])
    assert chain.skip_edges == ()
    # a layer's forward by op: 4 linear layers, attention, GELU, 2 norms, 2 residual adds
    assert {k.name: k.calls for k in layers[0].fwd_kinds} == {
        "addmm": 4,
        "_scaled_dot_product_flash_attention_for_cpu": 1,
        "gelu": 1,
        "native_layer_norm": 2,
        "add": 2,
    }
    # the linear layers read their weights and biases: bytes every micro-batch reads whole
    linear_bytes = sum(
        p.numel() * p.element_size()
        for n, p in entry.model.h[0].named_parameters()
        if "ln" not in n
    )
    assert next(k for k in layers[0].fwd_kinds if k.name == "addmm").weight_bytes == linear_bytes


def test_a_block_names_the_parameter_gradients_made_before_its_backward_peak():
    """GPT-2's layer peaks in its MLP's GELU backward (tanh approximation), after its output projection's
    backward made that projection's weight and bias gradients (benchmarks/probe_rank_peak.py); the demo
    GPT's layer peaks in its first backward op, its MLP's output linear."""
    gpt2 = zoo.hf_gpt2(
        d_model=256, batch=4, seq=128
    )  # bench_hf_memory.py's layer (its activations 0.5 MiB)
    chain = analyze(gpt2.model, gpt2.args, gpt2.kwargs)
    layers = [b for b in chain.blocks if ".h." in b.name]
    projection = gpt2.model.transformer.h[0].mlp.c_proj
    assert projection.weight.numel() + projection.bias.numel() == 262_400  # 4 x 256 x 256 + 256
    assert [b.bwd_peak_grad_numel for b in layers] == [262_400, 262_400]
    gpt = zoo.gpt(zoo.GPTConfig(n_layer=2))
    layers = [b for b in analyze(gpt.model, gpt.args, gpt.kwargs).blocks if b.name.startswith("h.")]
    assert [b.bwd_peak_grad_numel for b in layers] == [0, 0]


def test_selective_recompute_drops_the_kept_outputs_autograd_does_not_save():
    """Selective checkpointing keeps a Llama layer's query, key and output projections, which autograd does
    not save (the rotary embedding and the residual add read them); its recompute takes them out of the
    checkpoint's cache and drops them. The down projection's output is not replayed: the recompute stops
    at the op that saves the layer's last tensor, that projection's input (benchmarks/probe_rank_peak.py sees these three freed, 1.25 MiB)."""
    entry = hf_workload(
        "llama"
    ).build()  # hidden 256, 2 key-value heads of 4: keys 128 wide; 4 x 128 tokens
    layers = [
        b for b in analyze(entry.model, entry.args, entry.kwargs).blocks if ".layers." in b.name
    ]
    tokens = 4 * 128
    assert (
        [b.selective_dropped_bytes for b in layers]
        == [4 * tokens * (256 + 128 + 256)] * 4
        == [1_310_720] * 4
    )
    # Falcon's attention runs as math inside one node: its scores (4 heads x 128 x 128 a sequence), kept as a
    # matmul output that node neither returns nor saves, are dropped too, beside its fused query-key-value,
    # context and output projections (probe_rank_peak.py --model falcon: 2.75 MiB freed)
    entry = hf_workload("falcon").build()
    layers = [b for b in analyze(entry.model, entry.args, entry.kwargs).blocks if ".h." in b.name]
    scores, fused, context, dense = (
        4 * 4 * 4 * 128 * 128,
        4 * tokens * 384,
        4 * tokens * 256,
        4 * tokens * 256,
    )
    assert (
        [b.selective_dropped_bytes for b in layers]
        == [scores + fused + context + dense] * 4
        == [2_883_584] * 4
    )


def test_a_matmul_output_a_block_keeps_as_its_input_is_counted_once():
    """RoBERTa's head applies its GELU outside its modules: autograd saves the dense layer's output for it,
    which the block keeps as its input (input_bytes) and selective checkpointing keeps as a matmul output:
    one tensor, 0.5 MiB."""
    entry = hf_workload("roberta").build()
    dense = next(
        b
        for b in analyze(entry.model, entry.args, entry.kwargs).blocks
        if b.name == "lm_head.dense"
    )
    hidden_states = 4 * 4 * 128 * 256
    assert (dense.input_bytes, dense.selective_bytes) == (
        2 * hidden_states,
        0,
    )  # its input, the dense output


def test_tied_weights_and_buffers_do_not_make_blocks():
    gpt2 = zoo.hf_gpt2()
    names = [b.name for b in analyze(gpt2.model, gpt2.args, gpt2.kwargs).blocks]
    assert "lm_head" not in names  # its weight is the embedding's: nothing of its own to shard
    llama = zoo.hf_llama()
    names = [b.name for b in analyze(llama.model, llama.args, llama.kwargs).blocks]
    assert names == [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.1",
        "model.norm",
        "lm_head",
    ]


def test_encoder_decoder_reports_the_branch():
    entry = zoo.encoder_decoder()
    chain = analyze(entry.model, entry.args, entry.kwargs)
    last_encoder = [b.index for b in chain.blocks if b.name.startswith("encoder.")][-1]
    decoders = [b.index for b in chain.blocks if b.name.startswith("decoder.")]
    assert (last_encoder, decoders[-1]) in chain.skip_edges


def test_meta_model_is_analyzed_without_memory():
    entry = zoo.llama_7b(n_layer=2, seq=512)
    assert all(p.is_meta for p in entry.model.parameters())
    chain = analyze(entry.model, entry.args, entry.kwargs)
    assert chain.param_numel == sum(p.numel() for p in entry.model.parameters())
    layer = chain.blocks[1]
    # A LLaMA-7B layer: 4 d² attention + 3·d·ffn MLP weights + 2 norms; 2 FLOPs per weight per token forward.
    d, ffn, tokens = 4096, 11008, 512
    weights = 4 * d * d + 3 * d * ffn
    assert layer.param_numel == weights + 2 * d
    assert layer.fwd_flops == pytest.approx(2 * weights * tokens, rel=0.05)


def test_a_mixture_of_experts_on_the_meta_device_is_analyzed_as_on_the_cpu():
    """transformers' expert routing picks histc's dtype by device type: captured on meta stand-ins it
    took a branch the CPU analysis refuses (capture.computing_in stands a meta model in on the CPU)."""
    chains = []
    for device in ("cpu", "meta"):
        entry = zoo.hf_architecture("deepseek-v3", device=device)
        chains.append(analyze(entry.model, entry.args, entry.kwargs))
    on_cpu, on_meta = chains
    assert on_meta.fingerprint == on_cpu.fingerprint
    assert on_meta.blocks == on_cpu.blocks
    assert [b.routed_experts for b in on_meta.blocks] == [0, 0, 4, 0, 0]


def test_fingerprint_is_stable_and_tells_models_apart():
    first = zoo.gpt()
    again = zoo.gpt()
    other = zoo.gpt(zoo.GPTConfig(n_layer=3))
    fingerprint = analyze(first.model, first.args, first.kwargs).fingerprint
    assert analyze(again.model, again.args, again.kwargs).fingerprint == fingerprint
    assert analyze(other.model, other.args, other.kwargs).fingerprint != fingerprint


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # branches on a value: neither export nor fx can capture it
            return self.linear(x).sum()
        return x.sum()


def test_uncapturable_model_names_the_cause_and_the_fix():
    with pytest.raises(CaptureError) as error:
        analyze(DataDependent(), (torch.randn(2, 4),))
    message = str(error.value)
    assert "DataDependent" in message and "test_passes.py" in message
    assert "torch.where" in message or "torch.cond" in message


def test_inputs_the_model_does_not_take_are_named_as_the_cause_not_control_flow():
    entry = zoo.gpt()
    ids = entry.args[0].float()  # token ids as floats: the embedding takes integers
    with pytest.raises(CaptureError) as error:
        analyze(entry.model, (ids, ids))
    message = str(error.value)
    assert "'indices'" in message and "torch.long" in message and "control flow" not in message


@pytest.mark.parametrize(
    "path, expected",
    [
        ("h.3.attn.qkv", "h.3"),
        ("model.layers.12.mlp", "model.layers.12"),
        ("lm_head", "lm_head"),
        ("transformer.wte", "transformer.wte"),
        ("", ""),
        ("layers.0.0", "layers.0"),
    ],
)
def test_block_name(path, expected):
    assert block_name(path, outer_depth=2 if path.startswith("transformer") else 1) == expected


def test_fingerprint_from_input_shapes_equals_the_analysis_fingerprint():
    entry = zoo.hf_llama()
    chain = analyze(entry.model, entry.args, entry.kwargs)
    assert fingerprint_of(entry.model, chain.inputs) == chain.fingerprint


class Lookup(torch.nn.Module):
    """An embedding lookup and nothing else, so its traffic is known by hand."""

    def __init__(self):
        super().__init__()
        self.table = torch.nn.Embedding(1000, 64)

    def forward(self, ids):
        return self.table(ids).sum()


def test_an_embedding_reads_the_rows_it_gathers_and_its_backward_writes_the_table_gradient():
    ids = torch.randint(0, 1000, (4, 8))
    chain = analyze(Lookup(), (ids,))
    (block,) = [b for b in chain.blocks if b.name == "table"]
    rows_bytes, ids_bytes, table_bytes = 4 * 8 * 64 * 4, 4 * 8 * 8, 1000 * 64 * 4
    # forward: the lookup reads the ids and the 32 rows and writes them, not the 1000-row table;
    # then the sum reads them and writes a 4-byte scalar
    assert block.fwd_memory_bytes == (ids_bytes + 2 * rows_bytes) + (rows_bytes + 4)
    # backward: the sum's gradient is a view; embedding_dense_backward reads the rows' gradient and the
    # ids and writes the whole table's gradient
    assert block.bwd_memory_bytes == rows_bytes + ids_bytes + table_bytes
    assert (block.fwd_ops, block.bwd_ops) == (
        2,
        1,
    )  # metadata queries (tensor.device) are not kernels
    # by op name, as the cost model prices them
    assert [(k.name, k.calls, k.flops, k.bytes) for k in block.fwd_kinds] == [
        ("embedding", 1, 0, ids_bytes + 2 * rows_bytes),
        ("sum", 1, 0, rows_bytes + 4),
    ]
    assert [(k.name, k.calls, k.bytes) for k in block.bwd_kinds] == [
        ("embedding_dense_backward", 1, rows_bytes + ids_bytes + table_bytes)
    ]


@pytest.mark.parametrize("name", ["gpt", "mlp", "cnn", "encoder-decoder"])
def test_op_kinds_are_the_kernels_of_an_eager_step(name):
    entry = zoo.build(name)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    eager: dict[str, list[int]] = {}  # the kernels calibration times in an eager step, by op name
    for name, flops, nbytes, seconds in time_op_calls_s([entry], torch.device("cpu"), rounds=1):
        kind = eager.setdefault(name, [0, 0, 0])
        kind[0], kind[1], kind[2] = kind[0] + 1, kind[1] + flops, kind[2] + nbytes
        assert seconds > 0
    counted = merge_op_kinds(block.fwd_kinds + block.bwd_kinds for block in chain.blocks)
    # every kernel but backward's seed gradient, which runs before any block's backward
    assert {k.name: [k.calls, k.flops, k.bytes] for k in counted} == {
        name: kind for name, kind in eager.items() if name != "ones_like"
    }
    for block in chain.blocks:
        for phase in ("fwd", "bwd"):
            kinds = getattr(block, f"{phase}_kinds")
            assert sum(k.calls for k in kinds) == getattr(block, f"{phase}_ops")
            assert sum(k.bytes for k in kinds if not k.flops) == getattr(
                block, f"{phase}_memory_bytes"
            )


def test_merge_op_kinds_sums_every_count_of_an_op_kind():
    # every field OpKind has, a later one too: one left out of the sum would halve below
    counts = [field.name for field in dataclasses.fields(OpKind) if field.name != "name"]
    mm = OpKind(name="mm", **{count: 1 + index for index, count in enumerate(counts)})
    add = OpKind(name="add", **{count: 10 for count in counts})
    assert merge_op_kinds([[mm, add], [mm]]) == (
        add,
        OpKind(name="mm", **{count: 2 * (1 + index) for index, count in enumerate(counts)}),
    )


def test_cpu_attention_has_flops():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    with flop_counter() as counter:
        torch.nn.functional.scaled_dot_product_attention(q, q, q).sum().backward()
    # forward: two batched matmuls of 2·(2·4)·16·16·8 FLOPs; backward: five of them
    assert counter.get_total_flops() == 7 * 2 * (2 * 4) * 16 * 16 * 8
