"""What the solver picks at scale, by its own cost model: a Llama-3.1-405B shape on 512 x h100-80g and a
DeepSeek-V3 shape on 256 x h100-80g. Predictions, not measurements.

    .venv/bin/python benchmarks/bench_plans_at_scale.py                        # both models
    .venv/bin/python benchmarks/bench_plans_at_scale.py --model llama-405b --tables chosen

Each model (shardplan.models.zoo: llama_405b, deepseek_v3) is captured on the meta device, each repeated
layer traced once (frontend/repeats.py), analyzed in bf16 mixed precision and planned for a global batch
(torchtitan's 256 sequences of 8192 tokens for the 405B; 1024 sequences of 4096 tokens for
DeepSeek-V3). The tables (TABLES, --tables): the chosen plan and its runner-ups (the solver's
reasoning: the next fastest configurations, the fastest of every other tp, cp and ep degree, and the
expert defaults); for the 405B, torchtitan's published plans priced beside their published figures;
the fastest plan of each pipeline degree (compile.best_of_each; pipeline_group says which schedules).

The space is the solver's, but for one restriction: cp up to a node's 8 devices (MAX_CONTEXT_PARALLEL).
On 2 cores the 405B's solve with its reasoning takes about 4 minutes of CPU, DeepSeek-V3's 3.
"""

import argparse
import contextlib
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from shardplan.common.sizes import format_bytes
from shardplan.compile import best_of_each, solve
from shardplan.frontend.chain import BlockChain
from shardplan.frontend.passes import analyze
from shardplan.models import zoo
from shardplan.plan import BF16_MIXED, Checkpoint, Plan, ShardStrategy
from shardplan.solver.search import Configuration
from shardplan.solver.space import SearchSpace

HARDWARE = "h100-80g"
MAX_CONTEXT_PARALLEL = 8
"""cp degrees searched: up to a node's devices. The solver would go to the world (512), where a rank
keeps 8 of the 8192 tokens; every degree past 8 adds configurations (seconds each at 126 layers), and
its ring of keys and values crosses nodes."""
TORCHTITAN_UNITS = SearchSpace(
    strategies=(ShardStrategy.FULL_SHARD,),
    checkpoints=(Checkpoint.FULL,),
    prefetch=(True,),
    max_unit_blocks=1,
)
"""torchtitan's units: each block its own FULL_SHARD unit (fully_shard per layer), fully checkpointed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Published:
    """A hand plan published for the model: its configuration and what its run read."""

    name: str
    matches: Callable[[Configuration], bool]
    tokens_per_gpu_s: float
    peak_gib: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    title: str
    build: Callable[[], zoo.ZooModel]
    world_size: int
    global_batch: int
    seq: int
    published: tuple[Published, ...] = ()


def torchtitan_405b(schedule: str, virtual_stages: int) -> Callable[[Configuration], bool]:
    """FSDP 8 x TP 8 x PP 8, 8 micro-batches of the local batch of 32 (torchtitan's default: one a stage)."""

    def matches(c: Configuration) -> bool:
        mesh = c.mesh
        return (mesh.dp_shard, mesh.dp_replicate, mesh.tp, mesh.pp, mesh.cp) == (
            8,
            1,
            8,
            8,
            1,
        ) and (
            c.schedule.name,
            c.schedule.virtual_stages,
            c.schedule.num_micro_batches,
        ) == (schedule, virtual_stages, 8)

    return matches


WORKLOADS = {
    "llama-405b": Workload(
        title="Llama-3.1-405B shape, 256 x 8192 tokens a step, 512 x h100-80g",
        build=lambda: zoo.llama_405b(seq=8192),
        world_size=512,
        global_batch=256,
        seq=8192,
        published=(
            Published(
                name="torchtitan: FSDP 8 x TP 8 x PP 8, 1F1B",
                matches=torchtitan_405b("1f1b", 1),
                tokens_per_gpu_s=100,
                peak_gib=82.5,
            ),
            Published(
                name="torchtitan: FSDP 8 x TP 8 x PP 8, Interleaved 1F1B (v = 2)",
                matches=torchtitan_405b("interleaved_1f1b", 2),
                tokens_per_gpu_s=128,
                peak_gib=72.7,
            ),
        ),
    ),
    "deepseek-v3": Workload(
        title="DeepSeek-V3 shape, 1024 x 4096 tokens a step, 256 x h100-80g",
        build=lambda: zoo.deepseek_v3(seq=4096),
        world_size=256,
        global_batch=1024,
        seq=4096,
    ),
}


TABLES = ("chosen", "pipelines", "published")
"""The solver's plan and runner-ups, the fastest of each pipeline_group, the published plans priced."""


def tokens_per_gpu_s(workload: Workload, step_time_s: float) -> float:
    return workload.global_batch * workload.seq / step_time_s / workload.world_size


def new_table(title: str, *columns: str) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="left" if column in ("plan", "published") else "right")
    return table


@contextlib.contextmanager
def timed(label: str, spent: list[str]) -> Iterator[None]:
    """Append to `spent` how long the block took, on the clock and in this process's CPU time (the two
    differ on a machine others share)."""
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    spent.append(
        f"{label} {time.perf_counter() - wall:.0f} s ({time.process_time() - cpu:.0f} s of CPU)"
    )


def describe(plan: Plan) -> str:
    schedule = plan.schedule
    text = f"{plan.mesh.describe()}, {schedule.num_micro_batches} micro-batch(es)"
    if plan.mesh.pp > 1:
        text += f", {schedule.name}" + (
            f" x {schedule.virtual_stages} virtual stages" if schedule.virtual_stages > 1 else ""
        )
    return text


def pipeline_group(c: Configuration) -> tuple[int, str] | None:
    """(pp, schedule) of the configurations without a pipeline or with 1F1B, every mesh; of those with
    virtual stages or the zero-bubble schedule, only at pp 8 x tp 8 (torchtitan's 405B layout): such a
    configuration has no simple plan to bound its search with (search.uniform_plan_time_s), and at 126
    layers each takes seconds to rule out; every mesh's would take an hour on 2 cores."""
    if c.schedule.name in ("none", "1f1b") or (c.mesh.pp, c.mesh.tp) == (8, 8):
        return c.mesh.pp, c.schedule.name
    return None


def planned(
    console: Console, workload: Workload, chain: BlockChain, tables: list[str], spent: list[str]
) -> None:
    options = dict(
        hardware=HARDWARE,
        mixed_precision=BF16_MIXED,
        global_batch_size=workload.global_batch,
        max_context_parallel=MAX_CONTEXT_PARALLEL,
    )
    if "chosen" in tables:
        chosen(console, workload, chain, options, spent)
    if "published" in tables and workload.published:
        with timed("published plans", spent):
            hand_plans(console, workload, chain, options)
    if "pipelines" in tables:
        pipelines(console, workload, chain, options, spent)


def chosen(
    console: Console, workload: Workload, chain: BlockChain, options: dict, spent: list[str]
) -> None:
    """The solver's plan and its reasoning's runner-ups."""
    with timed("solve (its reasoning included)", spent):
        plan = solve(chain, workload.world_size, **options)
    table = new_table(
        f"{workload.title}: chosen and runner-ups", "plan", "step", "tokens/s/GPU", "peak"
    )
    rows = [(f"chosen: {describe(plan)}", plan.predicted)] + [
        (alternative.description, alternative) for alternative in plan.reasoning.runner_ups
    ]
    for name, figures in rows:
        table.add_row(
            name,
            f"{figures.step_time_s:.3g} s",
            f"{tokens_per_gpu_s(workload, figures.step_time_s):.0f}",
            format_bytes(figures.peak_bytes),
        )
    console.print(table)
    console.print(f"binding constraint: {plan.reasoning.binding_constraint}")


def pipelines(
    console: Console, workload: Workload, chain: BlockChain, options: dict, spent: list[str]
) -> None:
    """The fastest plan of each pipeline_group."""
    with timed("each pipeline degree and schedule", spent):
        fastest = best_of_each(chain, workload.world_size, pipeline_group, **options)
    table = new_table(
        f"{workload.title}: the fastest plan of each pipeline degree (1F1B) and, at pp 8 x tp 8, "
        "of each schedule",
        "pp",
        "schedule",
        "plan",
        "step",
        "tokens/s/GPU",
        "peak",
    )
    for (pp, schedule), candidate in sorted(fastest.items()):
        table.add_row(
            str(pp),
            schedule,
            candidate.configuration.describe(),
            f"{candidate.step_time_s:.3g} s",
            f"{tokens_per_gpu_s(workload, candidate.step_time_s):.0f}",
            format_bytes(candidate.peak_bytes),
        )
    console.print(table)


def hand_plans(console: Console, workload: Workload, chain: BlockChain, options: dict) -> None:
    """Each published plan priced by the cost model: its mesh, schedule and micro-batches, torchtitan's
    units (TORCHTITAN_UNITS), the stage cut the solver finds fastest, and no memory budget (the runs
    read above the h100-80g budget)."""

    def group(c: Configuration) -> Hashable | None:
        return next((p.name for p in workload.published if p.matches(c)), None)

    priced = best_of_each(
        chain, workload.world_size, group, space=TORCHTITAN_UNITS, memory_budget="1TiB", **options
    )
    table = new_table(
        f"{workload.title}: published plans, predicted beside published",
        "published",
        "step",
        "tokens/s/GPU",
        "published tokens/s/GPU",
        "peak",
        "published peak",
    )
    for published in workload.published:
        candidate = priced[published.name]
        table.add_row(
            published.name,
            f"{candidate.step_time_s:.3g} s",
            f"{tokens_per_gpu_s(workload, candidate.step_time_s):.0f}",
            f"{published.tokens_per_gpu_s:.0f}",
            format_bytes(candidate.peak_bytes),
            f"{published.peak_gib} GiB",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=list(WORKLOADS),
        nargs="+",
        default=list(WORKLOADS),
        help="models planned",
    )
    parser.add_argument(
        "--tables", choices=TABLES, nargs="+", default=list(TABLES), help="tables printed"
    )
    options = parser.parse_args()
    console = Console(width=160)
    for name in options.model:
        workload, spent = WORKLOADS[name], []
        with timed("built and analyzed on meta", spent):
            entry = workload.build()
            chain = analyze(
                entry.model, entry.args, entry.kwargs, compute_dtype=BF16_MIXED.param_dtype
            )
        console.print(
            f"{name}: {len(chain.blocks)} blocks, {chain.param_numel / 1e9:.0f}B parameters"
        )
        planned(console, workload, chain, options.tables, spent)
        console.print(f"{name}: " + "; ".join(spent))


if __name__ == "__main__":
    main()
