"""Start-up: `shardplan.parallelize` against FSDP2's `fully_shard` on the same model and units, one run.

    .venv/bin/python benchmarks/bench_startup.py            # CPU, gloo, world 2, two GPT sizes, then 70B
    .venv/bin/python benchmarks/bench_startup.py --skip-70b

What a user waits for between building the model and the first step. shardplan: `parallelize` with a
plan that records its input shapes and the model's signature (as `compile` writes one), which each rank
checks, then shards (backend "shardplan", and "fsdp2"). FSDP2 as its users write it: `fully_shard` on
every block, then on the root. Each figure is the slowest rank's, the median of rounds that alternate
the three so machine noise hits them alike; the ratio is against fully_shard.

Then LLaMA-70B shapes on the meta device, in this process: parallelize's check that the plan is for
the model (runtime/model_check.py), by the signature (the default) and by the graph (verify_graph=True,
and what a plan without a signature gets), seconds wall / CPU. The sharding itself is not timed there:
a 70B model does not fit one process's memory.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_frontend import seconds, timed  # noqa: E402

from shardplan.models import zoo  # noqa: E402
from shardplan.runtime import parallelize  # noqa: E402
from shardplan.runtime.launch import run_world  # noqa: E402
from shardplan.runtime.manual import manual_plan  # noqa: E402
from shardplan.runtime.model_check import check_model  # noqa: E402

SIZES = {"GPT 4 x 256": dict(n_layer=4, d_model=256), "GPT 12 x 768": dict(n_layer=12, d_model=768)}
WAYS = ("parallelize (shardplan)", "parallelize (fsdp2)", "fully_shard")


def _model(size: dict, world: int):
    torch.manual_seed(0)
    return zoo.gpt(zoo.GPTConfig(vocab_size=4096, seq_len=128, n_head=8, **size), batch=2 * world)


def _start(way: str, size: dict, world: int) -> float:
    """Seconds this rank spends from a built model to one ready to train, `way`."""
    from torch.distributed.fsdp import fully_shard

    entry = _model(size, world)
    ids = entry.args[0].chunk(world)[0]
    plan = manual_plan(
        entry.model,
        zoo.gpt_units(size["n_layer"]),
        dp=world,
        example_inputs=(ids,),
        example_kwargs={"labels": ids},
    )
    dist.barrier()
    start = time.perf_counter()
    if way == "fully_shard":
        for block in entry.model.h:
            fully_shard(block)
        fully_shard(entry.model)
    else:
        parallelize(entry.model, plan, backend="fsdp2" if "fsdp2" in way else "shardplan")
    return time.perf_counter() - start


def _measure_rank(device, report, rounds: int) -> dict:
    world = dist.get_world_size()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(rounds):
        for name, size in SIZES.items():
            for way in WAYS:
                mine = torch.tensor([_start(way, size, world)])
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's
                times.setdefault((name, way), []).append(float(mine))
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--skip-70b", action="store_true", help="leave out the check on LLaMA-70B shapes"
    )
    options = parser.parse_args()
    medians = run_world(
        _measure_rank,
        (options.rounds,),
        world_size=options.world_size,
        backend="gloo",
        total_steps=0,
        progress=False,
    )
    print(
        f"start-up on {options.world_size} gloo ranks, median of {options.rounds} alternating rounds\n"
    )
    print("| model | " + " | ".join(WAYS) + " | shardplan / fully_shard | fsdp2 / fully_shard |")
    print("|---|" + "---:|" * (len(WAYS) + 2))
    for name in SIZES:
        times = [medians[(name, way)] for way in WAYS]
        print(
            f"| {name} | "
            + " | ".join(f"{s:.2f} s" for s in times)
            + f" | {times[0] / times[-1]:.1f}x | {times[1] / times[-1]:.1f}x |"
        )
    if not options.skip_70b:
        print_llama_70b_check()


def print_llama_70b_check() -> None:
    """parallelize's check of a plan on LLaMA-70B shapes, by signature and by graph."""
    entry = zoo.llama_70b()
    plan = manual_plan(
        entry.model,
        [("model", "lm_head")],
        dp=1,
        example_inputs=entry.args,
        example_kwargs=entry.kwargs,
    )  # records the fingerprint and the signature, as compile does
    _, signature_wall_s, signature_cpu_s = timed(lambda: check_model(entry.model, plan))
    _, graph_wall_s, graph_cpu_s = timed(lambda: check_model(entry.model, plan, verify_graph=True))
    print(
        "\nLLaMA-70B shapes (80 layers, meta device, one sequence of 4096): parallelize's check of the plan, "
        "seconds wall / CPU\n"
    )
    print("| signature (default) | graph (verify_graph=True, or a plan without a signature) |")
    print("|---:|---:|")
    print(
        f"| {signature_wall_s:.3f} / {signature_cpu_s:.3f} | {seconds(graph_wall_s, graph_cpu_s)} |"
    )


if __name__ == "__main__":
    main()
