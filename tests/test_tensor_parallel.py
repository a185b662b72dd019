"""Tensor parallelism: the pairs the graph allows, the sizes that refuse them, and parity at tp = 2."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity import ADAMW, TOLERANCE, spawn_world

from shardplan.errors import PlanError, RuntimeMismatchError
from shardplan.frontend.passes import tensor_parallel_candidates
from shardplan.frontend.passes.tensor_parallel import (
    TensorParallelLayout,
)
from shardplan.models import zoo
from shardplan.plan import Mesh
from shardplan.runtime import tensor_parallel
from shardplan.runtime.collectives import (
    all_reduce_max,
    all_reduce_mean,
    device_mesh,
    mesh_groups,
    wait,
)
from shardplan.runtime.fsdp2 import apply_tensor_parallel_fsdp2, tensor_parallel_full_parameters
from shardplan.runtime.tensor_parallel import (
    ParameterSlice,
    apply_tensor_parallel,
    gather_full_parameters,
    sequence_parallel_parameters,
    sum_sequence_parallel_gradients,
)

STEPS = 3

MODELS = {
    "gpt": lambda: zoo.gpt(zoo.GPTConfig(n_layer=2), batch=2),
    "llama": lambda: zoo.hf_llama(
        n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=128, batch=2, seq=16
    ),
}


@pytest.fixture(scope="module")
def candidates():
    found = {}
    for name, build in MODELS.items():
        entry = build()
        found[name] = tensor_parallel_candidates(entry.model, entry.args, entry.kwargs)
    return found


def test_gpt_pairs_attention_in_fused_chunks_and_the_mlp(candidates):
    layout = candidates["gpt"].layout(2)
    assert layout.styles == {
        f"h.{i}.{path}": style
        for i in range(2)
        for path, style in [
            ("attn.qkv", "colwise_fused(3)"),
            ("attn.proj", "rowwise"),
            ("mlp.fc", "colwise"),
            ("mlp.proj", "rowwise"),
        ]
    }
    assert [pair.name for pair in layout.pairs] == ["h.0.attn", "h.0.mlp", "h.1.attn", "h.1.mlp"]
    assert layout.replicated == (
        "wte",
        "wpe",
        "h.0.ln_1",
        "h.0.ln_2",
        "h.1.ln_1",
        "h.1.ln_2",
        "ln_f",
        "lm_head",
    )
    assert layout.rejected == ()
    assert {d.module: d.reason for d in layout.deferred} == {
        "wte": "256 rows of wte's table divide by tp=2, but it stays whole: the layout was made without vocab_parallel",
        "lm_head": "256 output features of lm_head divide by tp=2, but it stays whole: the layout was made "
        "without vocab_parallel",
    }
    vocab = candidates["gpt"].layout(2, vocab_parallel=True)
    assert [(c.module, c.kind.value) for c in vocab.vocab] == [
        ("wte", "embedding"),
        ("lm_head", "head"),
    ]
    assert vocab.deferred == () and "wte" not in vocab.replicated
    assert (
        candidates["gpt"].layout(3, vocab_parallel=True).deferred[0].reason
        == "256 rows of wte's table do not divide by tp=3: it stays whole"
    )


def test_llama_pairs_q_k_v_with_o_and_gate_up_with_down(candidates):
    layout = candidates["llama"].layout(2)
    attention, mlp = "model.layers.0.self_attn", "model.layers.0.mlp"
    assert {
        path: style for path, style in layout.styles.items() if path.startswith("model.layers.0.")
    } == {
        f"{attention}.q_proj": "colwise",
        f"{attention}.k_proj": "colwise",
        f"{attention}.v_proj": "colwise",
        f"{attention}.o_proj": "rowwise",
        f"{mlp}.gate_proj": "colwise",
        f"{mlp}.up_proj": "colwise",
        f"{mlp}.down_proj": "rowwise",
    }
    assert [(d.size, d.what) for d in layout.pairs[0].divisors] == [
        (4, f"heads of {attention}.q_proj"),
        (2, f"kv heads of {attention}.k_proj"),
        (2, f"kv heads of {attention}.v_proj"),
    ]
    assert "model.norm" in layout.replicated and "model.embed_tokens" in layout.replicated


def test_indivisible_heads_are_explained(candidates):
    gpt = candidates["gpt"].layout(3)
    assert gpt.pairs == () and len(gpt.replicated) == 16
    assert {r.module: r.reason for r in gpt.rejected}[
        "h.0.attn"
    ] == "4 heads of h.0.attn.qkv do not divide by tp=3: tp must divide 4 to shard this pair"
    llama = candidates["llama"].layout(
        4
    )  # 4 query heads divide, the 2 kv heads do not; the MLP shards
    assert [pair.name for pair in llama.pairs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert {r.module: r.reason for r in llama.rejected}["model.layers.0.self_attn"].startswith(
        "2 kv heads of model.layers.0.self_attn.k_proj, 2 kv heads of model.layers.0.self_attn.v_proj "
        "do not divide by tp=4"
    )


def test_sequence_parallelism_refuses_a_layer_with_a_whole_pair(candidates):
    with pytest.raises(
        PlanError,
        match=r"^sequence parallelism would run 'model.layers.0.self_attn' on a shard "
        r"of the sequence, but it stays whole over tp \(2 kv heads",
    ):
        candidates["llama"].layout(4, sequence_parallel=True)


def test_a_tied_embedding_and_head_stay_whole_with_the_reason():
    entry = MODELS["gpt"]()
    entry.model.lm_head.weight = entry.model.wte.weight
    layout = tensor_parallel_candidates(entry.model, entry.args, entry.kwargs).layout(
        2, vocab_parallel=True
    )
    assert layout.vocab == ()
    assert [(d.module, d.reason) for d in layout.deferred] == [
        (
            "wte",
            "its table wte.weight is tied to lm_head: a tied embedding and head stay whole "
            "(untie them to shard both over the vocabulary)",
        )
    ]


class _MLP(nn.Module):
    def __init__(self, norm: bool):
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.norm = nn.LayerNorm(64) if norm else nn.Identity()
        self.proj = nn.Linear(64, 16)

    def forward(self, x):
        return self.proj(self.norm(F.gelu(self.fc(x))))


class _NormFormer(nn.Module):
    """Two residual MLPs; the first normalizes its hidden features, which mixes every rank's slice."""

    def __init__(self):
        super().__init__()
        self.normed = _MLP(norm=True)
        self.plain = _MLP(norm=False)

    def forward(self, x):
        x = x + self.normed(x)
        return (x + self.plain(x)).sum()


def test_a_norm_over_the_sharded_features_refuses_the_pair():
    layout = tensor_parallel_candidates(_NormFormer(), (torch.randn(2, 8, 16),)).layout(2)
    assert layout.styles == {"plain.fc": "colwise", "plain.proj": "rowwise"}
    assert [(r.module, r.reason) for r in layout.rejected] == [
        ("normed", "layer_norm (layer_norm in normed.norm) normalizes over the sharded features")
    ]


def test_fused_slices_are_one_box_per_chunk_and_assemble_back():
    full = torch.arange(24.0).view(12, 2)  # a fused projection: 3 chunks of 4 rows, over tp = 2
    cuts = [
        ParameterSlice(full_shape=(12, 2), dim=0, chunks=3, index=i, degree=2) for i in range(2)
    ]
    assert cuts[1].take(full).tolist() == full[[2, 3, 6, 7, 10, 11]].tolist()
    assert cuts[1].boxes() == (((2, 0), (2, 2)), ((6, 0), (2, 2)), ((10, 0), (2, 2)))
    assert torch.equal(cuts[0].assemble([cut.take(full) for cut in cuts]), full)
    rows = [
        ParameterSlice(full_shape=(12, 2), dim=1, chunks=1, index=i, degree=2) for i in range(2)
    ]
    assert torch.equal(rows[0].assemble([cut.take(full) for cut in rows]), full)


# parity with one process: a grid of cases in one spawned world each (2 ranks: one tp group; 4 ranks: dp 2 × tp 2)


def _loss(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.loss


def _counting_all_reduces(calls: list):
    original = tensor_parallel.all_reduce_sum

    def count(tensor, group):
        calls.append(tensor.shape)
        return original(tensor, group)

    return count


def _batches(entry, replicas: int):
    """Per step, the whole batch: `replicas` of the example's batch size, split in order over the replicas."""
    batch, seq = entry.args[0].shape
    vocab = entry.model.config.vocab_size
    return [
        torch.randint(
            0, vocab, (batch * replicas, seq), generator=torch.Generator().manual_seed(step)
        )
        for step in range(STEPS)
    ]


def train_tensor_parallel(rank: int, world: int, tp: int, cases: dict) -> dict:
    """Each case (model name, layout for tp) trained next to the whole model on the same batches, each
    dp replica on its part of the whole batch, gradients averaged over dp by an all-reduce; the
    largest differences over every rank (each rank compares its own copy of the whole parameters),
    and the tp all-reduces of the last step."""
    groups = mesh_groups("cpu", Mesh(dp_shard=world // tp, tp=tp))
    replica, replicas = rank // tp, world // tp
    calls = []
    tensor_parallel.all_reduce_sum = _counting_all_reduces(calls)
    results = {}
    for case, (name, layout) in cases.items():
        torch.manual_seed(0)
        entry = MODELS[name]()
        reference, model = entry.model, copy.deepcopy(entry.model)
        slices = apply_tensor_parallel(model, layout, groups.tensor_parallel)
        partial = sequence_parallel_parameters(model, layout)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
        loss_error = 0.0
        for whole in _batches(entry, replicas):
            ids = whole.chunk(replicas)[replica]
            calls.clear()
            loss, reference_loss = (
                _loss(model(ids, labels=ids)),
                _loss(reference(whole, labels=whole)),
            )
            loss.backward()
            tp_reduces = len(calls)
            sum_sequence_parallel_gradients(model, partial, groups.tensor_parallel)
            for parameter in model.parameters():
                wait(all_reduce_mean(parameter.grad, async_op=False, group=groups.data_parallel))
            reference_loss.backward()
            for each in (optimizer, reference_optimizer):
                each.step()
                each.zero_grad()
            mean_loss = wait(
                all_reduce_mean(loss.detach().clone(), async_op=False, group=groups.data_parallel)
            )
            loss_error = max(loss_error, abs(mean_loss.item() - reference_loss.item()))
        full = gather_full_parameters(model, slices, groups.tensor_parallel)
        param_error = max(
            (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
        )
        errors = all_reduce_max(torch.tensor([loss_error, param_error], dtype=torch.float64))
        held = sum(p.numel() for n, p in model.named_parameters() if n in slices)
        whole_size = sum(p.numel() for n, p in reference.named_parameters() if n in slices)
        results[case] = {
            "loss_error": errors[0].item(),
            "param_error": errors[1].item(),
            "sliced": len(slices),
            "held_fraction": held / whole_size,
            "all_reduces": tp_reduces,
            "partial": partial,
        }
    return results | (
        _refusals(groups.tensor_parallel, cases["gpt_sp"][1]) if "gpt_sp" in cases else {}
    )


def _refusals(group, sequence_parallel: TensorParallelLayout) -> dict:
    """The messages of a layout for another degree and of a sequence tp does not divide."""
    found = {}
    try:
        apply_tensor_parallel(
            MODELS["gpt"]().model, TensorParallelLayout(degree=1, pairs=(), replicated=()), group
        )
    except RuntimeMismatchError as error:
        found["mismatch"] = str(error)
    model = MODELS["gpt"]().model
    apply_tensor_parallel(model, sequence_parallel, group)
    ids = torch.zeros(2, 7, dtype=torch.long)
    try:
        model(ids, labels=ids)
    except RuntimeMismatchError as error:
        found["indivisible_sequence"] = str(error)
    return found


@pytest.fixture(scope="module")
def tp2_results(candidates):
    cases = {}
    for name, found in candidates.items():
        cases[name] = (name, found.layout(2))
        cases[f"{name}_sp"] = (name, found.layout(2, sequence_parallel=True))
        cases[f"{name}_sp_vocab"] = (
            name,
            found.layout(2, sequence_parallel=True, vocab_parallel=True),
        )
    return spawn_world(2, train_tensor_parallel, (2, cases))


def _assert_parity(results: dict, cases) -> None:
    failures = {
        case: results[case]
        for case in cases
        if not (
            results[case]["loss_error"] <= TOLERANCE and results[case]["param_error"] <= TOLERANCE
        )
    }
    assert not failures, failures


def test_tp2_trains_like_one_process(tp2_results):
    results = tp2_results
    _assert_parity(results, MODELS)
    for name in MODELS:
        assert results[name]["held_fraction"] == 0.5
        # one in forward (g) and one in backward (f) per pair: q, k and v share their input's f
        assert results[name]["all_reduces"] == 2 * 4
    # GPT: per layer qkv and fc weight and bias, two proj weights; LLaMA (no biases): 7 weights per layer
    assert (results["gpt"]["sliced"], results["llama"]["sliced"]) == (12, 14)
    assert results["mismatch"].startswith("the layout shards over tp=1 ranks, the tp group has 2")


def test_sequence_parallel_trains_like_one_process(tp2_results):
    results = tp2_results
    _assert_parity(results, [f"{name}_sp" for name in MODELS])
    # no all-reduce inside the layers: gathers and reduce-scatters only; the partial gradients of the
    # norms and row-parallel biases are then summed, one all-reduce each
    assert results["gpt_sp"]["all_reduces"] == 0 and results["llama_sp"]["all_reduces"] == 0
    assert results["gpt_sp"]["partial"] == tuple(
        f"h.{i}.{name}"
        for i in range(2)
        for name in (
            "ln_1.weight",
            "ln_1.bias",
            "attn.proj.bias",
            "ln_2.weight",
            "ln_2.bias",
            "mlp.proj.bias",
        )
    )
    assert results["llama_sp"]["partial"] == tuple(
        f"model.layers.{i}.{name}"
        for i in range(2)
        for name in ("input_layernorm.weight", "post_attention_layernorm.weight")
    )
    assert results["indivisible_sequence"] == (
        "sequence parallelism shards the sequence (dim 1 of (2, 7, 64)) over tp=2 ranks, which does not divide 7: "
        "feed sequences of a multiple of 2 tokens (pad them), or make the layout with sequence_parallel=False"
    )


def test_vocab_parallel_embedding_and_head_train_like_one_process(tp2_results):
    results = tp2_results
    _assert_parity(results, [f"{name}_sp_vocab" for name in MODELS])
    # the embedding table and the head's weight join the sliced parameters; every sliced one is halved
    assert (
        results["gpt_sp_vocab"]["sliced"] == 12 + 2
        and results["llama_sp_vocab"]["sliced"] == 14 + 2
    )
    assert results["gpt_sp_vocab"]["held_fraction"] == 0.5


# dp 2 × tp 2 on 4 ranks: the eager runtime (gradients averaged over dp in the test) and the
# torchtitan composition for backend="fsdp2" (DTensor tensor parallelism, fully_shard over dp)


def train_fsdp2_tensor_parallel(rank: int, world: int, tp: int, cases: dict) -> dict:
    """Each case (model name, layout) under apply_tensor_parallel_fsdp2 next to the whole model; the
    loss is each dp replica's, averaged over dp (FSDP2 averages the gradients itself)."""
    mesh = device_mesh("cpu", Mesh(dp_shard=world // tp, tp=tp))
    replica, replicas = rank // tp, world // tp
    results = {}
    for case, (name, layout) in cases.items():
        torch.manual_seed(0)
        entry = MODELS[name]()
        reference, model = entry.model, copy.deepcopy(entry.model)
        apply_tensor_parallel_fsdp2(model, layout, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), **ADAMW)
        loss_error = 0.0
        for whole in _batches(entry, replicas):
            ids = whole.chunk(replicas)[replica]
            loss, reference_loss = (
                _loss(model(ids, labels=ids)),
                _loss(reference(whole, labels=whole)),
            )
            loss.backward()
            reference_loss.backward()
            for each in (optimizer, reference_optimizer):
                each.step()
                each.zero_grad()
            mean_loss = wait(
                all_reduce_mean(
                    loss.detach().clone(), async_op=False, group=mesh["dp_shard"].get_group()
                )
            )
            loss_error = max(loss_error, abs(mean_loss.item() - reference_loss.item()))
        full = tensor_parallel_full_parameters(model, layout)
        param_error = max(
            (full[n] - p.detach()).abs().max().item() for n, p in reference.named_parameters()
        )
        errors = all_reduce_max(torch.tensor([loss_error, param_error], dtype=torch.float64))
        results[case] = {"loss_error": errors[0].item(), "param_error": errors[1].item()}
    return results


def train_dp2_tp2(rank: int, world: int, eager: dict, fsdp2: dict) -> dict:
    return {
        "eager": train_tensor_parallel(rank, world, 2, eager),
        "fsdp2": train_fsdp2_tensor_parallel(rank, world, 2, fsdp2),
    }


def test_dp2_tp2_eager_and_fsdp2_train_like_one_process(candidates):
    gpt, llama = candidates["gpt"], candidates["llama"]
    eager = {"gpt_sp_vocab": ("gpt", gpt.layout(2, sequence_parallel=True, vocab_parallel=True))}
    fsdp2 = {
        "gpt": ("gpt", gpt.layout(2)),
        "gpt_sp_vocab": ("gpt", gpt.layout(2, sequence_parallel=True, vocab_parallel=True)),
        "llama_sp_vocab": ("llama", llama.layout(2, sequence_parallel=True, vocab_parallel=True)),
    }
    results = spawn_world(4, train_dp2_tp2, (eager, fsdp2))
    _assert_parity(results["eager"], eager)
    _assert_parity(results["fsdp2"], fsdp2)
