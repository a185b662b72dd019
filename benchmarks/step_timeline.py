"""Where a Hugging Face workload's 2-rank step spends its time: forward, backward and optimizer, every
unit's gathers, reductions and releases, and the page faults of each phase.

    .venv/bin/python benchmarks/step_timeline.py hf-mixtral --kinds full_shard/none shard_grad_op/none
    .venv/bin/python benchmarks/step_timeline.py hf-mixtral --timeline        # and every call over 0.2 ms

Where bench_hf_memory.py finds a plan kind's step slower than predicted, this says in which phase: it runs
the chosen plan kinds of accuracy.hf_workload(name) (HF_WORKLOADS' or zoo.HF_ARCHITECTURES' at the same
size; one unit per block, as that bench plans them) on 2 gloo ranks, their steps interleaved round by round
as that bench times them, and prints rank 0's fastest round of each: the phases' milliseconds and minor page
faults, and per phase the calls into the runtime's units (runtime/unit.py: a prefetch issues an all-gather,
`gathered` waits for one or gathers at once, `reduce` issues the gradient's reduction, `finish_reduction`
waits for it and adds it into `.grad`).
"""
import argparse
import collections
import functools
import os
import resource
import time

import torch

from shardplan import zoo
from shardplan.accuracy import HF_WORKLOADS, KINDS, demo_chain_and_plans, hf_workload, trained_program
from shardplan.runtime.launch import run_world

_TIMED = ("prefetch", "gathered", "reduce", "finish_reduction", "release")
"""FlatUnit's methods whose calls are logged."""


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timeline_job(device, report, plan_jsons: dict[str, str], workload, rounds: int) -> dict:
    """Rank job: per plan kind, its fastest round's (step s, phase marks, [(call, unit, state, start, end)])."""
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
        steps[kind] = functools.partial(_marked_step, *trained_program(device, plan_json, workload)[1:])
        steps[kind]()
        steps[kind]()  # the optimizer's state exists from here on
    fastest = {}
    for _ in range(rounds):
        for kind, step in steps.items():
            calls.clear()
            marks = step()
            if kind not in fastest or marks["end"] - marks["start"] < fastest[kind][0]["end"] - fastest[kind][0]["start"]:
                fastest[kind] = (marks, list(calls))
    return fastest


def _marked_step(program, optimizer, ids) -> dict[str, float]:
    """One training step (as accuracy._train_step), with the time and the page faults at each phase's end."""
    torch.distributed.barrier()
    marks = {"start": time.perf_counter(), "faults": _faults()}
    output = program(ids, labels=ids)
    marks["forward"], marks["forward faults"] = time.perf_counter(), _faults()
    output.loss.backward()
    marks["backward"], marks["backward faults"] = time.perf_counter(), _faults()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    marks["end"], marks["end faults"] = time.perf_counter(), _faults()
    return marks


def show(kind: str, marks: dict[str, float], calls: list, timeline: bool) -> None:
    phases = (("forward", "start"), ("backward", "forward"), ("optimizer", "backward"))
    ends = {"forward": "forward", "backward": "backward", "optimizer": "end"}
    fault_marks = {"start": "faults", "forward": "forward faults", "backward": "backward faults", "end": "end faults"}
    parts = [f"{phase} {(marks[ends[phase]] - marks[begin]) * 1e3:.1f} ms, "
             f"{int(marks[fault_marks[ends[phase]]] - marks[fault_marks[begin]])} faults" for phase, begin in phases]
    print(f"\n{kind}: step {(marks['end'] - marks['start']) * 1e3:.1f} ms; " + "; ".join(parts))
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, unit, state, start, end in calls:
        phase = "forward" if start < marks["forward"] else "backward" if start < marks["backward"] else "optimizer"
        key = f"{phase} {name} ({state})"
        totals[key][0] += 1
        totals[key][1] += end - start
    for key, (count, seconds) in sorted(totals.items()):
        print(f"  {key:40s} {count:3d} calls {seconds * 1e3:8.2f} ms")
    if timeline:
        for name, unit, state, start, end in calls:
            if end - start > 2e-4 or name == "prefetch":
                print(f"    at {(start - marks['start']) * 1e3:7.2f} ms {(end - start) * 1e3:6.2f} ms  {name} {unit} ({state})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=list(HF_WORKLOADS) + list(zoo.HF_ARCHITECTURES))
    kinds = [f"{strategy.value}/{checkpoint.value}" for strategy, checkpoint in KINDS]
    parser.add_argument("--kinds", nargs="+", default=kinds, choices=kinds)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeline", action="store_true", help="also every call over 0.2 ms, and each prefetch")
    args = parser.parse_args()
    workload = hf_workload(args.name)
    _, plans = demo_chain_and_plans(2, workload)
    chosen = {kind: plan.to_json() for kind, plan in zip(kinds, plans) if kind in args.kinds}
    load_before = os.getloadavg()[0]
    found = run_world(timeline_job, (chosen, workload, args.rounds), world_size=2, backend="gloo", total_steps=1,
                      progress=False)
    print(f"{args.name} on 2 gloo ranks, rank 0, each kind's fastest of {args.rounds} rounds, "
          f"load {load_before:.1f}-{os.getloadavg()[0]:.1f}")
    for kind in chosen:
        show(kind, *found[kind], args.timeline)


if __name__ == "__main__":
    main()
