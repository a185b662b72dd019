"""Expert parallelism: the ep mesh degree in the plan, and the zoo's Hugging Face mixtures of experts
trained with their routed experts split over ep ranks next to one process on the whole batch.

One spawned world of 2 ranks (dp 2, ep 2) and one of 4 (dp 4, ep 2: each expert on 2 ranks) train
every case; the world of 2 also checks what expert parallelism refuses.
"""

import copy
import json

import pytest
import torch
from parity import assert_parity, spawn_world, train_next_to_reference

from shardplan.errors import PlanError, ShardplanError
from shardplan.models import zoo
from shardplan.plan import SCHEMA, Checkpoint, Mesh, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

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
    return found


def run_world(rank: int, world: int) -> dict:
    return {
        "cases": {name: run_case(rank, case) for name, case in CASES[world].items()},
        "refusals": refusals(world),
    }


@pytest.fixture(scope="module", params=sorted(CASES))
def results(request):
    return request.param, spawn_world(request.param, run_world, ())


@pytest.mark.timeout(900)  # a world's setup trains every case of its size
def test_mixtures_of_experts_train_with_their_experts_split_over_ep_ranks_like_one_process(
    results,
):
    world, found = results
    assert_parity(found["cases"], CASES[world])


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
    assert all("\n" not in message for message in found.values())


# the plan, no processes


def test_an_ep_plan_round_trips_and_a_format_5_plan_loads_with_ep_1():
    model = _model("mixtral")
    plan = _plan(model, dp=2, ep=2)
    assert Plan.from_json(plan.to_json()) == plan
    data = json.loads(plan.to_json())
    assert data["schema"] == SCHEMA == "shardplan.plan/6" and data["mesh"]["ep"] == 2
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
