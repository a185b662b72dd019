"""Context parallelism: the cp mesh dimension in the plan, and a Hugging Face LLaMA trained with its
sequences split over cp ranks next to one process on the whole batch.

One spawned world of 2 ranks (cp 2) and one of 4 (dp_shard 2 × cp 2) train every case, then the
world of 4 resumes a checkpoint saved under cp on a plan without it and back, with the same losses.
"""

import copy
import dataclasses
import json
import tempfile

import pytest
import torch
from parity import ADAMW, assert_parity, spawn_world, train_next_to_reference

from shardplan.calibration.accuracy import (
    HF_WORKLOADS,
    measure_hand_plans,
)
from shardplan.compile import solve
from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, SCHEMA, Checkpoint, Mesh, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.adascale import AdaScale
from shardplan.runtime.context_parallel import zigzag_positions
from shardplan.runtime.manual import manual_plan
from shardplan.solver.search import context_parallel_options

STEPS = 3
SEQUENCE = 16
UNITS = [
    ("model.embed_tokens",),
    ("model.layers.0",),
    ("model.layers.1",),
    ("model.norm", "lm_head"),
]
STRATEGIES = (
    ShardStrategy.FULL_SHARD,
    ShardStrategy.SHARD_GRAD_OP,
    ShardStrategy.SHARD_OPTIMIZER,
    ShardStrategy.REPLICATE,
)
"""Every unit kind in one plan: reduce-scattered over dp_shard × cp, and all-reduced."""


def _llama(batch: int):
    torch.manual_seed(0)
    return zoo.hf_llama(
        n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=128, batch=batch, seq=SEQUENCE
    )


def _plan(model, ids: torch.Tensor, **mesh):
    return manual_plan(
        model,
        UNITS,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
        strategies=STRATEGIES,
        **{"dp": 1, **mesh},
    )


def _batches(
    replicas: int, steps: int, first: int = 0, length: int = SEQUENCE
) -> list[torch.Tensor]:
    return [
        torch.randint(0, 128, (2 * replicas, length), generator=torch.Generator().manual_seed(s))
        for s in range(first, first + steps)
    ]


CASES = {
    2: {
        "cp2": {"mesh": dict(cp=2), "clip": 0.05},
        "cp2_checkpointed_micro_batches": {
            "mesh": dict(cp=2),
            "checkpoints": (Checkpoint.FULL, Checkpoint.SELECTIVE),
            "micro_batches": 2,
            "clip": 0.05,
        },
        "cp2_longer_than_planned": {"mesh": dict(cp=2), "length": 2 * SEQUENCE, "clip": 0.05},
    },
    4: {
        "dp2_cp2": {"mesh": dict(dp=2, cp=2), "clip": 0.05},
        "cp4": {"mesh": dict(cp=4), "clip": 0.05},
        "tp2_cp2_sp_vocab": {
            "mesh": dict(tp=2, cp=2, sequence_parallel=True, vocab_parallel=True),
            "clip": 0.05,
        },
    },
}
"""By world size: each case's mesh and how it trains (next to one process on the whole batch)."""


def run_case(rank: int, case: dict) -> dict:
    entry = _llama(2)
    reference, model = entry.model, copy.deepcopy(entry.model)
    plan = manual_plan(
        model,
        UNITS,
        example_inputs=entry.args,
        example_kwargs=entry.kwargs,
        strategies=STRATEGIES,
        checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
        micro_batches=case.get("micro_batches", 1),
        **{"dp": 1, **case["mesh"]},
    )
    program = parallelize(model, plan)
    replicas, replica = plan.mesh.dp, plan.mesh.replica_of(rank)
    batches = [
        (ids.chunk(replicas)[replica], ids)
        for ids in _batches(replicas, STEPS, length=case.get("length", SEQUENCE))
    ]
    return train_next_to_reference(program, reference, batches, clip=case.get("clip"))


def refusals(rank: int) -> dict:
    """What a cp plan refuses, each in one line."""
    entry = _llama(2)
    plan = _plan(entry.model, entry.args[0], cp=2)
    found = {}
    for name, attempt in {
        "fsdp2": lambda: parallelize(copy.deepcopy(entry.model), plan, backend="fsdp2"),
        "loss_fn": lambda: parallelize(
            copy.deepcopy(entry.model), plan, loss_fn=lambda out, target: out.loss
        ),
    }.items():
        try:
            attempt()
        except ShardplanError as error:
            found[name] = str(error)
    program = parallelize(copy.deepcopy(entry.model), plan)
    try:
        AdaScale(torch.optim.SGD(program.parameters(), lr=0.1), program)
    except ShardplanError as error:
        found["adascale"] = str(error)
    ids = entry.args[0]
    for name, (tokens, batch) in {
        "length": (ids[:, :6], dict(labels=ids[:, :6])),
        "padding": (ids, dict(labels=ids, attention_mask=torch.zeros_like(ids))),
        "no_labels": (ids, {}),
    }.items():
        try:
            program.step(tokens, **batch)
        except ShardplanError as error:
            found[name] = f"{type(error).__name__}: {error}"
    return found


def resume_across_meshes(rank: int, directory: str) -> dict:
    """Train 2 steps at dp 2 × cp 2, save; resume at dp 4 for 2 steps, save; resume that at dp 2 ×
    cp 2: the losses after each resume must be those of 4 steps in one run at dp 2 × cp 2."""
    batches = _batches(2, 4)

    def program_on(**mesh):
        model = copy.deepcopy(_llama(2).model)
        program = parallelize(model, _plan(model, batches[0][:2], **mesh))
        return program, torch.optim.AdamW(program.parameters(), **ADAMW)

    def train(program, optimizer, steps: list[torch.Tensor]) -> list[float]:
        losses = []
        mesh = program.plan.mesh
        for ids in steps:
            whole = ids.repeat(mesh.dp // 2, 1)  # the same global batch at every dp
            mine = whole.chunk(mesh.dp)[mesh.replica_of(rank)]
            losses.append(float(program.step(mine, labels=mine)))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    program, optimizer = program_on(dp=2, cp=2)
    train(program, optimizer, batches[:2])
    program.save(f"{directory}/cp", optimizer)
    unbroken = train(program, optimizer, batches[2:])
    program, optimizer = program_on(dp=4)
    program.load(f"{directory}/cp", optimizer)
    without_cp = train(program, optimizer, batches[2:3])
    program.save(f"{directory}/dp", optimizer)
    program, optimizer = program_on(dp=2, cp=2)
    program.load(f"{directory}/dp", optimizer)
    back_on_cp = train(program, optimizer, batches[3:])
    return {
        "loss_error": max(abs(a - b) for a, b in zip(without_cp + back_on_cp, unbroken)),
    }


def run_world(rank: int, world: int, directory: str) -> dict:
    results = {"cases": {name: run_case(rank, case) for name, case in CASES[world].items()}}
    if world == 2:
        results["refusals"] = refusals(rank)
    else:
        results["resume"] = resume_across_meshes(rank, directory)
    return results


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request):
    with tempfile.TemporaryDirectory() as directory:
        return request.param, spawn_world(request.param, run_world, (directory,))


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_a_llama_trains_with_its_sequences_split_over_cp_ranks_like_one_process(results):
    world, found = results
    assert_parity(found["cases"], CASES[world])


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_a_checkpoint_saved_under_cp_resumes_without_it_and_back_with_the_same_losses(results):
    world, found = results
    if world != 4:
        pytest.skip("the world of 4 resumes")
    assert found["resume"]["loss_error"] <= 1e-5, found["resume"]


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_what_context_parallelism_cannot_run_is_refused_in_one_line(results):
    world, found = results
    if world != 2:
        pytest.skip("the world of 2 checks refusals")
    found = found["refusals"]
    assert found["fsdp2"].startswith("backend='fsdp2' does not run context parallelism (cp=2)")
    assert found["loss_fn"].startswith("context parallelism (cp=2) computes the loss inside")
    assert found["length"].startswith(
        "RuntimeMismatchError: input '0' has a sequence of 6 tokens"
    ), found["length"]
    assert "context parallelism takes unpadded sequences" in found["padding"]
    assert "pass labels=..." in found["no_labels"]
    assert found["adascale"].startswith("AdaScale estimates the gradient's noise")
    assert all("\n" not in message for message in found.values())


@pytest.mark.timeout(600)
def test_a_cp_plans_peak_memory_is_predicted_within_3_percent():
    """The example-sized LLaMA (4 layers, hidden 256, 4 x 128 tokens) at cp 2 on 2 gloo ranks, with and
    without checkpointing: MemTracker's peak beside the cost model's (CPU memory is deterministic)."""
    rows = measure_hand_plans(
        HF_WORKLOADS["hf-llama"],
        {
            "cp2": (dict(dp=1, cp=2), Checkpoint.NONE),
            "cp2 full": (dict(dp=1, cp=2), Checkpoint.FULL),
        },
        rounds=0,  # memory alone
    )
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    assert all(abs(ratio - 1) <= 0.03 for ratio in ratios.values()), ratios


# the plan, no processes


@pytest.fixture(scope="module")
def long_llama_chain():
    """A Llama-3.1-8B-shaped model of 4 layers over one sequence of 131072 tokens, on meta, in bf16."""
    entry = zoo.hf_llama(
        n_layer=4,
        d_model=4096,
        ffn=14336,
        heads=32,
        kv_heads=8,
        vocab=128256,
        batch=1,
        seq=131072,
        device="meta",
    )
    return analyze(entry.model, entry.args, entry.kwargs, compute_dtype="bfloat16")


@pytest.mark.slow
def test_the_solver_splits_a_long_sequence_over_cp_ranks_and_shows_the_other_degrees(
    long_llama_chain,
):
    plan = solve(long_llama_chain, 8, hardware="h100-80g", mixed_precision=BF16_MIXED)
    assert plan.mesh.cp > 1 and plan.mesh.pp == 1
    others = [alt.description for alt in plan.reasoning.runner_ups]
    assert any(text.startswith("cp=") for text in others), others
    assert f"each sequence split over {plan.mesh.cp} context-parallel ranks" in plan.summary()
    on_cpu = solve(long_llama_chain, 2, hardware="cpu-gloo", memory_budget="1 TiB")
    assert on_cpu.mesh.cp == 1  # max_context_parallel is 1 on CPU unless asked


def test_cp_is_searched_where_the_model_attends_over_a_sequence_2_cp_chunks_divide(
    long_llama_chain,
):
    assert context_parallel_options(long_llama_chain, 8, 8) == (1, 2, 4, 8)
    assert context_parallel_options(long_llama_chain, 8, 2) == (1, 2)
    short = dataclasses.replace(
        long_llama_chain,
        inputs=tuple(dataclasses.replace(spec, shape=(1, 12)) for spec in long_llama_chain.inputs),
    )
    assert context_parallel_options(short, 8, 8) == (1, 2)  # 12 tokens: 4 chunks, not 8 or 16
    unlabelled = dataclasses.replace(long_llama_chain, inputs=long_llama_chain.inputs[:1])
    assert context_parallel_options(unlabelled, 8, 8) == (1,)


def test_cp_ranks_lie_between_dp_shard_and_tp_and_shard_parameters_with_dp_shard():
    mesh = Mesh(dp_shard=2, cp=2, tp=2)
    assert mesh.size == 8 and mesh.dp == 2
    assert [mesh.coordinates(rank)["cp"] for rank in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [mesh.replica_of(rank) for rank in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    folded = mesh.parameter_mesh
    assert folded == Mesh(dp_shard=4, tp=2)
    assert [folded.coordinates(rank)["dp_shard"] for rank in range(0, 8, 2)] == [0, 1, 2, 3]
    assert "cp=2" in mesh.describe()


def test_each_cp_rank_holds_a_chunk_from_each_end_so_causal_work_balances():
    positions = [zigzag_positions(16, 4, rank).tolist() for rank in range(4)]
    assert positions[0] == [0, 1, 14, 15] and positions[3] == [6, 7, 8, 9]
    assert sorted(sum(positions, [])) == list(range(16))
    earlier_keys = [sum(p + 1 for p in mine) for mine in positions]
    assert len(set(earlier_keys)) == 1  # every rank attends to as many keys


def test_a_cp_plan_round_trips_and_a_format_4_plan_loads_with_cp_1():
    entry = _llama(2)
    plan = _plan(entry.model, entry.args[0], dp=2, cp=2)
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    assert data["schema"] == SCHEMA == "shardplan.plan/7" and data["mesh"]["cp"] == 2
    data["schema"] = "shardplan.plan/4"
    del data["mesh"]["cp"]
    data["world_size"] = 2
    loaded = Plan.from_json(json.dumps(data))
    assert loaded.mesh == Mesh(dp_shard=2) and loaded.schema == SCHEMA
    assert "each sequence split over 2 context-parallel ranks" in plan.summary()


def test_a_plan_whose_cp_does_not_multiply_to_the_world_is_refused():
    entry = _llama(2)
    data = json.loads(_plan(entry.model, entry.args[0], cp=2).to_json())
    data["mesh"]["cp"] = 4
    with pytest.raises(PlanError, match=r"make pp \* dp_replicate \* dp_shard \* cp \* tp equal"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanError, match="every mesh dimension is at least 1"):
        Mesh(cp=0)
