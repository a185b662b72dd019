"""backend="fsdp2" with pp > 1: this rank's stage under fully_shard, run by a pipeline schedule, trains
exactly like one process on the whole batch.

One spawned world of 4 ranks runs every case (dp 2 × pp 2 with 1F1B on the zoo GPT, stepping a batch
smaller than planned too; GPipe on a tiny Hugging Face LLaMA; tp 2 × pp 2 with sequence and vocab
parallelism on both; GPT-2 with its tied head and embedding on different stages; HSDP inside the stages), and
a checkpoint saved on dp 2 × pp 2 resumed on backend "shardplan" at dp 4 and back; rank 0 returns the
records the tests read. Every plan is written once, before the world starts (its capture is the same
on every rank), and given to the ranks as JSON.
"""

import copy
import tempfile

import pytest
import torch
from parity import ADAMW, assert_parity, spawn_world, train_next_to_reference
from test_mesh_runtime import MODELS as MESH_MODELS
from test_pipeline import MODELS as PIPELINE_MODELS

from shardplan.plan import Checkpoint, Plan, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

STEPS = 2
WORLD = 4

MODELS = {**MESH_MODELS, "gpt2-tied": PIPELINE_MODELS["gpt2-tied"]}
"""Per model: its builder (batch size → zoo entry) and its units; GPT-2's head is tied to its embedding,
which at pp 2 sit on different stages."""

CASES = {
    # the second step takes 2 samples a replica where 4 were planned (an epoch's last batch)
    "gpt_dp2_pp2_1f1b_smaller": {
        "model": "gpt",
        "mesh": dict(dp=2, pp=2),
        "schedule": "1f1b",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD,),
        "clip": 0.05,
        "replica_batches": (4, 2),
    },
    # checkpointed units recompute inside their FSDP2 group's forward, gathered by its pre-backward hook
    "llama_dp2_pp2_gpipe": {
        "model": "llama",
        "mesh": dict(dp=2, pp=2),
        "schedule": "gpipe",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
        "checkpoints": (Checkpoint.SELECTIVE, Checkpoint.FULL),
        "clip": 0.05,
    },
    # sequence parallel norms see half the tokens: their gradients are summed over tp after FSDP2 reduces them
    "gpt_tp2_pp2_sp_vocab": {
        "model": "gpt",
        "mesh": dict(dp=1, tp=2, pp=2, sequence_parallel=True, vocab_parallel=True),
        "schedule": "1f1b",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD,),
        "clip": 0.05,
    },
    "llama_tp2_pp2_sp_vocab": {
        "model": "llama",
        "mesh": dict(dp=1, tp=2, pp=2, sequence_parallel=True, vocab_parallel=True),
        "schedule": "1f1b",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD,),
        "clip": 0.05,
    },
    # the head's stage holds a copy of the embedding's unit, in the head's FSDP2 group
    "gpt2-tied_dp2_pp2": {
        "model": "gpt2-tied",
        "mesh": dict(dp=2, pp=2),
        "schedule": "1f1b",
        "micro_batches": 2,
        "strategies": (ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
        "clip": 0.05,
    },
    "gpt_hsdp2_pp2": {
        "model": "gpt",
        "mesh": dict(dp=1, dp_replicate=2, pp=2),
        "schedule": "gpipe",
        "micro_batches": 2,
        "strategies": (ShardStrategy.SHARD_GRAD_OP,),
        "clip": 0.05,
    },
}


def _batches(model: str, replicas: int, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """A whole batch of `replicas` × size samples for each step."""
    entry = MODELS[model][0](1)
    seq, vocab = entry.args[0].shape[1], entry.model.config.vocab_size
    return [
        torch.randint(
            0, vocab, (size * replicas, seq), generator=torch.Generator().manual_seed(step)
        )
        for step, size in enumerate(sizes)
    ]


def _plan(model: str, mesh: dict, replica_batch: int = 4, **options) -> str:
    """The model's plan for `mesh` at `replica_batch` samples a replica, as JSON."""
    build, units = MODELS[model]
    replicas = mesh["dp"] * mesh.get("dp_replicate", 1)
    example = _batches(model, replicas, (replica_batch,))[0].chunk(replicas)[0]
    return manual_plan(
        build(replica_batch).model,
        units,
        example_inputs=(example,),
        example_kwargs={"labels": example},
        **mesh,
        **options,
    ).to_json()


def _program(model: str, plan_json: str, backend: str = "fsdp2", replica_batch: int = 4):
    """(a copy of the model trained from seed 0 under the plan `plan_json`, the plain model) of
    `replica_batch`."""
    build, _ = MODELS[model]
    torch.manual_seed(0)
    reference = build(replica_batch).model
    copied = copy.deepcopy(reference)
    return parallelize(copied, Plan.from_json(plan_json), backend=backend), reference


def case_plan(case: dict) -> str:
    return _plan(
        case["model"],
        case["mesh"],
        strategies=case["strategies"],
        checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
        micro_batches=case["micro_batches"],
        schedule=case["schedule"],
    )


def run_case(rank: int, case: dict, plan_json: str) -> dict:
    """Train the case's model on its mesh next to one process on the whole batch (see train_next_to_reference)."""
    program, reference = _program(case["model"], plan_json)
    replicas, replica = program.plan.mesh.dp, program.plan.mesh.replica_of(rank)
    batches = _batches(case["model"], replicas, case.get("replica_batches", (4,) * STEPS))
    return train_next_to_reference(
        program,
        reference,
        [(ids.chunk(replicas)[replica], ids) for ids in batches],
        clip=case.get("clip"),
    )


def resume_plans() -> dict[str, str]:
    """resume_across_backends' plans of GPT, as JSON: dp 2 × pp 2 (1F1B) at 4 samples a replica, dp 4 at 2."""
    return {
        "dp2_pp2": _plan(
            "gpt",
            dict(dp=2, pp=2),
            4,
            micro_batches=2,
            schedule="1f1b",
            strategies=(ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
        ),
        "dp4": _plan("gpt", dict(dp=4), 2),
    }


def resume_across_backends(rank: int, directory: str, plans: dict[str, str]) -> dict:
    """GPT on fsdp2 dp 2 × pp 2 steps, saves, and steps twice more; backend "shardplan" at dp 4 loads that
    checkpoint and takes the first of them; fsdp2 dp 2 × pp 2 loads what it saved and takes the second:
    each must give the loss of the unbroken run. `plans`: resume_plans'."""
    batches = _batches("gpt", 4, (2, 2, 2))

    def train(program, optimizer, steps: list[torch.Tensor]) -> list[float]:
        losses = []
        for ids in steps:
            mine = ids.chunk(program.plan.mesh.dp)[program.plan.mesh.replica_of(rank)]
            losses.append(float(program.step(mine, labels=mine)))
            optimizer.step()
            optimizer.zero_grad()
        return losses

    def start(backend: str, plan: str, replica_batch: int):
        program, _ = _program("gpt", plans[plan], backend, replica_batch)
        return program, torch.optim.AdamW(program.parameters(), **ADAMW)

    program, optimizer = start("fsdp2", "dp2_pp2", 4)
    train(program, optimizer, batches[:1])
    program.save(f"{directory}/fsdp2", optimizer)
    unbroken = train(program, optimizer, batches[1:])
    program, optimizer = start("shardplan", "dp4", 2)
    program.load(f"{directory}/fsdp2", optimizer)
    resumed = train(program, optimizer, batches[1:2])
    program.save(f"{directory}/shardplan", optimizer)
    program, optimizer = start("fsdp2", "dp2_pp2", 4)
    program.load(f"{directory}/shardplan", optimizer)
    resumed += train(program, optimizer, batches[2:])
    return {"unbroken": unbroken, "resumed": resumed}


def run_world(rank: int, world: int, directory: str, plans: dict) -> dict:
    return {
        "cases": {name: run_case(rank, case, plans["cases"][name]) for name, case in CASES.items()},
        "resume": resume_across_backends(rank, directory, plans["resume"]),
    }


@pytest.fixture(scope="module")
def results():
    plans = {
        "cases": {name: case_plan(case) for name, case in CASES.items()},
        "resume": resume_plans(),
    }
    with tempfile.TemporaryDirectory() as directory:
        return spawn_world(WORLD, run_world, (directory, plans))


def test_fsdp2_pipelines_train_like_one_process(results):
    assert_parity(results["cases"], CASES)


def test_a_checkpoint_of_an_fsdp2_pipeline_resumes_on_the_other_backend_and_back(results):
    resume = results["resume"]
    assert max(abs(a - b) for a, b in zip(resume["resumed"], resume["unbroken"])) <= 1e-5, resume
