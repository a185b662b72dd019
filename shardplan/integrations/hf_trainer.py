"""ShardplanTrainer: Hugging Face `transformers.Trainer` training a shardplan Program.

>>> program = shardplan.parallelize(model, plan)                       # doctest: +SKIP
>>> trainer = ShardplanTrainer(program, args=args, train_dataset=data)  # doctest: +SKIP
>>> trainer.train(); trainer.save_model("out")                          # doctest: +SKIP

[Note: what Trainer is handed] Trainer keeps two models: `model`, the Hugging Face model it inspects
(its forward's signature, labels, config) and saves, and `model_wrapped`, what it calls, steps and
syncs (DDP(model) under torchrun). Here `model` is the program's module, whose parameters
parallelize replaced by placeholders, and `model_wrapped` a ProgramModule: calling it calls the
program, its parameters are the program's shards, and its `no_sync()` (which Accelerate's
`no_sync` calls, as on DDP) is the program's gradient-sync switch, so Trainer's gradient
accumulation holds back the reductions the plan lets wait. `_wrap_model` returns the ProgramModule,
so Accelerate prepares only the optimizer and the data: nothing wraps the program in DDP. The
optimizer is built over the shards, gradient norms and clipping are the program's global ones,
and `save_model` writes the full state dict that `export_full_state_dict` gathers, so
`from_pretrained` loads it. A checkpoint adds `program.save`'s folder (every rank's shards of the
parameters and optimizer state), from which a resumed run loads them: Trainer alone would save
rank 0's optimizer state and load weights into the placeholders.

[Note: the world Trainer sees] Trainer and Accelerate read the world from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK); under it they find torch.distributed already initialized and use
its default group. They shard the data by rank; the plan's data-parallel replicas are what must
read different samples, and the tp ranks of one replica the same ones, so the training data is
sharded by replica (Mesh.replica_of), which is the rank when tp is 1. Trainer's loss over the
accumulated batch divides by the tokens of every replica (`average_tokens_across_devices`,
counted once per replica through `get_tp_size`) and scales by the replicas, so with the program
averaging gradients over the replicas, the step's gradient and logged loss are one process's on
the whole batch.
"""

import contextlib
import math
import os
from typing import Any, Iterator, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from transformers import Trainer, TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import IntervalStrategy

from shardplan.errors import ShardplanError
from shardplan.runtime import Program

PROGRAM_CHECKPOINT = "shardplan"
"""The folder of a Trainer checkpoint that holds `program.save`'s: parameters and optimizer state."""


class ProgramModule(nn.Module):
    """The program as the module Trainer and Accelerate call and step: Trainer's `model_wrapped` (see
    [Note: what Trainer is handed]), or the module of an Accelerate loop, whose
    `accelerator.accumulate(module)` and `accelerator.no_sync(module)` reach the sync switch.

    >>> module = ProgramModule(program)  # then: with accelerator.accumulate(module): ...  # doctest: +SKIP
    """

    def __init__(self, program: Program):
        super().__init__()
        self.program = program  # a Program is no Module: its model's placeholders stay unregistered

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.program(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return iter(self.program.parameters())

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(
            (f"shard_{index}", shard) for index, shard in enumerate(self.program.parameters())
        )

    def train(self, mode: bool = True) -> "ProgramModule":
        self.program.train(mode)
        return super().train(mode)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's switch, which Accelerate's `no_sync` calls: backwards inside keep their gradients local."""
        self.program.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.program.set_requires_gradient_sync(True)


class ShardplanTrainer(Trainer):
    """`transformers.Trainer` training `program` (from `shardplan.parallelize`) on every rank under torchrun.

    Takes Trainer's arguments but `model` and `model_init`: the model is the program's. Its
    precision and recomputation are the plan's (`MixedPrecision`, checkpointing), so `fp16`,
    `bf16` and `activation_checkpointing` are refused, as are `torch_compile`,
    `load_best_model_at_end`, evaluation under tp > 1 and pipelined plans (pp > 1), whose
    micro-batches only `program.step` runs. A nonzero `weight_decay` is refused where Trainer
    would exempt biases and norms (see _check_weight_decay)."""

    def __init__(self, program: Program, args: TrainingArguments, **kwargs: Any):
        _check_arguments(program, args, kwargs)
        self.program = program
        self.program_module = ProgramModule(program)
        super().__init__(model=program.module, args=args, **kwargs)
        world = dist.get_world_size()  # parallelize ran, so the process group is up
        if self.accelerator.num_processes != world:
            raise ShardplanError(
                f"Trainer sees {self.accelerator.num_processes} process(es), torch.distributed "
                f"{world}: launch with torchrun, whose RANK, WORLD_SIZE and LOCAL_RANK Trainer "
                "reads, or set them on each rank before building TrainingArguments"
            )
        if self.optimizer is None:  # Trainer builds it from args; one passed in decays as it says
            self._check_weight_decay()

    def _wrap_model(
        self, model: nn.Module, training: bool = True, dataloader: Any = None
    ) -> nn.Module:
        return self.program_module  # never DDP: the program reduces its own gradients

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        """parallelize placed the shards; the module holds placeholders, which cannot move."""

    def get_tp_size(self) -> int:
        return self.program.plan.mesh.tp

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        mesh = self.program.plan.mesh
        if mesh.tp > 1:  # Accelerate shards by rank; a replica's tp ranks read the same samples
            _shard_by_replica(loader, replicas=mesh.dp, replica=mesh.replica_of(dist.get_rank()))
        return loader

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (`optim`, learning rate, betas...) over the program's shards."""
        if self.optimizer is None:
            optimizer_class, options = (
                self.optimizer_cls_and_kwargs
                or self.get_optimizer_cls_and_kwargs(self.args, cast(Any, self.program.module))
            )
            shards = [shard for shard in self.program.parameters() if shard.requires_grad]
            self.optimizer = optimizer_class(
                [{"params": shards, "weight_decay": self.args.weight_decay}], **options
            )
        return self.optimizer

    def _check_weight_decay(self) -> None:
        """Trainer exempts biases and norm weights from weight decay; a flat shard mixes them with the
        rest, so a decay that would have exempted some is refused rather than applied to them."""
        if not self.args.weight_decay:
            return
        decayed = set(self.get_decay_parameter_names(self.program.module))
        exempt = [name for name, _ in self.program.module.named_parameters() if name not in decayed]
        if exempt:
            raise ShardplanError(
                f"weight_decay={self.args.weight_decay}: Trainer exempts {len(exempt)} bias and "
                f"norm parameters (first: {exempt[:2]}), which share flat shards with decayed "
                "ones: pass weight_decay=0, or optimizers=(torch.optim.AdamW(program.parameters(), "
                "weight_decay=...), None) to decay every parameter"
            )

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return self.program.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        return self.program.clip_grad_norm_(math.inf) if grad_norm is None else grad_norm

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self.program.plan.mesh.tp > 1:
            raise ShardplanError(_TP_EVALUATION)
        return super().evaluation_loop(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as `save_pretrained` writes it, gathered from the shards (call on every rank)."""
        state = self.program.export_full_state_dict()  # every rank sends its shards to rank 0
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """A checkpoint's resumable state: the program's checkpoint, which every rank writes its
        shards of (Trainer alone would keep rank 0's optimizer state), and the scheduler's."""
        self.program.save(os.path.join(output_dir, PROGRAM_CHECKPOINT), self._torch_optimizer())
        if self.args.should_save:
            torch.save(self._scheduler().state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights are the program checkpoint's, loaded with the optimizer's state below."""

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = os.path.join(checkpoint, PROGRAM_CHECKPOINT)
        if not os.path.isdir(folder):
            raise ShardplanError(
                f"{checkpoint} holds no {PROGRAM_CHECKPOINT}/ folder (saved with "
                "save_only_model=True?): resume from a checkpoint ShardplanTrainer saved whole"
            )
        self.program.load(folder, self._torch_optimizer())
        self._scheduler().load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        )

    def _torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the program's shards, unwrapped from Accelerate's AcceleratedOptimizer."""
        return cast(torch.optim.Optimizer, getattr(self.optimizer, "optimizer", self.optimizer))

    def _scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        if (
            self.lr_scheduler is None
        ):  # Trainer creates it with the optimizer, before any checkpoint
            raise ShardplanError("no learning-rate scheduler yet: train() creates it")
        return self.lr_scheduler


def _check_arguments(program: Program, args: TrainingArguments, kwargs: dict[str, Any]) -> None:
    """Refuse what ShardplanTrainer cannot honour, before Trainer builds anything."""
    if "model" in kwargs or "model_init" in kwargs:
        raise ShardplanError(
            "ShardplanTrainer trains the program's model: pass the program, not model= or model_init="
        )
    if program.plan.mesh.pp > 1:
        raise ShardplanError(
            "a pipelined plan (pp > 1) runs its micro-batches inside program.step(...), which "
            "Trainer's loop never calls: train it with program.step, or plan with pp = 1"
        )
    if args.fp16 or args.bf16:
        raise ShardplanError(
            "fp16/bf16: the plan's precision applies (compile(..., mixed_precision="
            "MixedPrecision(param_dtype='bfloat16'))); leave Trainer's fp16 and bf16 off"
        )
    if args.activation_checkpointing:
        raise ShardplanError(
            "activation_checkpointing: the plan chooses recomputation per unit; leave it off"
        )
    if args.torch_compile:
        raise ShardplanError(
            "torch_compile: Trainer compiles the model it prepares, and the program is never "
            "prepared; leave it off"
        )
    if args.load_best_model_at_end:
        raise ShardplanError(
            "load_best_model_at_end: pass the best checkpoint's folder to program.load "
            f"(os.path.join(trainer.state.best_model_checkpoint, {PROGRAM_CHECKPOINT!r}))"
        )
    if program.plan.mesh.tp > 1 and args.eval_strategy != IntervalStrategy.NO:
        raise ShardplanError(_TP_EVALUATION)
    if program.plan.mesh.tp > 1 and args.train_sampling_strategy == "batch_rebalance":
        raise ShardplanError(
            "train_sampling_strategy='batch_rebalance' splits batches over every rank, where a "
            "replica's tp ranks must read the same ones: use 'random', 'sequential' or "
            "'group_by_length'"
        )


_TP_EVALUATION = (
    "evaluation under tensor parallelism: Trainer gives every rank its own evaluation samples, "
    "where a replica's tp ranks must read the same ones; evaluate with program(...) on each "
    "replica's batches, or with a plan of tp = 1"
)


def _shard_by_replica(loader: Any, replicas: int, replica: int) -> None:
    """Make Accelerate's per-rank view of the training data a per-replica one, as Trainer itself
    re-points it for its BatchRebalanceSampler."""
    batches = getattr(loader, "batch_sampler", None)
    shard: Any = batches if hasattr(batches, "process_index") else getattr(loader, "dataset", None)
    if not hasattr(shard, "process_index"):
        raise ShardplanError(
            f"cannot give the tp ranks of a replica the same samples from a {type(loader).__name__}: "
            "pass a map-style or iterable torch Dataset"
        )
    shard.num_processes, shard.process_index = replicas, replica
