"""AdaScale's convergence on CPU: steps to a target loss at batch B, and at 4B without retuning.

    .venv/bin/python benchmarks/bench_adascale.py            # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_adascale.py --seed 1   # another chain

A small zoo GPT learns a fixed random Markov chain: each token is followed by one of 4 tokens,
drawn once per vocabulary entry, equally likely, so the best possible loss is ln 4. At the base
batch (2 walks of 8 tokens) the gradient is mostly noise: the regime where a bigger batch helps
and AdaScale's gain nears its scale. Every run starts from the same model and data stream and
trains with SGD (momentum 0.9, a constant learning rate) on 2 gloo ranks (dp 2, every unit
FULL_SHARD) until the loss on fixed held-out walks, which rank 0 evaluates on the exported
model every few steps, first reads at or below the target. First a sweep of learning rates at
batch B picks the fastest (the "tuned" one); then, at 4B, that learning rate under
AdaScale(scale=4) (2 replicas × 2 micro-batches of B: the 4 samples its estimators compare), that
learning rate without it, and 4× it (the linear scaling rule). Step counts, not times: the
machine's load does not change them (docs/benchmarks.md, "AdaScale convergence").
"""

import argparse
import math
from dataclasses import dataclass

import torch
from rich.console import Console
from rich.table import Table

from shardplan import AdaScale, manual_plan, parallelize
from shardplan.models import zoo
from shardplan.runtime.collectives import broadcast_object, world
from shardplan.runtime.launch import run_world

CONFIG = zoo.GPTConfig(vocab_size=64, seq_len=8, n_layer=1, n_head=2, d_model=32)
SUCCESSORS = 4
"""Tokens that may follow each token, equally likely: the best possible loss is ln SUCCESSORS."""
SCALE = 4
DP = 2
EVAL_SEQUENCES = 512


@dataclass(frozen=True, slots=True)
class Task:
    """The Markov chain, the held-out set, the loss to reach and how long to try."""

    successors: torch.Tensor
    held_out: torch.Tensor
    target: float
    max_steps: int
    eval_every: int
    momentum: float
    """SGD's, in every run."""


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    batch: int
    """Sequences a step, over both ranks."""
    lr: float
    adascale: bool = False
    micro_batches: int = 1


@dataclass(frozen=True, slots=True)
class Outcome:
    run: Run
    steps: int | None
    """Steps until the held-out loss first read ≤ the target (checked every eval_every); None if never."""
    loss: float
    """The held-out loss when it stopped."""
    gain: float | None
    """AdaScale's mean gain over the steps taken (its progress / steps)."""
    diverged: bool


def markov_chain(seed: int) -> torch.Tensor:
    """[vocab, SUCCESSORS]: the tokens that may follow each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack(
        [
            torch.randperm(CONFIG.vocab_size, generator=generator)[:SUCCESSORS]
            for _ in range(CONFIG.vocab_size)
        ]
    )


def sequences(successors: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """[count, seq_len + 1] walks on the chain from uniformly drawn first tokens."""
    token = torch.randint(0, CONFIG.vocab_size, (count,), generator=generator)
    walk = [token]
    for _ in range(CONFIG.seq_len):
        token = successors[token, torch.randint(0, SUCCESSORS, (count,), generator=generator)]
        walk.append(token)
    return torch.stack(walk, dim=1)


def _train_rank(device, report, task: Task, runs: list[Run]) -> list[Outcome]:
    outcomes = []
    for run in runs:
        outcomes.append(_train(task, run))
        report(f"{run.name} at lr {run.lr:g}: {outcomes[-1].steps or '-'} steps")
    return outcomes


def _train(task: Task, run: Run) -> Outcome:
    rank = world().rank
    torch.manual_seed(0)  # every run from the same initial model
    model = zoo.GPT(CONFIG)
    reference = zoo.GPT(CONFIG)  # rank 0 evaluates the exported state on it
    example = torch.zeros(run.batch // DP, CONFIG.seq_len, dtype=torch.long)
    plan = manual_plan(
        model,
        zoo.gpt_units(CONFIG.n_layer),
        dp=DP,
        micro_batches=run.micro_batches,
        example_inputs=(example,),
        example_kwargs={"labels": example},
    )
    program = parallelize(model, plan)
    optimizer = torch.optim.SGD(program.parameters(), lr=run.lr, momentum=task.momentum)
    stepper = AdaScale(optimizer, program, scale=SCALE) if run.adascale else optimizer
    generator = torch.Generator().manual_seed(1)  # every run sees the same stream of data
    loss, step, reached, diverged = math.inf, 0, False, False
    while step < task.max_steps and not (reached or diverged):
        step += 1
        walks = sequences(task.successors, run.batch, generator).chunk(DP)[rank]
        program.step(walks[:, :-1].contiguous(), labels=walks[:, 1:].contiguous())
        stepper.step()
        stepper.zero_grad()
        if step % task.eval_every == 0:
            loss = broadcast_object(_held_out_loss(program, reference, task.held_out))
            diverged = not loss < 2 * math.log(
                CONFIG.vocab_size
            )  # NaN, or far above where it started
            reached = loss <= task.target
    return Outcome(
        run,
        step if reached else None,
        loss,
        stepper.progress / step if run.adascale else None,
        diverged,
    )


def _held_out_loss(program, reference: torch.nn.Module, held_out: torch.Tensor) -> float | None:
    """The loss of the trained model on the held-out walks, on rank 0 (None elsewhere)."""
    state = program.export_full_state_dict()
    if not state:
        return None
    reference.load_state_dict(state)
    with torch.no_grad():
        return float(reference(held_out[:, :-1], labels=held_out[:, 1:]))


def train(
    task: Task, runs: list[Run], description: str = "", progress: bool = False
) -> list[Outcome]:
    """Each of `runs` trained to the target on DP gloo ranks; a bar advances a run at a time when `progress`."""
    return run_world(
        _train_rank,
        (task, runs),
        world_size=DP,
        backend="gloo",
        total_steps=len(runs),
        progress=progress,
        description=description,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", type=int, default=2, help="the base batch B, in sequences (even)"
    )
    parser.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[0.01, 0.02, 0.04, 0.08, 0.16],
        help="the learning rates swept at batch B",
    )
    parser.add_argument(
        "--margin", type=float, default=0.6, help="the target: ln 4 + margin, in nats"
    )
    parser.add_argument("--max-steps", type=int, default=2000)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0, help="draws the Markov chain")
    args = parser.parse_args()
    successors = markov_chain(args.seed)
    held_out = sequences(
        successors, EVAL_SEQUENCES, torch.Generator().manual_seed(args.seed + 1000)
    )
    task = Task(
        successors,
        held_out,
        math.log(SUCCESSORS) + args.margin,
        args.max_steps,
        args.eval_every,
        args.momentum,
    )

    sweep = train(
        task, [Run("SGD", args.batch, lr) for lr in args.lrs], f"batch {args.batch}, lr sweep", True
    )
    reached = [outcome for outcome in sweep if outcome.steps is not None]
    if not reached:
        raise SystemExit(
            f"no learning rate in {args.lrs} reached the target {task.target:.3f} in "
            f"{args.max_steps} steps at batch {args.batch}: raise --max-steps or --margin"
        )
    tuned = min(reached, key=lambda outcome: outcome.steps)
    lr, big = tuned.run.lr, SCALE * args.batch
    scaled = train(
        task,
        [
            Run(
                f"SGD + AdaScale(scale={SCALE})", big, lr, adascale=True, micro_batches=SCALE // DP
            ),
            Run("SGD, B's lr", big, lr),
            Run(f"SGD, {SCALE}x B's lr (linear scaling)", big, SCALE * lr),
        ],
        f"batch {big}",
        True,
    )
    _print(task, sweep, tuned, scaled)


def _print(task: Task, sweep: list[Outcome], tuned: Outcome, scaled: list[Outcome]) -> None:
    console = Console(width=110)  # one line a row, in a log too
    console.print(
        f"target held-out loss {task.target:.4f} (ln {SUCCESSORS} = {math.log(SUCCESSORS):.4f} is the "
        f"best possible), checked every {task.eval_every} steps, at most {task.max_steps} steps"
    )
    table = Table(title="AdaScale convergence: steps to the target loss")
    for column in (
        "run",
        "batch",
        "lr",
        "steps",
        "steps / tuned B's",
        "mean gain",
        "held-out loss",
    ):
        table.add_column(column, justify="left" if column == "run" else "right")
    for outcome in [*sweep, *scaled]:
        steps = (
            "diverged" if outcome.diverged else "-" if outcome.steps is None else str(outcome.steps)
        )
        ratio = "-" if outcome.steps is None else f"{outcome.steps / tuned.steps:.2f}"
        gain = "-" if outcome.gain is None else f"{outcome.gain:.2f}"
        name = outcome.run.name + (" (tuned)" if outcome is tuned else "")
        table.add_row(
            name,
            str(outcome.run.batch),
            f"{outcome.run.lr:g}",
            steps,
            ratio,
            gain,
            f"{outcome.loss:.4f}",
        )
    console.print(table)


if __name__ == "__main__":
    main()
