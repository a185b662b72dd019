"""Hugging Face `transformers.Trainer` training a shardplan program (ShardplanTrainer) on 2 gloo ranks, next
to the same Trainer run on one process without shardplan: the same loss and gradient norm every step
(gradient accumulation, padded batches whose token counts differ across ranks, clipping), and the same
weights in what `save_model` writes, loaded back by `from_pretrained`.

The ranks are launched as torchrun launches them (RANK, WORLD_SIZE, LOCAL_RANK in their environment),
which is how Trainer and Accelerate find the world.
"""

import concurrent.futures
import multiprocessing
import os

import pytest
import torch
from parity import spawn_world

from shardplan.errors import ShardplanError
from shardplan.models import zoo
from shardplan.plan import ShardStrategy
from shardplan.runtime import parallelize
from shardplan.runtime.manual import manual_plan

pytest.importorskip("accelerate")  # Trainer needs it

TOLERANCE = 1e-5
WORLD = 2
BATCH = 2
"""Samples per replica per micro-batch under dp = 2; the one process and the tp case read 2 × BATCH."""
ACCUMULATE = 2
STEPS = 4
SEQUENCE = 16
VOCAB = 128
UNITS = [
    ("model.embed_tokens",),
    ("model.layers.0",),
    ("model.layers.1",),
    ("model.norm", "lm_head"),
]
CASES = {
    "dp2_full_shard": dict(dp=2, tp=1),
    "tp2": dict(dp=1, tp=2),
}
"""Both read the one process's global batch: dp = 2 replicas of BATCH samples, or one replica of
2 × BATCH samples whose 2 tp ranks read the same ones."""


def _model():
    torch.manual_seed(0)
    return zoo.hf_llama(
        n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=VOCAB, batch=BATCH, seq=SEQUENCE
    )


def _dataset() -> list[dict]:
    """Sequences of random lengths, right-padded to SEQUENCE: ranks hold different token counts."""
    generator = torch.Generator().manual_seed(7)
    samples = []
    for _ in range(WORLD * BATCH * ACCUMULATE * STEPS):
        ids = torch.randint(1, VOCAB, (SEQUENCE,), generator=generator)
        length = int(torch.randint(SEQUENCE // 4, SEQUENCE + 1, (), generator=generator))
        mask = torch.arange(SEQUENCE) < length
        samples.append(
            {
                "input_ids": ids.masked_fill(~mask, 0),
                "attention_mask": mask.long(),
                "labels": ids.masked_fill(~mask, -100),
            }
        )
    return samples


def _arguments(output_dir: str, batch: int, **overrides):
    from transformers import TrainingArguments

    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**options, **overrides})


def _steps(log_history: list[dict]) -> list[tuple[float, float]]:
    """(loss, gradient norm) of every step Trainer logged."""
    return [(entry["loss"], entry["grad_norm"]) for entry in log_history if "loss" in entry]


def _reference(output_dir: str) -> list[tuple[float, float]]:
    """The plain Trainer on one process, reading each step's batches of both replicas."""
    from transformers import Trainer

    torch.set_num_threads(1)
    trainer = Trainer(
        model=_model().model,
        args=_arguments(output_dir, WORLD * BATCH),
        train_dataset=_dataset(),
    )
    trainer.train()
    trainer.save_model(output_dir)
    return _steps(trainer.state.log_history)


def _as_torchrun(rank: int, world: int) -> None:
    """The environment torchrun gives a rank, which Trainer and Accelerate read the world from; the
    process group is already initialized, so they join it."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        OMP_NUM_THREADS="1",  # as torchrun sets it; else Accelerate picks threads per rank
    )


def _rank_job(rank: int, world: int, output_root: str) -> dict:
    from shardplan.integrations.hf_trainer import ShardplanTrainer

    _as_torchrun(rank, world)
    found: dict = {}
    for name, mesh in CASES.items():
        entry = _model()
        plan = manual_plan(
            entry.model,
            UNITS,
            strategies=(ShardStrategy.FULL_SHARD,),
            example_kwargs=_dataset_batch(),
            **mesh,
        )
        program = parallelize(entry.model, plan)
        output_dir = os.path.join(output_root, name)
        trainer = ShardplanTrainer(
            program,
            args=_arguments(output_dir, WORLD * BATCH // mesh["dp"]),
            train_dataset=_dataset(),
        )
        trainer.train()
        trainer.save_model(output_dir)
        found[name] = _steps(trainer.state.log_history)
    found["refusals"] = _refusals(program, output_root)
    return found


def _dataset_batch() -> dict:
    return {
        key: torch.stack([sample[key] for sample in _dataset()[:BATCH]]) for key in _dataset()[0]
    }


def _refusals(program, output_root: str) -> dict:
    """What ShardplanTrainer refuses, each in one line, on a program it could otherwise train."""
    from shardplan.integrations.hf_trainer import ShardplanTrainer

    refused = {}
    for name, overrides in {
        "checkpoints": dict(save_strategy="steps"),
        "weight_decay": dict(weight_decay=0.1),
    }.items():
        try:
            trainer = ShardplanTrainer(
                program,
                args=_arguments(output_root, BATCH, **overrides),
                train_dataset=_dataset(),
            )
            trainer.create_optimizer()
        except ShardplanError as error:
            refused[name] = str(error)
    return refused


def _weights(directory: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_trainer_trains_a_program_as_one_process_trains_the_model(tmp_path):
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        reference_run = pool.submit(_reference, str(tmp_path / "reference"))
        found = spawn_world(WORLD, _rank_job, (str(tmp_path),))
        reference = reference_run.result()

    assert len(reference) == STEPS
    expected = _weights(str(tmp_path / "reference"))
    for name in CASES:
        assert len(found[name]) == STEPS, name
        loss_error = max(abs(mine[0] - theirs[0]) for mine, theirs in zip(found[name], reference))
        norm_error = max(
            abs(mine[1] - theirs[1]) / theirs[1] for mine, theirs in zip(found[name], reference)
        )
        weights = _weights(str(tmp_path / name))
        assert weights.keys() == expected.keys(), name
        weight_error = max((weights[key] - expected[key]).abs().max().item() for key in expected)
        assert max(loss_error, norm_error, weight_error) <= TOLERANCE, (
            name,
            loss_error,
            norm_error,
            weight_error,
        )
    assert "save_strategy='no'" in found["refusals"]["checkpoints"]
    assert "weight_decay=0" in found["refusals"]["weight_decay"]
