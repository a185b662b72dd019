"""Hugging Face architectures from tiny configs, pipelined (pp = 2) and on backend="fsdp2", against one process.

Each plan puts the blocks in units of their own, so the input embedding (stage 0) and the head
(stage 1) of a tied model sit on different stages, and in different units: the ties the runtime
must keep (see [Note: tied weights across stages] in runtime/pipelined.py). Most plans are written
by hand; RoBERTa's and BART's are compile's, whose units leave a module holding a tied parameter
(RoBERTa's `lm_head`, BART's `model.shared`) in no unit, which fsdp2 must group with the tie. One
spawned world of 2 gloo ranks writes every plan, each once, by one rank, then runs every case (2
steps each); rank 0 returns the differences from the reference. The solver's side: a cut between
tied blocks is allowed and priced, and T5 pipelines. benchmarks/bench_architectures.py runs every
architecture of zoo.HF_ARCHITECTURES.
"""

import copy
import functools
import warnings
from dataclasses import replace

import pytest
import torch
from parity import assert_parity, spawn_world, train_next_to_reference, written_once

from shardplan.compile import compile, solve
from shardplan.costmodel.hardware import get_hardware
from shardplan.frontend.passes import analyze, fingerprint_of
from shardplan.models import zoo
from shardplan.plan import Mesh, Plan, Schedule, Stage
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan
from shardplan.solver.search import Configuration, Setting, smallest_peak, tied_terms
from shardplan.solver.space import SearchSpace, default_space, resolve_rules

STEPS = 2
BATCH, SEQ = 4, 16


def _opt(batch: int, seq: int):
    import transformers

    config = transformers.OPTConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        ffn_dim=128,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
        dropout=0.0,
        attention_dropout=0.0,
    )
    return zoo._hf_causal_lm(config, batch, seq, "cpu")


def _falcon(batch: int, seq: int):
    import transformers

    config = transformers.FalconConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=64,
    )
    return zoo._hf_causal_lm(config, batch, seq, "cpu")


MODELS = {  # builder, each unit's modules (the chain's blocks; BERT's head holds its tied decoder bias)
    "gpt2-tied": (
        lambda: zoo.hf_gpt2(batch=BATCH, seq=SEQ),
        [
            ("transformer.wte",),
            ("transformer.wpe",),
            ("transformer.h.0",),
            ("transformer.h.1",),
            ("transformer.ln_f", "lm_head"),
        ],
    ),
    "opt-tied": (
        lambda: _opt(BATCH, SEQ),
        [
            ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
            ("model.decoder.layers.0",),
            ("model.decoder.layers.1",),
            ("model.decoder.final_layer_norm", "lm_head"),
        ],
    ),
    "bert": (
        lambda: zoo.hf_bert(batch=BATCH, seq=SEQ),
        [
            (
                "bert.embeddings.word_embeddings",
                "bert.embeddings.token_type_embeddings",
                "bert.embeddings.position_embeddings",
                "bert.embeddings.LayerNorm",
            ),
            ("bert.encoder.layer.0",),
            ("bert.encoder.layer.1",),
            ("cls.predictions.transform", "cls.predictions.decoder", "cls.predictions"),
        ],
    ),
    # encoder-decoder: the shared table feeds the encoder (stage 0), the decoder and the tied head (stage 1)
    "t5-tied": (
        lambda: zoo.hf_t5(batch=BATCH, seq=SEQ),
        [
            ("shared", "encoder.embed_tokens"),
            ("encoder.block.0",),
            ("encoder.block.1",),
            ("encoder.final_layer_norm",),
            ("decoder.block.0",),
            ("decoder.block.1",),
            ("decoder.final_layer_norm", "lm_head"),
        ],
    ),
    # MoE routing: transformers picks histc's dtype by device type, so a stage must be captured on its device
    "mixtral": (
        lambda: zoo.hf_mixtral(batch=BATCH, seq=SEQ),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    # multi-query attention indexes with a Python list, a constant export lifts: it must hold its values
    "falcon-tied": (
        lambda: _falcon(BATCH, SEQ),
        [
            ("transformer.word_embeddings",),
            ("transformer.h.0",),
            ("transformer.h.1",),
            ("transformer.ln_f", "lm_head"),
        ],
    ),
    # MoE routing with a gated shared expert beside the routed ones
    "qwen2-moe": (
        lambda: zoo.hf_architecture("qwen2-moe", batch=BATCH, seq=SEQ),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    # MoE routing by expert groups, a shared expert, a dense first layer, latent attention
    "deepseek-v3": (
        lambda: zoo.hf_architecture("deepseek-v3", batch=BATCH, seq=SEQ),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
    # compile's units (None): the loose `lm_head` holds the decoder's bias and contains two other units
    "roberta": (lambda: zoo.hf_architecture("roberta", batch=BATCH, seq=SEQ), None),
    # encoder-decoder, compile's units: the loose `model.shared` is tied to three units on both stages
    "bart": (lambda: zoo.hf_architecture("bart", batch=BATCH, seq=SEQ), None),
}
MODES = {
    "gpt2-tied": ("pp2", "fsdp2"),
    "opt-tied": ("pp2", "fsdp2"),
    "bert": ("pp2", "fsdp2"),
    "t5-tied": ("pp2",),
    "mixtral": ("pp2",),
    "falcon-tied": ("pp2",),
    "qwen2-moe": ("pp2",),
    "deepseek-v3": ("pp2",),
    "roberta": ("fsdp2",),
    "bart": ("pp2", "fsdp2"),
}
CASES = {
    f"{model}/{mode}": {"model": model, "mode": mode}
    for model, modes in MODES.items()
    for mode in modes
}


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name][0]().model


def _batches(vocab: int) -> list[torch.Tensor]:
    return [
        torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        for step in range(STEPS)
    ]


def compiled(model: torch.nn.Module, ids: torch.Tensor) -> Plan:
    """compile's plan for 2 ranks each given half of `ids`: data parallel, a unit per block."""
    half = ids.chunk(2)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the parameters a tie leaves unread
        return compile(
            model,
            2,
            (half,),
            {"labels": half},
            hardware="cpu-gloo",
            allow_pipeline=False,
            space=SearchSpace(max_unit_blocks=1),
        )


def pipelined(plan: Plan, model: torch.nn.Module, batch: int) -> Plan:
    """`plan`'s units cut into 2 stages of as many units each (GPipe, 2 micro-batches), each rank `batch` samples."""
    names = [unit.name for unit in plan.units]
    inputs = tuple(replace(spec, shape=(batch, *spec.shape[1:])) for spec in plan.inputs)
    return replace(
        plan,
        mesh=Mesh(pp=2, dp_shard=1),
        inputs=inputs,
        fingerprint=fingerprint_of(model, inputs),
        schedule=Schedule(num_micro_batches=2, name="gpipe"),
        stages=(
            Stage(index=0, units=tuple(names[: len(names) // 2])),
            Stage(index=1, units=tuple(names[len(names) // 2 :])),
        ),
    )


def hand_written_plan(name: str, pp: int) -> str:
    """The plan, as JSON, of a model whose units MODELS gives: at pp 2 (2 micro-batches) or dp 2."""
    model = _model(name)
    ids = _batches(model.config.vocab_size)[0]
    mine = ids if pp == 2 else ids.chunk(2)[0]  # one replica's batch: every replica's has its shape
    return manual_plan(
        model,
        MODELS[name][1],
        dp=2 // pp,
        pp=pp,
        micro_batches=2 if pp == 2 else 1,
        example_inputs=(mine,),
        example_kwargs={"labels": mine},
    ).to_json()


def compiled_plan(name: str) -> str:
    """compile's plan, as JSON, of a model whose units MODELS leaves to it."""
    model = _model(name)
    return compiled(model, _batches(model.config.vocab_size)[0]).to_json()


def written_plans(rank: int, world: int) -> dict:
    """Every plan the cases and round_trip train, as JSON: compile's by model, the hand-written ones by
    (model, pp). Each is written by one rank (see parity.written_once); compile's go first, onto
    different ranks."""
    writers = {
        name: functools.partial(compiled_plan, name)
        for name, (_, units) in MODELS.items()
        if units is None
    }
    for case in CASES.values():
        name, pp = case["model"], 2 if case["mode"] == "pp2" else 1
        if MODELS[name][1] is not None:
            writers[name, pp] = functools.partial(hand_written_plan, name, pp)
    return written_once(rank, world, writers)


def _plan(model: torch.nn.Module, name: str, pp: int, plans: dict) -> Plan:
    if MODELS[name][1] is not None:
        return Plan.from_json(plans[name, pp])
    plan = Plan.from_json(plans[name])
    return pipelined(plan, model, BATCH) if pp == 2 else plan


def run_case(rank: int, case: dict, plans: dict) -> dict:
    reference = _model(case["model"])
    model = copy.deepcopy(reference)
    pp = 2 if case["mode"] == "pp2" else 1
    plan = _plan(model, case["model"], pp, plans)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fsdp2 says it merges the tied units
        program = parallelize(
            model, plan, backend="fsdp2" if case["mode"] == "fsdp2" else "shardplan"
        )
    batches = _batches(reference.config.vocab_size)
    return train_next_to_reference(
        program,
        reference,
        [(ids if pp == 2 else ids.chunk(2)[rank], ids) for ids in batches],
        clip=0.05,
    )


def round_trip(rank: int, directory: str, plans: dict) -> float | None:
    """A tied pp = 2 plan's checkpoint loaded into a dp = 2 plan: the largest difference of their exports."""
    trained = _model("gpt2-tied")
    program = parallelize(trained, _plan(trained, "gpt2-tied", 2, plans))
    ids = _batches(trained.config.vocab_size)[0]
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-2)
    program.step(ids, labels=ids)
    optimizer.step()
    program.save(directory, optimizer)
    saved = program.export_full_state_dict()
    fresh = _model("gpt2-tied")
    loaded = parallelize(fresh, _plan(fresh, "gpt2-tied", 1, plans))
    loaded.load(directory, torch.optim.AdamW(loaded.parameters(), lr=1e-2))
    state = loaded.export_full_state_dict()
    if rank:
        return None
    assert saved.keys() == state.keys() and "lm_head.weight" in state
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    return max((saved[name] - state[name]).abs().max().item() for name in state)


def _all_cases(rank: int, world: int, directory: str) -> dict:
    plans = written_plans(rank, world)
    results = {name: run_case(rank, case, plans) for name, case in CASES.items()}
    results["round_trip"] = round_trip(rank, directory, plans)
    return results


@pytest.mark.timeout(600)
def test_architectures_pipeline_and_fsdp2_match_one_process(tmp_path):
    results = spawn_world(2, _all_cases, (str(tmp_path / "ckpt"),))
    assert_parity(results, {name: {"clip": True} for name in CASES})
    assert results["round_trip"] == 0.0


def test_the_solver_cuts_stages_between_tied_blocks_and_prices_the_copy():
    entry = zoo.hf_gpt2(batch=4, seq=16)  # the head reads the embedding's weight
    chain = analyze(entry.model, entry.args, entry.kwargs)
    n = len(chain.blocks)
    assert chain.tied_edges == ((0, n - 1),)
    setting = Setting(
        world_size=2, batch_size=4, skip_edges=chain.skip_edges, tied_edges=chain.tied_edges
    )
    rules, space, hardware = (
        resolve_rules(chain.blocks, None),
        default_space(n),
        get_hardware("cpu-gloo"),
    )
    least = smallest_peak(chain.blocks, rules, setting, hardware, space)
    least_data_parallel = smallest_peak(
        chain.blocks, rules, replace(setting, allow_pipeline=False), hardware, space
    )
    plan = solve(chain, 2, hardware="cpu-gloo", memory_budget=(least + least_data_parallel) // 2)
    assert plan.mesh.pp == 2  # before, nothing fit: no cut could part the tied blocks
    configuration = Configuration(mesh=Mesh(pp=2, dp_shard=1), schedule=Schedule())
    owner, reader = (
        tied_terms(chain.blocks, start, end, setting, configuration, hardware)
        for start, end in ((0, 2), (2, n))
    )
    table_bytes = 4 * chain.blocks[0].param_numel
    assert (owner.copy_bytes, reader.copy_bytes) == (
        0,
        2 * table_bytes,
    )  # the copy and its gradient
    assert owner.sync_s == reader.sync_s > 0
    assert tied_terms(chain.blocks, 0, n, setting, configuration, hardware) == (0, 0.0)


def test_t5_pipelines_where_data_parallelism_does_not_fit():
    """T5's shared table feeds its first and last blocks: with no cut allowed between tied blocks, no
    budget could pipeline it; a copy priced into the stage's budget makes it the plan that fits."""
    entry = zoo.hf_t5(batch=4, seq=16)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    setting = Setting(
        world_size=2, batch_size=4, skip_edges=chain.skip_edges, tied_edges=chain.tied_edges
    )
    rules, space, hardware = (
        resolve_rules(chain.blocks, None),
        default_space(len(chain.blocks)),
        get_hardware("cpu-gloo"),
    )
    least = smallest_peak(chain.blocks, rules, setting, hardware, space)
    least_data_parallel = smallest_peak(
        chain.blocks, rules, replace(setting, allow_pipeline=False), hardware, space
    )
    assert least < least_data_parallel
    plan = solve(chain, 2, hardware="cpu-gloo", memory_budget=(least + least_data_parallel) // 2)
    assert plan.mesh.pp == 2 and plan.predicted.peak_bytes <= (least + least_data_parallel) // 2
