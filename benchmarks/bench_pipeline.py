"""Pipeline plans on CPU: predicted vs measured step time, bubble and peak memory, for pp 2.

    .venv/bin/python benchmarks/bench_pipeline.py --profile profile.json   # from `shardplan calibrate -o`
    .venv/bin/python benchmarks/bench_pipeline.py                          # calibrates first (a few minutes)

The demo GPT (6 layers) on 2 CPU ranks (gloo) as two pipeline stages of four
units each, under GPipe and 1F1B with 1 to 8 micro-batches, then as four stages
of two units, two per rank, under interleaved 1F1B and the zero-bubble schedule
(ScheduleInterleavedZeroBubble, also at one stage per rank: ZB-H1); the pp=1 FSDP
plan of the same units beside them. Step time is the slowest rank's
(optimizer included); the measured bubble is the time the schedule spends
outside the busiest stage's forward and backward chunks (waiting for its
neighbour), on average per step; the predicted one is the cost model's
(pp - 1) x the stage's per-micro-batch time ((pp - 1) / v of the rank's with v stages per rank, less the
deferred weight gradients under the zero-bubble schedule). Memory is MemTracker's peak (every tensor on the
rank), its module hooks off: their multi-grad hooks refuse the autograd.grad of the zero-bubble schedule's
input-gradient pass, and the totals do not need them.
Beside each pipeline, the same two stages written by hand for
torch.distributed.pipelining (the model's code split in two modules): the
cost of cutting stages out of the graph instead, as a ratio.
"""

import argparse
import contextlib
import dataclasses
import statistics
import time
import warnings
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table
from torch.distributed._tools.mod_tracker import ModTracker

from shardplan import ShardStrategy, get_hardware
from shardplan.calibration.calibrate import calibrate
from shardplan.common.sizes import format_bytes
from shardplan.compile import evaluate
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.models.zoo import DEMO_BATCH, DEMO_GPT
from shardplan.plan import Schedule
from shardplan.runtime.launch import run_world
from shardplan.runtime.manual import manual_plan

GROUPS = zoo.gpt_units(DEMO_GPT.n_layer)
CONFIGURATIONS = (
    [(1, "none", 1, 1)]
    + [(2, "gpipe", m, 1) for m in (1, 2, 4, 8)]
    + [(2, "1f1b", m, 1) for m in (2, 4, 8)]
    + [(2, "interleaved_1f1b", m, 2) for m in (2, 4, 8)]
    + [(2, "zero_bubble", m, v) for v in (1, 2) for m in (4, 8)]
)
"""(pp, schedule, micro-batches, stages per rank); 1F1B over one micro-batch runs as GPipe, so it starts at
two; the schedules with virtual stages run at least pp micro-batches."""


def demo_plan(world_size: int, pp: int, schedule: str, micro_batches: int, virtual_stages: int):
    """The demo GPT's units cut into pp · virtual_stages stages, stage i on pipeline rank i mod pp."""
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    dp = world_size // pp
    # at dp == 1 sharding only copies: the stages' units are replicated; pp == 1 shards as FSDP does
    strategy = ShardStrategy.REPLICATE if dp == 1 else ShardStrategy.FULL_SHARD
    plan = manual_plan(
        entry.model,
        GROUPS,
        dp=dp,
        pp=pp * virtual_stages,
        schedule="1f1b" if pp > 1 else schedule,
        micro_batches=micro_batches,
        strategies=(strategy,),
        example_inputs=entry.args,
        example_kwargs=entry.kwargs,
    )
    return dataclasses.replace(
        plan,
        world_size=world_size,
        mesh=dataclasses.replace(plan.mesh, pp=pp),
        schedule=Schedule(
            num_micro_batches=micro_batches, name=schedule, virtual_stages=virtual_stages
        ),
    )


def _measure_rank(device, report, plan_json: str, steps: int) -> dict:
    with contextlib.ExitStack() as stack:
        return _measure(stack, device, report, plan_json, steps)


def _measure(stack, device, report, plan_json: str, steps: int) -> dict:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from shardplan.plan import Plan
    from shardplan.runtime import parallelize
    from shardplan.runtime.collectives import all_reduce_max, world
    from shardplan.runtime.measure import peak_step_bytes

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    generator = torch.Generator().manual_seed(
        1 + plan.mesh.replica_of(world().rank)
    )  # one batch per replica
    ids = torch.randint(0, DEMO_GPT.vocab_size, entry.args[0].shape, generator=generator)
    program = parallelize(entry.model, plan, device=device)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    busy_s = [0.0]
    # time the stages' own work: forward and backward chunks (weight gradients apart, zero-bubble)
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        stack.enter_context(
            mock.patch.object(
                _PipelineStageBase, name, _timed(getattr(_PipelineStageBase, name), busy_s)
            )
        )

    schedule_s = [0.0]
    run_schedule = _timed(program.step, schedule_s)

    def train_step():
        run_schedule(ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    train_step()
    with (
        mock.patch.object(ModTracker, "__enter__", lambda tracker: tracker),
        mock.patch.object(ModTracker, "__exit__", lambda tracker, *error: None),
    ):
        peak = peak_step_bytes(
            train_step,
            entry.model,
            optimizer,
            *program.parameters(),
            *[p.grad for p in program.parameters() if p.grad is not None],
        )
    schedule_s[0] = 0.0
    step_s, busy = _time_steps(train_step, steps, report, busy_s)
    # the bubble: time in the schedule (not the optimizer) outside the busiest stage's own work
    idle_s = schedule_s[0] / steps - busy
    return {
        "peak_bytes": int(all_reduce_max(torch.tensor(peak))),
        "step_s": step_s,
        "bubble_s": float(all_reduce_max(torch.tensor(idle_s))),
    }


class _HandStage(torch.nn.Module):
    """The demo GPT's half on pipeline rank `rank` of 2, written by hand as torch.distributed.pipelining's
    manual-split examples do: blocks 0-2 after the embeddings, or blocks 3-5 before the head and loss."""

    def __init__(self, gpt, rank: int):
        super().__init__()
        half = len(gpt.h) // 2
        self.first = rank == 0
        self.embeddings = torch.nn.ModuleList([gpt.wte, gpt.wpe] if self.first else [])
        self.blocks = gpt.h[:half] if self.first else gpt.h[half:]
        self.head = torch.nn.ModuleList([] if self.first else [gpt.ln_f, gpt.lm_head])

    def forward(self, x: torch.Tensor, labels: torch.Tensor):
        if self.first:
            wte, wpe = self.embeddings
            x = wte(x) + wpe(torch.arange(x.shape[1]))
        for block in self.blocks:
            x = block(x)
        if self.first:
            return x, labels
        ln_f, lm_head = self.head
        return torch.nn.functional.cross_entropy(lm_head(ln_f(x)).flatten(0, 1), labels.flatten())


def _hand_split_rank(device, report, schedule: str, micro_batches: int, steps: int) -> dict:
    """The same pipeline written by hand with torch.distributed.pipelining (dp 1, pp 2)."""
    from torch.distributed.pipelining import PipelineStage

    from shardplan.runtime.collectives import world
    from shardplan.runtime.pipelined import schedule_class

    rank = world().rank
    torch.manual_seed(0)
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    ids = torch.randint(
        0, DEMO_GPT.vocab_size, entry.args[0].shape, generator=torch.Generator().manual_seed(1)
    )
    module = _HandStage(entry.model, rank)
    # what crosses the cut, given up front (else the stage infers it by running garbage through itself)
    tokens = torch.empty(
        DEMO_BATCH // micro_batches, DEMO_GPT.seq_len, dtype=torch.int64, device="meta"
    )
    stream = torch.empty(*tokens.shape, DEMO_GPT.d_model, device="meta", requires_grad=True)
    stage = PipelineStage(
        module,
        rank,
        2,
        device,
        input_args=(tokens, tokens) if rank == 0 else (stream, tokens),
        output_args=(stream, tokens) if rank == 0 else torch.empty((), device="meta"),
    )
    run = schedule_class(schedule)(
        stage,
        n_microbatches=micro_batches,
        scale_grads=False,
        loss_fn=lambda loss, _: loss / micro_batches,
    )
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)

    def train_step():
        if rank == 0:
            run.step(ids, ids, return_outputs=False)
        else:
            run.step(target=torch.zeros(micro_batches), return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)

    train_step()
    return {"step_s": _time_steps(train_step, steps, report, [0.0])[0]}


def _time_steps(train_step, steps: int, report, busy_s: list[float]) -> tuple[float, float]:
    """Median over `steps` of the slowest rank's step time and of the busiest rank's `busy_s[0]`."""
    from shardplan.runtime.collectives import all_reduce_max

    steps_s, busy = [], []
    for _ in range(steps):
        all_reduce_max(torch.zeros(()))  # start together
        busy_s[0] = 0.0
        start = time.perf_counter()
        train_step()
        steps_s.append(float(all_reduce_max(torch.tensor(time.perf_counter() - start))))
        busy.append(float(all_reduce_max(torch.tensor(busy_s[0]))))
        report("step")
    return statistics.median(steps_s), statistics.median(busy)


def _timed(method, total: list[float]):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - start

    return run


def pipeline_table(hardware, world_size: int, steps: int) -> Table:
    entry = zoo.gpt(DEMO_GPT, batch=DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    table = Table(
        title=f"pipeline plans: demo GPT on {world_size} CPU ranks (gloo), median of {steps} steps"
    )
    for column in (
        "mesh",
        "schedule",
        "v",
        "m",
        "memory pred",
        "memory meas",
        "ratio",
        "step pred ms",
        "step meas ms",
        "ratio",
        "bubble pred ms",
        "bubble meas ms",
        "hand-split ms",
        "meas / hand-split",
    ):
        table.add_column(column, justify="right")
    for pp, schedule, micro_batches, virtual_stages in CONFIGURATIONS:
        plan = demo_plan(world_size, pp, schedule, micro_batches, virtual_stages)
        predicted = evaluate(chain, plan, hardware)
        measured = run_world(
            _measure_rank,
            (plan.to_json(), steps),
            world_size=world_size,
            backend="gloo",
            total_steps=steps,
            progress=False,
        )
        bubble = hand = versus = "-"
        if pp > 1:
            bubble = f"{measured['bubble_s'] * 1e3:.0f}"
        if pp > 1 and schedule in ("gpipe", "1f1b"):  # the hand-split stages: one per rank
            by_hand = run_world(
                _hand_split_rank,
                (schedule, micro_batches, steps),
                world_size=2,
                backend="gloo",
                total_steps=steps,
                progress=False,
            )
            hand, versus = (
                f"{by_hand['step_s'] * 1e3:.0f}",
                f"{measured['step_s'] / by_hand['step_s']:.2f}",
            )
        table.add_row(
            f"dp{plan.mesh.dp}×pp{pp}",
            schedule,
            str(virtual_stages),
            str(micro_batches),
            format_bytes(predicted.peak_bytes),
            format_bytes(measured["peak_bytes"]),
            f"{predicted.peak_bytes / measured['peak_bytes']:.2f}",
            f"{predicted.step_time_s * 1e3:.0f}",
            f"{measured['step_s'] * 1e3:.0f}",
            f"{predicted.step_time_s / measured['step_s']:.2f}",
            f"{predicted.time_s.get('bubble', 0.0) * 1e3:.0f}",
            bubble,
            hand,
            versus,
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a calibrated profile JSON (default: calibrate now)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    options = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    hardware = (
        get_hardware(options.profile)
        if options.profile
        else calibrate(world_size=options.world_size)
    )
    Console(width=160).print(pipeline_table(hardware, options.world_size, options.steps))


if __name__ == "__main__":
    main()
