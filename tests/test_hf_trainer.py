"""Hugging Face `transformers.Trainer` training a shardplan program (ShardplanTrainer) on 2 gloo ranks, next
to the same Trainer run on one process without shardplan: the same loss and gradient norm every step
(gradient accumulation through the program's sync switch, padded batches whose token counts differ
across ranks, clipping), the same evaluation loss, and the same weights in what `save_model` writes,
loaded back by `from_pretrained`. Under FULL_SHARD over 2 replicas on both backends, under tp = 2,
and resumed from a Trainer checkpoint of the sharded run. Then an Accelerate loop of one's own on
ProgramModule next to the same loop on one process, and everything ShardplanTrainer refuses.

The ranks are launched as torchrun launches them (RANK, WORLD_SIZE, LOCAL_RANK in their environment),
which is how Trainer and Accelerate find the world. One spawned world runs every case, beside one
process running the references.
"""

import concurrent.futures
import copy
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from parity import spawn_world

from shardplan.common.forkserver import forkserver_context
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
CHECKPOINT = f"checkpoint-{STEPS // 2}"
"""The sharded dp run's checkpoint halfway, from which another run resumes."""
ACCELERATE_WEIGHTS = "accelerate_loop.pt"
"""Where each Accelerate loop leaves the weights it trained (the one process's beside its Trainer's)."""
CASES = {
    "dp2_full_shard": dict(mesh=dict(dp=2, tp=1), save_strategy="steps", save_steps=STEPS // 2),
    "dp2_resumed": dict(mesh=dict(dp=2, tp=1), resume_from=f"dp2_full_shard/{CHECKPOINT}"),
    "dp2_fsdp2": dict(mesh=dict(dp=2, tp=1), backend="fsdp2"),
    "tp2": dict(mesh=dict(dp=1, tp=2)),
}
"""Each reads the one process's global batch: dp = 2 replicas of BATCH samples, or one replica of
2 × BATCH samples whose 2 tp ranks read the same ones. Run in this order: the resumed run starts
from the first one's checkpoint."""


def _model():
    torch.manual_seed(0)
    return zoo.hf_llama(
        n_layer=2, d_model=64, ffn=128, heads=4, kv_heads=2, vocab=VOCAB, batch=BATCH, seq=SEQUENCE
    )


def _dataset(
    samples: int = WORLD * BATCH * ACCUMULATE * STEPS, seed: int = 7, shortest: int = SEQUENCE // 4
) -> list[dict]:
    """Sequences of random lengths from `shortest`, right-padded to SEQUENCE: ranks hold different
    token counts."""
    generator = torch.Generator().manual_seed(seed)
    found = []
    for _ in range(samples):
        ids = torch.randint(1, VOCAB, (SEQUENCE,), generator=generator)
        length = int(torch.randint(shortest, SEQUENCE + 1, (), generator=generator))
        mask = torch.arange(SEQUENCE) < length
        found.append(
            {
                "input_ids": ids.masked_fill(~mask, 0),
                "attention_mask": mask.long(),
                "labels": ids.masked_fill(~mask, -100),
            }
        )
    return found


def _evaluation_dataset() -> list[dict]:
    return _dataset(samples=WORLD * BATCH * 2, seed=8)


def _arguments(output_dir: str, batch: int, **overrides):
    from transformers import TrainingArguments

    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch,  # a replica's share: Trainer averages over all ranks' tokens
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


def _step_counter():
    """A callback counting the optimizer steps this run takes (a resumed run takes only the rest)."""
    from transformers import TrainerCallback

    class StepCounter(TrainerCallback):
        taken = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.taken += 1

    return StepCounter()


def _results(trainer, counter) -> dict:
    """(loss, gradient norm) of every step in Trainer's log, the steps this run took, and the
    evaluation loss."""
    found = {
        "taken": counter.taken,
        "steps": [
            (entry["loss"], entry["grad_norm"])
            for entry in trainer.state.log_history
            if "loss" in entry
        ],
    }
    if trainer.eval_dataset is not None:
        found["eval_loss"] = trainer.evaluate()["eval_loss"]
    return found


def _reference(output_dir: str) -> dict:
    """The plain Trainer on one process, reading each step's batches of both replicas."""
    from transformers import Trainer

    torch.set_num_threads(1)
    counter = _step_counter()
    trainer = Trainer(
        model=_model().model,
        args=_arguments(output_dir, WORLD * BATCH),
        train_dataset=_dataset(),
        eval_dataset=_evaluation_dataset(),
        callbacks=[counter],
    )
    trainer.train()
    trainer.save_model(output_dir)
    found = _results(trainer, counter)
    model = _model().model
    found["accelerate_losses"] = _accelerate_loop(model, model.parameters(), WORLD * BATCH)
    torch.save(model.state_dict(), os.path.join(output_dir, ACCELERATE_WEIGHTS))
    return found


def _accelerate_loop(model, parameters, batch: int) -> list[float]:
    """A training loop of one's own under Accelerate, with accumulation; each micro-batch's loss,
    averaged over the ranks. Every sequence is whole: each rank's mean loss weighs as much as its
    tokens, as in one process's mean over the whole batch."""
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE)
    optimizer = accelerator.prepare(torch.optim.AdamW(parameters, lr=1e-3))
    loader = accelerator.prepare(
        torch.utils.data.DataLoader(_dataset(seed=9, shortest=SEQUENCE), batch_size=batch)
    )
    losses = []
    for inputs in loader:
        with accelerator.accumulate(model):
            loss = model(**inputs).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()).mean().item())
    return losses


def _recording_sync(program) -> list[bool]:
    """Every flag given to the program's gradient-sync switch, in order."""
    switched: list[bool] = []
    switch = program.set_requires_gradient_sync

    def recording(flag: bool) -> None:
        switched.append(flag)
        switch(flag)

    program.set_requires_gradient_sync = recording
    return switched


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


def _program(mesh: dict, backend: str = "shardplan"):
    entry = _model()
    plan = manual_plan(
        entry.model,
        UNITS,
        strategies=(ShardStrategy.FULL_SHARD,),
        example_kwargs={
            key: torch.stack([s[key] for s in _dataset(BATCH)]) for key in _dataset(1)[0]
        },
        **mesh,
    )
    return parallelize(entry.model, plan, backend=backend)


def _dataset_batch(samples: int) -> dict:
    """The dataset's first samples as one batch (what a plan is made for)."""
    found = _dataset(samples)
    return {key: torch.stack([sample[key] for sample in found]) for key in found[0]}


def _rank_job(rank: int, world: int, output_root: str) -> dict:
    from shardplan.integrations.hf_trainer import ShardplanTrainer

    _as_torchrun(rank, world)
    found: dict = {}
    for name, case in CASES.items():
        mesh = case["mesh"]
        program = _program(mesh, case.get("backend", "shardplan"))
        output_dir = os.path.join(output_root, name)
        saving = {key: case[key] for key in ("save_strategy", "save_steps") if key in case}
        counter = _step_counter()
        switched = _recording_sync(program)
        trainer = ShardplanTrainer(
            program,
            args=_arguments(output_dir, WORLD * BATCH // mesh["dp"], **saving),
            train_dataset=_dataset(),
            eval_dataset=_evaluation_dataset() if mesh["tp"] == 1 else None,
            callbacks=[counter],
        )
        resume_from = case.get("resume_from")
        trainer.train(resume_from_checkpoint=resume_from and os.path.join(output_root, resume_from))
        trainer.save_model(output_dir)
        found[name] = {**_results(trainer, counter), "switched": switched}
    found["accelerate"] = _accelerate_program(output_root)
    found["refusals"] = _refusals(program, output_root)  # last: it leaves Accelerate single-process
    return found


def _accelerate_program(output_root: str) -> dict:
    """The Accelerate loop on a FULL_SHARD program over 2 replicas, as ProgramModule: its losses and
    sync switches; rank 0 saves the weights it ends with."""
    from shardplan.integrations.hf_trainer import ProgramModule

    program = _program(dict(dp=2, tp=1))
    switched = _recording_sync(program)
    losses = _accelerate_loop(ProgramModule(program), program.parameters(), BATCH)
    state = program.export_full_state_dict()
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(output_root, ACCELERATE_WEIGHTS))
    return {"losses": losses, "switched": switched}


def _refusals(tp_program, output_root: str) -> dict:
    """What ShardplanTrainer refuses as it is built (or as it evaluates, or resumes), each in one
    line, on a program it could otherwise train (or its twin whose plan is pipelined)."""
    from shardplan.integrations.hf_trainer import ShardplanTrainer

    pipelined = copy.copy(tp_program)
    pipelined.plan = manual_plan(
        _model().model, UNITS, pp=2, dp=1, example_kwargs=_dataset_batch(BATCH)
    )
    cases = {
        "weight_decay": (tp_program, dict(weight_decay=0.1), {}),
        "tp_evaluation": (tp_program, dict(eval_strategy="steps"), {}),
        "best_model": (
            tp_program,
            dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"),
            {},
        ),
        "tp_batch_rebalance": (tp_program, dict(train_sampling_strategy="batch_rebalance"), {}),
        "bf16": (tp_program, dict(bf16=True), {}),
        "activation_checkpointing": (tp_program, dict(activation_checkpointing=True), {}),
        "torch_compile": (tp_program, dict(torch_compile=True), {}),
        "model": (tp_program, {}, dict(model=tp_program.module)),
        "pipeline": (pipelined, {}, {}),
    }
    refused = {}
    for name, (program, overrides, keywords) in cases.items():
        try:
            ShardplanTrainer(
                program,
                args=_arguments(output_root, BATCH, **overrides),
                train_dataset=_dataset(),
                **keywords,
            )
        except ShardplanError as error:
            refused[name] = str(error)
    trainer = ShardplanTrainer(
        tp_program, args=_arguments(output_root, BATCH), train_dataset=_dataset()
    )
    try:
        trainer.evaluate(_evaluation_dataset())
    except ShardplanError as error:
        refused["tp_evaluate"] = str(error)
    refused["model_only_checkpoint"] = _resume_model_only(tp_program, output_root)
    refused["without_torchrun"] = _launched_without_torchrun(tp_program, output_root)
    return refused


def _launched_without_torchrun(program, output_root: str) -> str | None:
    """A rank whose environment does not name the world (started by torch.multiprocessing alone):
    Trainer would see one process and read every sample on every rank. Accelerate keeps the world it
    saw first, so its state is reset, and left single-process."""
    from accelerate.state import AcceleratorState

    from shardplan.integrations.hf_trainer import ShardplanTrainer

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        del os.environ[name]
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        ShardplanTrainer(program, args=_arguments(output_root, BATCH), train_dataset=_dataset())
    except ShardplanError as error:
        return str(error)
    return None


def _resume_model_only(program, output_root: str) -> str | None:
    """Resume from a checkpoint of the dp run stripped of its program checkpoint, as
    save_only_model=True saves them: there is no optimizer state to resume."""
    from shardplan.integrations.hf_trainer import PROGRAM_CHECKPOINT, ShardplanTrainer

    stripped = os.path.join(output_root, "model_only", CHECKPOINT)
    if dist.get_rank() == 0:
        shutil.copytree(
            os.path.join(output_root, "dp2_full_shard", CHECKPOINT),
            stripped,
            ignore=shutil.ignore_patterns(PROGRAM_CHECKPOINT),
        )
    dist.barrier()
    trainer = ShardplanTrainer(
        program, args=_arguments(output_root, WORLD * BATCH), train_dataset=_dataset()
    )
    try:
        trainer.train(resume_from_checkpoint=stripped)
    except ShardplanError as error:
        return str(error)
    return None


def _weights(directory: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_trainer_trains_a_program_as_one_process_trains_the_model(tmp_path):
    context = forkserver_context()  # the ranks' (run_world): its server has imported transformers
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=context) as pool:
        reference_run = pool.submit(_reference, str(tmp_path / "reference"))
        found = spawn_world(WORLD, _rank_job, (str(tmp_path),))
        reference = reference_run.result()

    assert len(reference["steps"]) == STEPS
    expected = _weights(str(tmp_path / "reference"))
    errors = {}
    for name in CASES:
        steps = found[name]["steps"]
        assert len(steps) == STEPS, name
        taken = STEPS // 2 if "resume_from" in CASES[name] else STEPS
        assert found[name]["taken"] == taken, name
        assert found[name]["switched"] == [False, True] * taken, name  # accumulation, then sync
        weights = _weights(str(tmp_path / name))
        assert weights.keys() == expected.keys(), name
        errors[name] = {
            "loss": max(
                abs(mine[0] - theirs[0]) for mine, theirs in zip(steps, reference["steps"])
            ),
            "grad_norm": max(
                abs(mine[1] - theirs[1]) / theirs[1]
                for mine, theirs in zip(steps, reference["steps"])
            ),
            "weights": max((weights[key] - expected[key]).abs().max().item() for key in expected),
        }
        if "eval_loss" in found[name]:
            errors[name]["eval_loss"] = abs(found[name]["eval_loss"] - reference["eval_loss"])
    assert "eval_loss" in errors["dp2_full_shard"]
    assert all(error <= TOLERANCE for case in errors.values() for error in case.values()), errors
    assert (tmp_path / "dp2_full_shard" / CHECKPOINT / "shardplan").is_dir()
    accelerate = found["accelerate"]
    assert len(accelerate["losses"]) == ACCUMULATE * STEPS
    assert accelerate["switched"] == [False, True] * STEPS  # accelerator.accumulate's no_sync
    accelerate_loss_error = max(
        abs(mine - theirs)
        for mine, theirs in zip(accelerate["losses"], reference["accelerate_losses"])
    )
    expected = torch.load(tmp_path / "reference" / ACCELERATE_WEIGHTS)
    weights = torch.load(tmp_path / ACCELERATE_WEIGHTS)
    accelerate_weight_error = max(
        (weights[key] - expected[key]).abs().max().item() for key in expected
    )
    assert max(accelerate_loss_error, accelerate_weight_error) <= TOLERANCE, (
        accelerate_loss_error,
        accelerate_weight_error,
    )
    refusals = found["refusals"]
    assert "weight_decay=0" in refusals["weight_decay"]
    assert "tensor parallelism" in refusals["tp_evaluation"]
    assert "tensor parallelism" in refusals["tp_evaluate"]
    assert "program.load" in refusals["best_model"]
    assert "same ones" in refusals["tp_batch_rebalance"]
    assert "MixedPrecision" in refusals["bf16"]
    assert "recomputation" in refusals["activation_checkpointing"]
    assert "never prepared" in refusals["torch_compile"]
    assert "pass the program" in refusals["model"]
    assert "program.step" in refusals["pipeline"]
    assert "save_only_model=True" in refusals["model_only_checkpoint"]
    assert "launch with torchrun" in refusals["without_torchrun"]
