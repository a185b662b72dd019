"""Every kernel of a Hugging Face workload's 2-rank training step, clocked and priced call by call.

    .venv/bin/python benchmarks/clock_step.py hf-mixtral --kinds shard_optimizer/none full_shard/selective \
        --profile runs/hf-mixtral.profile.json

Where bench_hf_memory.py finds a step mispriced, this says whether the kernels are: it runs the plan kinds
of accuracy.hf_workload(name) (HF_WORKLOADS' or zoo.HF_ARCHITECTURES' at the same size; one unit per block,
as that bench plans them) on 2 gloo ranks, times every kernel of rank 0's step under op_factors' kernel clock
(each call's fastest of --rounds rounds; the clock synchronises around each call, so the clocked step is a
little longer than a free one) and prices each call on its own FLOPs and bytes at its op's factor on the
profile (as the ranks share this machine's cores: accuracy.shared_cores). It prints, per op, calls, measured
ms and priced ms, largest gap first, then the step: wall (unclocked), kernels measured and priced, and what
compile.evaluate predicts. The profile is one `bench_hf_memory.py --keep DIR` wrote (<name>.profile.json),
or any calibrated profile.
"""

import argparse
import collections
import functools
import os
import time

import torch

from shardplan.calibration.accuracy import (
    HF_WORKLOAD_NAMES,
    KIND_NAMES,
    _train_step,
    demo_chain_and_plans,
    hf_workload,
    machine_cores,
    shared_cores,
    trained_program,
)
from shardplan.calibration.op_factors import _KernelClock
from shardplan.compile import evaluate
from shardplan.costmodel.hardware import get_hardware
from shardplan.runtime.launch import run_world


def clocked_steps(device, report, plan_jsons: dict[str, str], workload, rounds: int) -> dict:
    """Per plan kind: the fastest unclocked step's seconds and every kernel's (op, FLOPs, bytes, fastest s)."""
    found = {}
    for kind, plan_json in plan_jsons.items():
        step = functools.partial(_train_step, *trained_program(device, plan_json, workload)[1:])
        step()
        step()  # the optimizer's state exists from here on: every later step runs the same kernels
        wall_s, fastest = float("inf"), None
        for _ in range(rounds):
            torch.distributed.barrier()
            start = time.perf_counter()
            step()
            wall_s = min(wall_s, time.perf_counter() - start)
            torch.distributed.barrier()
            clock = _KernelClock(device)
            with clock:
                step()
            if fastest is not None and [c[:3] for c in clock.calls] != [c[:3] for c in fastest]:
                raise RuntimeError(f"{kind}: a round ran other kernels than the one before it")
            fastest = (
                clock.calls
                if fastest is None
                else [min(a, b, key=lambda c: c[3]) for a, b in zip(fastest, clock.calls)]
            )
        found[kind] = {"wall_s": wall_s, "calls": fastest}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=HF_WORKLOAD_NAMES)
    parser.add_argument("--kinds", nargs="+", default=["shard_optimizer/none"], choices=KIND_NAMES)
    parser.add_argument(
        "--profile", required=True, help="a calibrated profile JSON (bench_hf_memory.py --keep)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    workload = hf_workload(args.name)
    chain, plans = demo_chain_and_plans(2, workload)
    chosen = {kind: plan for kind, plan in zip(KIND_NAMES, plans) if kind in args.kinds}
    hw = shared_cores(get_hardware(args.profile), 2, machine_cores())
    load_before = os.getloadavg()[0]
    results = run_world(
        clocked_steps,
        ({kind: plan.to_json() for kind, plan in chosen.items()}, workload, args.rounds),
        world_size=2,
        backend="gloo",
        total_steps=1,
        progress=False,
    )
    print(
        f"{args.name} on 2 gloo ranks, rank 0, each call's fastest of {args.rounds} rounds, "
        f"load {load_before:.1f}-{os.getloadavg()[0]:.1f}"
    )
    for kind, plan in chosen.items():
        by_op: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
        for op, flops, nbytes, seconds in results[kind]["calls"]:
            by_op[op][0] += 1
            by_op[op][1] += seconds
            by_op[op][2] += hw.compute_time_s(flops, nbytes, op=op)
        measured, priced = sum(v[1] for v in by_op.values()), sum(v[2] for v in by_op.values())
        print(
            f"\n{kind}: step {results[kind]['wall_s'] * 1e3:.1f} ms measured, "
            f"{evaluate(chain, plan, hw).step_time_s * 1e3:.1f} predicted; "
            f"kernels {measured * 1e3:.1f} ms measured, {priced * 1e3:.1f} priced call by call"
        )
        print(f"  {'op':40s} {'calls':>6s} {'measured ms':>12s} {'priced ms':>10s}")
        for op, (calls, seconds, price) in sorted(
            by_op.items(), key=lambda item: -abs(item[1][1] - item[1][2])
        ):
            print(f"  {op:40s} {calls:6d} {seconds * 1e3:12.2f} {price * 1e3:10.2f}")


if __name__ == "__main__":
    main()
