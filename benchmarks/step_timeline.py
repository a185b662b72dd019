"""Where a Hugging Face workload's 2-rank step spends its time: the step's phases (Program.step's entry,
forward, backward and exit, then the optimizer), every unit's gathers, reductions and releases, and the
page faults of each phase.

    .venv/bin/python benchmarks/step_timeline.py hf-mixtral --kinds full_shard/none shard_grad_op/none
    .venv/bin/python benchmarks/step_timeline.py hf-mixtral --timeline        # and every call over 0.2 ms

Where bench_hf_memory.py finds a plan kind's step slower than predicted, this says in which phase: it runs
the chosen plan kinds of accuracy.hf_workload(name) (HF_WORKLOADS' or zoo.HF_ARCHITECTURES' at the same
size; one unit per block, as that bench plans them) on 2 gloo ranks, their steps interleaved round by round
as that bench times them, and prints rank 0's fastest round of each: the phases' milliseconds and minor page
faults, and per phase the calls into the runtime's units (runtime/unit.py: a prefetch issues an all-gather,
`gathered` waits for one or gathers at once, `reduce` issues the gradient's reduction, `finish_reduction`
waits for it and adds it into `.grad`). The step is the one that bench times (accuracy._train_step), its
phases marked where Program.step calls out (marked_step): "step entry" is the step's checks and the sharded
backend's transaction setting the kept gradients aside (reading each for zeros: [Note: failed steps] in
runtime/program.py), "step exit" the transaction putting them back and the loss's all-reduce over the ranks
(which waits for the slower rank), "optimizer" AdamW's step and zero_grad.
"""

import argparse
import collections
import functools
import os
import resource
import time
from typing import Callable

import torch

from shardplan.calibration.accuracy import (
    HF_WORKLOAD_NAMES,
    KIND_NAMES,
    _train_step,
    demo_chain_and_plans,
    hf_workload,
    trained_program,
)
from shardplan.runtime.launch import run_world

_TIMED = ("prefetch", "gathered", "reduce", "finish_reduction", "release")
"""FlatUnit's methods whose calls are logged."""


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timeline_job(device, report, plan_jsons: dict[str, str], workload, rounds: int) -> dict:
    """Rank job: per plan kind, its fastest round's (phase marks (marked_step), [(call, unit, state, start, end)])."""
    from shardplan.runtime.unit import FlatUnit

    calls = []

    def logged(name, method):
        @functools.wraps(method)
        def run(unit, *args, **kwargs):
            state, start = unit.state.value, time.perf_counter()
            try:
                return method(unit, *args, **kwargs)
            finally:
                calls.append((name, unit.name, state, start, time.perf_counter()))

        return run

    for name in _TIMED:
        setattr(FlatUnit, name, logged(name, getattr(FlatUnit, name)))

    steps = {}
    for kind, plan_json in plan_jsons.items():
        steps[kind] = marked_step(*trained_program(device, plan_json, workload)[1:])
        steps[kind]()
        steps[kind]()  # the optimizer's state exists from here on
    fastest = {}
    for _ in range(rounds):
        for kind, step in steps.items():
            calls.clear()
            marks = step()
            if kind not in fastest or _length_s(marks) < _length_s(fastest[kind][0]):
                fastest[kind] = (marks, list(calls))
    return fastest


def marked_step(program, optimizer, ids) -> Callable[[], list[tuple[str, float, int]]]:
    """accuracy._train_step of `program` (Program.step, AdamW's step, zero_grad), returning where each of
    its phases ends, in order: (phase, perf_counter, minor page faults), after ("start", ...). The step is
    the runtime's own, observed where it calls out: its `loss` (one micro-batch's forward, wrapped here on
    this program), its after_reduction hook (every gradient reduced) and the optimizer's step pre-hook
    (Program.step has returned)."""
    marks: list[tuple[str, float, int]] = []

    def mark(phase: str) -> None:
        marks.append((phase, time.perf_counter(), _faults()))

    loss = program.loss

    @functools.wraps(loss)
    def forward(*args, **kwargs):
        # before the first micro-batch: the step's entry; before a later one: the one before's backward
        mark("step entry" if marks[-1][0] == "start" else "backward")
        result = loss(*args, **kwargs)
        mark("forward")
        return result

    program.loss = forward
    program.after_reduction = lambda planned: mark("backward")
    optimizer.register_step_pre_hook(lambda *_: mark("step exit"))

    def step() -> list[tuple[str, float, int]]:
        torch.distributed.barrier()
        marks.clear()
        mark("start")
        _train_step(program, optimizer, ids)
        mark("optimizer")
        return list(marks)

    return step


def _length_s(marks: list[tuple[str, float, int]]) -> float:
    return marks[-1][1] - marks[0][1]


def show(kind: str, marks: list[tuple[str, float, int]], calls: list, timeline: bool) -> None:
    phases: dict[
        str, list
    ] = {}  # phase -> [seconds, faults], summed over its spans (one a micro-batch)
    for (_, begin, begin_faults), (phase, end, end_faults) in zip(marks, marks[1:]):
        total = phases.setdefault(phase, [0.0, 0])
        total[0] += end - begin
        total[1] += end_faults - begin_faults
    start = marks[0][1]
    print(
        f"\n{kind}: step {_length_s(marks) * 1e3:.1f} ms; "
        + "; ".join(
            f"{phase} {seconds * 1e3:.1f} ms, {faults} faults"
            for phase, (seconds, faults) in phases.items()
        )
    )
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, unit, state, call_start, call_end in calls:
        phase = next(phase for phase, end, _ in marks[1:] if call_start < end)
        key = f"{phase} {name} ({state})"
        totals[key][0] += 1
        totals[key][1] += call_end - call_start
    for key, (count, seconds) in sorted(totals.items()):
        print(f"  {key:40s} {count:3d} calls {seconds * 1e3:8.2f} ms")
    if timeline:
        for name, unit, state, call_start, call_end in calls:
            if call_end - call_start > 2e-4 or name == "prefetch":
                print(
                    f"    at {(call_start - start) * 1e3:7.2f} ms {(call_end - call_start) * 1e3:6.2f} ms  "
                    f"{name} {unit} ({state})"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=HF_WORKLOAD_NAMES)
    parser.add_argument("--kinds", nargs="+", default=KIND_NAMES, choices=KIND_NAMES)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--timeline", action="store_true", help="also every call over 0.2 ms, and each prefetch"
    )
    args = parser.parse_args()
    workload = hf_workload(args.name)
    _, plans = demo_chain_and_plans(2, workload)
    chosen = {kind: plan.to_json() for kind, plan in zip(KIND_NAMES, plans) if kind in args.kinds}
    load_before = os.getloadavg()[0]
    found = run_world(
        timeline_job,
        (chosen, workload, args.rounds),
        world_size=2,
        backend="gloo",
        total_steps=1,
        progress=False,
    )
    print(
        f"{args.name} on 2 gloo ranks, rank 0, each kind's fastest of {args.rounds} rounds, "
        f"load {load_before:.1f}-{os.getloadavg()[0]:.1f}"
    )
    for kind in chosen:
        show(kind, *found[kind], args.timeline)


if __name__ == "__main__":
    main()
