"""Elastic restarts: the seconds from a rank's SIGKILL to the first step on the new plan, broken down.

    .venv/bin/python benchmarks/bench_elastic.py               # 4 ranks lose one, 3 times, fastest first
    .venv/bin/python benchmarks/bench_elastic.py --repeats 1

Each run is tests/test_elastic.py's shrink: `shardplan train` of the zoo GPT (global batch 12) under
torchrun, 4 one-rank nodes on this machine (c10d rendezvous, keep_alive_interval=1, last_call_timeout=2,
monitor-interval=0.2), a rank other than 0 killed with SIGKILL mid-run, the job re-planned on 3. The parts
come from rank 0's events.jsonl and the agents' logs (tests/elastic_job.py, restart_breakdown).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # the job and its data live beside the tests

from elastic_job import Job, lose_one_of_four, restart_breakdown  # noqa: E402

PARTS = {
    "detection_s": "rank 0's next collective fails (gloo: connection closed)",
    "worker_exit_s": "the failed worker exits; its torchrun agent notices",
    "rendezvous_s": "agents stop their workers, new rendezvous round (dead node's heartbeats lapse, last call), spawn",
    "startup_s": "new worker: Python, import torch and shardplan, the CLI, the dataset",
    "process_group_s": "init_process_group",
    "analysis_s": "re-plan: analysis (rank 0)",
    "solve_s": "re-plan: solve (rank 0)",
    "parallelize_s": "parallelize on the new plan",
    "load_s": "load the checkpoint (model, optimizer, sampler, step, RNG)",
    "first_step_s": "build the model, the first step",
    "total_s": "kill to the first step on 3 ranks",
}


def one_restart(workdir: Path) -> dict[str, float]:
    with Job(workdir, nnodes="2:4", steps=30, checkpoint_every=4, global_batch=12) as job:
        killed = lose_one_of_four(job)
    return restart_breakdown(job.events(), job.logs_text(), killed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    runs = []
    for repeat in range(options.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as workdir:
            runs.append(one_restart(Path(workdir)))
        print(f"run {repeat + 1}: total {runs[-1]['total_s']:.1f} s", file=sys.stderr, flush=True)
    # a run per column, fastest first: the parts of one run add up to its total, medians of parts would not
    runs.sort(key=lambda run: run["total_s"])
    median = (len(runs) - 1) // 2
    print(
        "| part | "
        + " | ".join(
            f"run {i + 1}" + (" (median)" if i == median else "") for i in range(len(runs))
        )
        + " |"
    )
    print("|---|" + "---:|" * len(runs))
    for name, what in PARTS.items():
        print(f"| {what} | " + " | ".join(f"{run[name]:.1f}" for run in runs) + " |")


if __name__ == "__main__":
    main()
