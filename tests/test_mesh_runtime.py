"""The 4-D mesh at run time: tensor parallelism and replica groups (HSDP) composed with the units.

One spawned world of 4 ranks runs every case (tp 2 × dp 2, dp_replicate 2 × dp_shard 2 and tp 2 ×
pp 2 on the zoo GPT and a tiny Hugging Face LLaMA, HSDP under a 2-stage pipeline, each next to one
process on the whole batch), then a checkpoint saved on tp 2 × dp 2 resumed on dp 4 and on HSDP,
and one saved on tp 2 × pp 2 resumed on tp 2 × dp 2 and dp 4, which must continue the same losses.
Every plan is written here once, before the world starts (its capture is the same on every rank),
and given to the ranks as JSON.
"""

import copy
import dataclasses
import tempfile

import pytest
import torch
from parity import ADAMW, assert_parity, spawn_world, train_next_to_reference

from shardplan.errors import ShardplanError
from shardplan.models import zoo
from shardplan.plan import Checkpoint, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

STEPS = 3
WORLD = 4

MODELS = {
    "gpt": (
        lambda batch: zoo.gpt(zoo.GPTConfig(n_layer=2), batch=batch),
        [("wte", "wpe"), ("h.0",), ("h.1",), ("ln_f", "lm_head")],
    ),
    "llama": (
        lambda batch: zoo.hf_llama(
            n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=128, batch=batch, seq=16
        ),
        [
            ("model.embed_tokens",),
            ("model.layers.0",),
            ("model.layers.1",),
            ("model.norm", "lm_head"),
        ],
    ),
}
"""Per model: its builder (batch size → zoo entry) and its units."""

STRATEGIES = (
    ShardStrategy.FULL_SHARD,
    ShardStrategy.SHARD_GRAD_OP,
    ShardStrategy.SHARD_OPTIMIZER,
    ShardStrategy.REPLICATE,
)
"""Every unit kind in one plan: reduce-scattered (then all-reduced over replicas), and all-reduced over dp."""

MESHES = {
    "tp2_dp2": dict(dp=2, tp=2),
    "tp2_dp2_sp_vocab": dict(dp=2, tp=2, sequence_parallel=True, vocab_parallel=True),
    "hsdp2x2": dict(dp=2, dp_replicate=2),
    "tp2_pp2": dict(dp=1, tp=2, pp=2),
    "tp2_pp2_sp_vocab": dict(dp=1, tp=2, pp=2, sequence_parallel=True, vocab_parallel=True),
}


def _plan(model, name: str, mesh: dict, ids: torch.Tensor, **options):
    return manual_plan(
        model,
        MODELS[name][1],
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
        **mesh,
        **options,
    )


def _batches(entry, replicas: int, steps: int, first: int = 0) -> list[torch.Tensor]:
    batch, seq = entry.args[0].shape
    vocab = entry.model.config.vocab_size
    return [
        torch.randint(
            0, vocab, (batch * replicas, seq), generator=torch.Generator().manual_seed(step)
        )
        for step in range(first, first + steps)
    ]


def case_plan(case: dict) -> str:
    """The case's plan, as JSON: its model's units on its mesh, at one replica's batch."""
    entry = MODELS[case["model"]][0](2)
    return _plan(
        entry.model,
        case["model"],
        case["mesh"],
        entry.args[0],
        strategies=case["strategies"],
        checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
        micro_batches=case.get("micro_batches", 1),
        schedule=case.get("schedule", "gpipe"),
    ).to_json()


def run_case(rank: int, case: dict, plan_json: str) -> dict:
    """Train the case's model on its mesh next to one process on the whole batch (see train_next_to_reference)."""
    build, _ = MODELS[case["model"]]
    torch.manual_seed(0)
    entry = build(2)
    reference, model = entry.model, copy.deepcopy(entry.model)
    plan = Plan.from_json(plan_json)
    program = parallelize(model, plan, backend=case.get("backend", "shardplan"))
    replicas, replica = plan.mesh.dp, plan.mesh.replica_of(rank)
    batches = [(ids.chunk(replicas)[replica], ids) for ids in _batches(entry, replicas, STEPS)]
    return train_next_to_reference(program, reference, batches, clip=case.get("clip"))


RESUMES = {
    "tp2_dp2": (
        "tp2_dp2_sp_vocab",
        {
            "dp4": (dict(dp=4), "shardplan"),
            "hsdp2x2": (MESHES["hsdp2x2"], "shardplan"),
            "hsdp2x2_fsdp2": (MESHES["hsdp2x2"], "fsdp2"),
        },
    ),
    "tp2_pp2": (
        "tp2_pp2_sp_vocab",
        {"tp2_dp2": (MESHES["tp2_dp2"], "shardplan"), "dp4": (dict(dp=4), "shardplan")},
    ),
}
"""Per resume: the mesh the checkpoint is saved on (backend "shardplan") and the meshes and backends it resumes on."""


def _resume_batches(entry) -> list[torch.Tensor]:
    return _batches(entry, WORLD // 2, 4)


def resume_plans(saved_on: str, resumed_on: dict) -> dict[str, str]:
    """LLaMA's plans of a resume, as JSON, by mesh name (saved_on's and each of resumed_on's), at one
    replica's batch of the resume's batches."""
    entry = MODELS["llama"][0](2)
    meshes = {saved_on: MESHES[saved_on]} | {name: mesh for name, (mesh, _) in resumed_on.items()}
    first = _resume_batches(entry)[0]
    plans, written = {}, {}
    for name, mesh in meshes.items():
        key = repr(sorted(mesh.items()))  # a mesh two backends resume on: one plan
        if key in written:
            plans[name] = written[key]
            continue
        replicas = mesh["dp"] * mesh.get("dp_replicate", 1)
        plans[name] = written[key] = _plan(
            entry.model,
            "llama",
            mesh,
            first.chunk(replicas)[0],
            strategies=STRATEGIES,
            micro_batches=mesh.get("pp", 1),
        ).to_json()
    return plans


def resume_across_meshes(
    rank: int, directory: str, saved_on: str, resumed_on: dict, plans: dict[str, str]
) -> dict:
    """Train LLaMA 2 steps on MESHES[saved_on], save; resume on each of `resumed_on` for 2 more steps, next
    to the same 4 steps in one run on `saved_on`: the losses after the resume must be the same. `plans`:
    resume_plans'."""
    build, _ = MODELS["llama"]
    torch.manual_seed(0)
    entry = build(2)
    batches = _resume_batches(entry)

    def program_on(name: str, backend: str = "shardplan"):
        model = copy.deepcopy(entry.model)
        program = parallelize(model, Plan.from_json(plans[name]), backend=backend)
        return program, torch.optim.AdamW(program.parameters(), **ADAMW)

    def train(program, optimizer, steps: list[torch.Tensor]) -> list[float]:
        losses = []
        replicas, replica = program.plan.mesh.dp, program.plan.mesh.replica_of(rank)
        for ids in steps:
            mine = ids.chunk(replicas)[replica]
            losses.append(float(program.step(mine, labels=mine)))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    program, optimizer = program_on(saved_on)
    train(program, optimizer, batches[:2])
    program.save(f"{directory}/{saved_on}", optimizer)
    unbroken = train(program, optimizer, batches[2:])
    exported = program.export_full_state_dict()
    resumed = {}
    for name, (_, backend) in resumed_on.items():
        program, optimizer = program_on(name, backend)
        program.load(f"{directory}/{saved_on}", optimizer)
        resumed[name] = max(
            abs(a - b) for a, b in zip(train(program, optimizer, batches[2:]), unbroken)
        )
    names = sorted(exported) if rank == 0 else []
    shapes = {name: list(exported[name].shape) for name in names}
    return {
        "loss_error": resumed,
        "exported_shapes": shapes,
        "model_shapes": {name: list(p.shape) for name, p in entry.model.state_dict().items()},
    }


def refusals(rank: int, plan_json: str) -> dict:
    """A plan whose sliced modules differ from what the model offers; `plan_json`: GPT's on tp2_dp2."""
    found = {}
    entry = MODELS["gpt"][0](2)
    plan = Plan.from_json(plan_json)
    edited = dataclasses.replace(
        plan,
        tensor_parallel=dataclasses.replace(
            plan.tensor_parallel, sharded=plan.tensor_parallel.sharded[1:]
        ),
    )
    try:
        parallelize(entry.model, edited)
    except ShardplanError as error:
        found["layout"] = str(error)
    return found


CASES = {
    **{
        f"{model}_{mesh}": {
            "model": model,
            "mesh": MESHES[mesh],
            "strategies": STRATEGIES,
            "clip": 0.05,
        }
        for model, mesh in (
            ("gpt", "tp2_dp2"),
            ("gpt", "hsdp2x2"),
            ("llama", "tp2_dp2_sp_vocab"),
            ("llama", "hsdp2x2"),
        )
    },
    "gpt_tp2_dp2_sp_vocab_micro_batches_checkpointed": {
        "model": "gpt",
        "mesh": MESHES["tp2_dp2_sp_vocab"],
        "strategies": STRATEGIES,
        "micro_batches": 2,
        "checkpoints": (Checkpoint.FULL, Checkpoint.SELECTIVE),
        "clip": 0.05,
    },
    "gpt_pp2_hsdp2": {
        "model": "gpt",
        "mesh": dict(dp=1, dp_replicate=2, pp=2),
        "strategies": STRATEGIES,
        "micro_batches": 2,
        "clip": 0.05,
    },
    # tp inside pipeline stages: 1F1B over checkpointed units on GPT, sequence and vocab parallel LLaMA
    "gpt_tp2_pp2_1f1b_checkpointed": {
        "model": "gpt",
        "mesh": MESHES["tp2_pp2"],
        "strategies": STRATEGIES,
        "micro_batches": 2,
        "schedule": "1f1b",
        "checkpoints": (Checkpoint.FULL, Checkpoint.SELECTIVE),
        "clip": 0.05,
    },
    "llama_tp2_pp2_sp_vocab": {
        "model": "llama",
        "mesh": MESHES["tp2_pp2_sp_vocab"],
        "strategies": STRATEGIES,
        "micro_batches": 2,
        "clip": 0.05,
    },
    # FSDP2 has no ZeRO-1 or DDP unit: the first two strategies
    **{
        f"{model}_{mesh}_fsdp2": {
            "model": model,
            "mesh": MESHES[mesh],
            "strategies": STRATEGIES[:2],
            "clip": 0.05,
            "backend": "fsdp2",
        }
        for model, mesh in (("gpt", "tp2_dp2_sp_vocab"), ("llama", "hsdp2x2"))
    },
}


def run_world(rank: int, world: int, directory: str, plans: dict) -> dict:
    return {
        "cases": {name: run_case(rank, case, plans["cases"][name]) for name, case in CASES.items()},
        "resume": {
            saved: resume_across_meshes(rank, directory, *how, plans["resume"][saved])
            for saved, how in RESUMES.items()
        },
        "refusals": refusals(rank, plans["cases"]["gpt_tp2_dp2"]),
    }


@pytest.fixture(scope="module")
def results():
    plans = {
        "cases": {name: case_plan(case) for name, case in CASES.items()},
        "resume": {saved: resume_plans(*how) for saved, how in RESUMES.items()},
    }
    with tempfile.TemporaryDirectory() as directory:
        return spawn_world(WORLD, run_world, (directory, plans))


def test_tp_and_hsdp_train_like_one_process(results):
    assert_parity(results["cases"], CASES)


@pytest.mark.parametrize("saved", RESUMES)
def test_a_checkpoint_of_a_tp_mesh_resumes_on_other_meshes_and_backends_with_the_same_losses(
    results, saved
):
    resume = results["resume"][saved]
    assert set(resume["loss_error"]) == set(RESUMES[saved][1])
    assert all(error <= 1e-5 for error in resume["loss_error"].values()), resume["loss_error"]
    assert resume["exported_shapes"] == resume["model_shapes"]  # full names and shapes, not slices


def test_unsupported_meshes_and_foreign_layouts_are_refused(results):
    found = results["refusals"]
    assert found["layout"].startswith(
        "the plan slices other modules over tp than this model offers (1 differ, "
        "first: 'h.0.attn.qkv')"
    )
