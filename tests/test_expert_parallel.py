"""Expert parallelism: the ep mesh degree in the plan, and the zoo's Hugging Face mixtures of experts
trained with their routed experts split over ep ranks next to one process on the whole batch.

One spawned world of 2 ranks (dp 2, ep 2) and one of 4 (dp 4, ep 2: each expert on 2 ranks) train
every case, check what expert parallelism refuses, and resume a checkpoint saved under one ep on a
plan with another and back, with the same losses.
"""

import copy
import json
import tempfile

import pytest
import torch
from parity import ADAMW, assert_parity, spawn_world, train_next_to_reference

from shardplan import get_hardware
from shardplan.calibration.accuracy import (
    HF_WORKLOADS,
    measure_hand_plans,
)
from shardplan.compile import solve
from shardplan.costmodel.cost import CostContext, unit_cost
from shardplan.errors import PlanError, ShardplanError
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import SCHEMA, Checkpoint, Decision, Mesh, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.adascale import AdaScale
from shardplan.runtime.manual import manual_plan
from shardplan.solver.search import expert_parallel_options

STEPS = 3
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
"""Every unit kind in one plan: the experts leave the layers' units whatever their strategy."""


def _model(architecture: str):
    torch.manual_seed(0)
    return zoo.hf_architecture(architecture).model


def _plan(model, **mesh):
    return manual_plan(model, UNITS, strategies=STRATEGIES, **{"dp": 1, **mesh})


CASES = {
    2: {
        "mixtral_ep2": {"model": "mixtral", "mesh": dict(dp=2, ep=2), "clip": 0.05},
        "qwen3_moe_ep2": {"model": "qwen3-moe", "mesh": dict(dp=2, ep=2), "clip": 0.05},
        "qwen2_moe_ep2": {"model": "qwen2-moe", "mesh": dict(dp=2, ep=2), "clip": 0.05},
        "deepseek_v3_ep2": {"model": "deepseek-v3", "mesh": dict(dp=2, ep=2), "clip": 0.05},
        "mixtral_ep2_micro_batches": {
            "model": "mixtral",
            "mesh": dict(dp=2, ep=2),
            "micro_batches": 2,
            "clip": 0.05,
        },
        "mixtral_cp2_ep2": {"model": "mixtral", "mesh": dict(cp=2, ep=2), "clip": 0.05},
        "mixtral_ep2_checkpointed": {
            "model": "mixtral",
            "mesh": dict(dp=2, ep=2),
            "checkpoints": (Checkpoint.FULL,),
            "clip": 0.05,
        },
    },
    4: {
        "mixtral_dp4_ep2": {"model": "mixtral", "mesh": dict(dp=4, ep=2), "clip": 0.05},
        "qwen3_moe_dp4_ep2": {"model": "qwen3-moe", "mesh": dict(dp=4, ep=2), "clip": 0.05},
        "mixtral_ep4": {"model": "mixtral", "mesh": dict(dp=4, ep=4), "clip": 0.05},
    },
}
"""By world size: each case's model, mesh and how it trains (next to one process on the whole batch)."""


def run_case(rank: int, case: dict) -> dict:
    reference = _model(case["model"])
    model = copy.deepcopy(reference)
    plan = manual_plan(
        model,
        UNITS,
        strategies=STRATEGIES,
        checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
        micro_batches=case.get("micro_batches", 1),
        **{"dp": 1, **case["mesh"]},
    )
    program = parallelize(model, plan)
    replicas, replica = plan.mesh.dp, plan.mesh.replica_of(rank)
    batches = [
        (ids.chunk(replicas)[replica], ids)
        for ids in (
            torch.randint(0, 512, (2 * replicas, 16), generator=torch.Generator().manual_seed(s))
            for s in range(STEPS)
        )
    ]
    return train_next_to_reference(program, reference, batches, clip=case.get("clip"))


def refusals(world: int) -> dict:
    """What an ep plan refuses, each in one line: a pipeline in the world of 4, the rest in that of 2."""
    mixtral = _model("mixtral")
    attempts = {
        "fsdp2": lambda: parallelize(
            copy.deepcopy(mixtral), _plan(mixtral, dp=2, ep=2), backend="fsdp2"
        ),
        "no_experts": lambda: parallelize(_model("llama"), _plan(_model("llama"), dp=2, ep=2)),
    }
    if world == 4:
        attempts = {
            "pipeline": lambda: parallelize(
                copy.deepcopy(mixtral), _plan(mixtral, dp=2, ep=2, pp=2)
            )
        }
    found = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except ShardplanError as error:
            found[name] = str(error)
    if world == 2:
        program = parallelize(copy.deepcopy(mixtral), _plan(mixtral, dp=2, ep=2))
        try:
            AdaScale(torch.optim.SGD(program.parameters(), lr=0.1), program)
        except ShardplanError as error:
            found["adascale"] = str(error)
    return found


RESUMED_MESHES = {
    2: (dict(dp=2, ep=2), dict(dp=2), dict(dp=2, ep=2)),
    4: (dict(dp=4, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2)),
}
"""By world size: the mesh that saves, the one that resumes and saves again, and the one that resumes
that."""


def resume_across_meshes(rank: int, world: int, directory: str) -> dict:
    """Train 2 steps on the first mesh and save; resume on the second for a step and save; resume that
    on the third for a step: the losses after each resume must be those of 4 steps in one run."""
    first, second, third = RESUMED_MESHES[world]
    batches = [
        torch.randint(0, 512, (2 * world, 16), generator=torch.Generator().manual_seed(s))
        for s in range(4)
    ]

    def program_on(mesh: dict):
        model = _model("mixtral")
        program = parallelize(model, _plan(model, **mesh))
        return program, torch.optim.AdamW(program.parameters(), **ADAMW)

    def train(program, optimizer, steps: list[torch.Tensor]) -> list[float]:
        losses = []
        for ids in steps:
            mine = ids.chunk(world)[rank]
            losses.append(float(program.step(mine, labels=mine)))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    program, optimizer = program_on(first)
    train(program, optimizer, batches[:2])
    program.save(f"{directory}/first", optimizer)
    unbroken = train(program, optimizer, batches[2:])
    program, optimizer = program_on(second)
    program.load(f"{directory}/first", optimizer)
    resumed = train(program, optimizer, batches[2:3])
    program.save(f"{directory}/second", optimizer)
    program, optimizer = program_on(third)
    program.load(f"{directory}/second", optimizer)
    resumed += train(program, optimizer, batches[3:])
    return {"loss_error": max(abs(a - b) for a, b in zip(resumed, unbroken))}


def run_world(rank: int, world: int, directory: str) -> dict:
    return {
        "cases": {name: run_case(rank, case) for name, case in CASES[world].items()},
        "refusals": refusals(world),
        "resume": resume_across_meshes(rank, world, directory),
    }


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request):
    with tempfile.TemporaryDirectory() as directory:
        return request.param, spawn_world(request.param, run_world, (directory,))


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_mixtures_of_experts_train_with_their_experts_split_over_ep_ranks_like_one_process(
    results,
):
    world, found = results
    assert_parity(found["cases"], CASES[world])


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_a_checkpoint_saved_under_one_ep_resumes_under_another_with_the_same_losses(results):
    world, found = results
    assert found["resume"]["loss_error"] <= 1e-5, (RESUMED_MESHES[world], found["resume"])


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_what_expert_parallelism_cannot_run_is_refused_in_one_line(results):
    world, found = results
    found = found["refusals"]
    if world == 4:
        assert found["pipeline"].startswith("expert parallelism (ep=2) does not run with pp=2")
        return
    assert found["fsdp2"].startswith("backend='fsdp2' does not run expert parallelism (ep=2)")
    assert "has no routed experts" in found["no_experts"], found
    assert "re-plan with ep=1" in found["no_experts"]
    assert found["adascale"].startswith("AdaScale estimates the gradient's noise")
    assert all("\n" not in message for message in found.values())


@pytest.mark.timeout(600)
def test_an_ep_plans_peak_memory_is_predicted_within_3_percent():
    """The example-sized Mixtral (4 layers, hidden 256, 4 x 128 tokens a rank) at dp 2 × ep 2 on 2 gloo
    ranks, with and without checkpointing: MemTracker's peak beside the cost model's (CPU memory is
    deterministic)."""
    rows = measure_hand_plans(
        HF_WORKLOADS["hf-mixtral"],
        {
            "ep2": (dict(dp=2, ep=2), Checkpoint.NONE),
            "ep2 full": (dict(dp=2, ep=2), Checkpoint.FULL),
        },
        rounds=0,  # memory alone
    )
    ratios = {row.kind: round(row.memory_ratio, 3) for row in rows}
    assert all(abs(ratio - 1) <= 0.03 for ratio in ratios.values()), ratios


# the plan and the cost model, no processes


def test_the_analysis_finds_the_routed_experts_and_the_tokens_routed_to_them():
    entry = zoo.hf_architecture("mixtral")  # 2 x 16 tokens, top-2 of 4 experts, hidden 64
    chain = analyze(entry.model, entry.args, entry.kwargs)
    experts = entry.model.model.layers[0].mlp.experts
    moe = [block for block in chain.blocks if block.expert_param_numel]
    assert [block.name for block in moe] == ["model.layers.0", "model.layers.1"]
    assert moe[0].expert_param_numel == experts.gate_up_proj.numel() + experts.down_proj.numel()
    assert moe[0].routed_elements == 2 * 16 * 2 * 64


def test_ep_divides_the_experts_state_and_prices_their_all_to_all():
    entry = zoo.hf_architecture("mixtral")
    chain = analyze(entry.model, entry.args, entry.kwargs)
    block = next(block for block in chain.blocks if block.expert_param_numel)
    hardware = get_hardware("h100-80g")
    decision = Decision(strategy=ShardStrategy.FULL_SHARD)
    alone, split = (
        unit_cost((block,), decision, CostContext(hardware=hardware, dp=4, ep=ep)) for ep in (1, 4)
    )
    expert_state = block.expert_param_numel * (4 + 4 + 8)  # fp32 parameters, gradient, AdamW
    # sharded over 4 ranks without ep; whole on each of 4 ep ranks, a quarter of the experts each
    assert alone.state_bytes - split.state_bytes == pytest.approx(0, abs=expert_state * 0.01)
    assert split.tensor_parallel_s > alone.tensor_parallel_s == 0.0
    two = unit_cost((block,), decision, CostContext(hardware=hardware, dp=4, ep=2))
    assert two.state_bytes - alone.state_bytes == pytest.approx(expert_state / 4, rel=0.01)


def test_an_ep_plan_round_trips_and_a_format_5_plan_loads_with_ep_1():
    model = _model("mixtral")
    plan = _plan(model, dp=2, ep=2)
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    assert data["schema"] == SCHEMA == "shardplan.plan/7" and data["mesh"]["ep"] == 2
    data["schema"] = "shardplan.plan/5"
    del data["mesh"]["ep"]
    loaded = Plan.from_json(json.dumps(data))
    assert loaded.mesh == Mesh(dp_shard=2) and loaded.schema == SCHEMA
    assert "routed experts split over 2 expert-parallel ranks" in plan.summary()
    assert plan.mesh.describe() == "pp=1 dp_shard=2 ep=2"


def test_an_ep_that_does_not_divide_the_sharding_ranks_is_refused():
    with pytest.raises(PlanError, match=r"ep=4 does not divide dp_shard \* cp = 2"):
        Mesh(dp_shard=2, ep=4)
    with pytest.raises(PlanError, match="every mesh dimension is at least 1"):
        Mesh(ep=0)
    assert Mesh(dp_shard=2, cp=2, ep=4).size == 4  # ep borrows ranks, it adds none


def test_ep_is_searched_among_the_degrees_dividing_the_world_and_every_blocks_experts():
    mixtral = zoo.hf_architecture("mixtral")  # 4 experts a layer
    chain = analyze(mixtral.model, mixtral.args, mixtral.kwargs)
    assert expert_parallel_options(chain, 8, 8) == (1, 2, 4)
    assert expert_parallel_options(chain, 6, 8) == (1, 2)
    assert expert_parallel_options(chain, 8, 1) == (1,)
    llama = zoo.hf_architecture("llama")
    assert expert_parallel_options(analyze(llama.model, llama.args, llama.kwargs), 8, 8) == (1,)


def test_the_solver_prices_each_ep_degree_and_shows_the_best_plan_of_each():
    mixtral = zoo.hf_architecture("mixtral", batch=8)
    chain = analyze(mixtral.model, mixtral.args, mixtral.kwargs)
    plan = solve(chain, 4, hardware="h100-80g")
    shown = {plan.mesh.ep} | {
        int(alt.description.split()[0].removeprefix("ep="))
        for alt in plan.reasoning.runner_ups
        if alt.description.startswith("ep=")
    }
    assert shown >= {2, 4}, [alt.description for alt in plan.reasoning.runner_ups]
    on_cpu = solve(chain, 4, hardware="cpu-gloo", memory_budget="1 TiB")
    assert on_cpu.mesh.ep == 1  # max_expert_parallel is 1 on CPU unless asked
    asked = solve(chain, 4, hardware="cpu-gloo", memory_budget="1 TiB", max_expert_parallel=4)
    assert {alt.description.split()[0] for alt in asked.reasoning.runner_ups} & {"ep=2", "ep=4"}
