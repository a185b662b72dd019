"""backend="fsdp2" with pp > 1: this rank's stage under fully_shard, run by a pipeline schedule, trains
exactly like one process on the whole batch.

One spawned world of 4 ranks runs every case (dp 2 × pp 2 with 1F1B on the zoo GPT, GPipe on a tiny
Hugging Face LLaMA, HSDP inside the stages), a checkpoint saved there and resumed on backend
"shardplan", and the refusals; rank 0 returns one record per case and the tests read them.
"""
import copy

import pytest
import torch

from shardplan import zoo
from shardplan.plan import Checkpoint, ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

from parity import assert_parity, spawn_world, train_next_to_reference

STEPS = 2
WORLD = 4

MODELS = {
    "gpt": (lambda batch: zoo.gpt(zoo.GPTConfig(n_layer=2), batch=batch),
            [("wte", "wpe"), ("h.0",), ("h.1",), ("ln_f", "lm_head")]),
    "llama": (lambda batch: zoo.hf_llama(n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=128,
                                         batch=batch, seq=16),
              [("model.embed_tokens",), ("model.layers.0",), ("model.layers.1",), ("model.norm", "lm_head")]),
}
"""Per model: its builder (batch size → zoo entry) and its units."""

CASES = {
    "gpt_dp2_pp2_1f1b": {"model": "gpt", "mesh": dict(dp=2, pp=2), "schedule": "1f1b", "micro_batches": 2,
                         "strategies": (ShardStrategy.FULL_SHARD,), "clip": 0.05},
    "llama_dp2_pp2_gpipe": {"model": "llama", "mesh": dict(dp=2, pp=2), "schedule": "gpipe", "micro_batches": 2,
                            "strategies": (ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_GRAD_OP),
                            "checkpoints": (Checkpoint.FULL, Checkpoint.NONE), "clip": 0.05},
    "gpt_tp2_pp2_1f1b": {"model": "gpt", "mesh": dict(dp=1, tp=2, pp=2), "schedule": "1f1b", "micro_batches": 2,
                         "strategies": (ShardStrategy.FULL_SHARD,), "clip": 0.05},
    # sequence parallel norms see half the tokens: their gradients are summed over tp after FSDP2 reduces them
    "llama_tp2_pp2_sp_vocab": {"model": "llama", "mesh": dict(dp=1, tp=2, pp=2, sequence_parallel=True,
                                                              vocab_parallel=True),
                               "schedule": "gpipe", "micro_batches": 2, "strategies": (ShardStrategy.FULL_SHARD,),
                               "clip": 0.05},
    "gpt_hsdp2_pp2": {"model": "gpt", "mesh": dict(dp=1, dp_replicate=2, pp=2), "schedule": "1f1b",
                      "micro_batches": 2, "strategies": (ShardStrategy.FULL_SHARD,), "clip": 0.05},
}


def run_case(rank: int, case: dict) -> dict:
    """Train the case's model on its mesh next to one process on the whole batch (see train_next_to_reference)."""
    build, units = MODELS[case["model"]]
    torch.manual_seed(0)
    entry = build(4)
    reference, model = entry.model, copy.deepcopy(entry.model)
    replicas = case["mesh"]["dp"] * case["mesh"].get("dp_replicate", 1)
    batch, seq = entry.args[0].shape
    batches = [torch.randint(0, reference.config.vocab_size, (batch * replicas, seq),
                             generator=torch.Generator().manual_seed(step)) for step in range(STEPS)]
    example = batches[0].chunk(replicas)[0]
    plan = manual_plan(model, units, example_inputs=(example,), example_kwargs={"labels": example}, **case["mesh"],
                       strategies=case["strategies"], checkpoints=case.get("checkpoints", (Checkpoint.NONE,)),
                       micro_batches=case["micro_batches"], schedule=case["schedule"])
    program = parallelize(model, plan, backend="fsdp2")
    replica = plan.mesh.replica_of(rank)
    return train_next_to_reference(program, reference, [(ids.chunk(replicas)[replica], ids) for ids in batches],
                                   clip=case.get("clip"))


def run_world(rank: int, world: int) -> dict:
    return {"cases": {name: run_case(rank, case) for name, case in CASES.items()}}


@pytest.fixture(scope="module")
def results():
    return spawn_world(WORLD, run_world, ())


def test_fsdp2_pipelines_train_like_one_process(results):
    print(results)
    assert_parity(results["cases"], CASES)
