"""The README's main job: plan a GPT, train it with the plan on CPU ranks, check the prediction.

The planner runs once, here; the ranks are spawned processes talking gloo,
each training its own batch with the plan. Memory is measured by MemTracker
(every tensor torch allocates on the rank), time as the slowest rank's step.
"""

import os
from dataclasses import dataclass

import torch

from shardplan.common.sizes import format_bytes, parse_bytes
from shardplan.costmodel.hardware import HardwareProfile, get_hardware
from shardplan.models import zoo
from shardplan.plan import Plan

TIGHT_BUDGET_SHARE = 0.6
"""Default budget: this share of what the fastest data-parallel plan needs, so the solver must trade."""
DEMO_CALIBRATION = "medium"
"""Without --hardware the demo calibrates this machine so (calibrate.sweep_for): medium times every
matmul and collective size the demo can plan, in 20 s on 2 idle cores (quick stops at n = 256)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Measured:
    peak_bytes: int
    """Largest peak over the ranks."""
    step_times_s: tuple[float, ...]
    """Each timed step's, the slowest rank's."""
    losses: tuple[float, ...]

    @property
    def step_time_s(self) -> float:
        """The fastest step: the machine's, as the calibration's figures are the fastest of their rounds
        (calibrate.py, [Note: the fastest of interleaved rounds]); other processes only lengthen a step."""
        return min(self.step_times_s)

    @property
    def mean_step_time_s(self) -> float:
        return sum(self.step_times_s) / len(self.step_times_s)


def plan_demo(world_size: int, hardware: HardwareProfile, memory_budget=None) -> tuple[Plan, int]:
    """The plan for the demo GPT, and the budget it was planned for."""
    from shardplan.compile import solve
    from shardplan.frontend.passes import analyze

    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    chain = analyze(entry.model, entry.args, entry.kwargs)
    if memory_budget is None:
        fastest = solve(
            chain, world_size, hardware=hardware, allow_pipeline=False, model_name="GPT"
        )
        budget = int(fastest.predicted.peak_bytes * TIGHT_BUDGET_SHARE)
    else:
        budget = parse_bytes(memory_budget)
    plan = solve(chain, world_size, hardware=hardware, memory_budget=budget, model_name="GPT")
    return plan, budget


def train_with_plan(plan: Plan, world_size: int, steps: int, progress: bool = True) -> Measured:
    """Train the demo GPT with `plan` on `world_size` spawned CPU ranks; return what was measured."""
    from shardplan.runtime.launch import run_world

    return run_world(
        _train_rank,
        (plan.to_json(), steps),
        world_size=world_size,
        backend="gloo",
        total_steps=steps + 2,
        progress=progress,
        description=f"training on {world_size} ranks",
    )


def _train_rank(device: torch.device, report, plan_json: str, steps: int) -> Measured:
    from shardplan.plan import Plan
    from shardplan.runtime import parallelize
    from shardplan.runtime.collectives import all_reduce_max, world
    from shardplan.runtime.measure import peak_step_bytes, step_time_s

    plan = Plan.from_json(plan_json)
    torch.manual_seed(0)  # the same initial weights on every rank
    entry = zoo.gpt(zoo.DEMO_GPT, batch=zoo.DEMO_BATCH)
    generator = torch.Generator().manual_seed(
        1 + plan.mesh.replica_of(world().rank)
    )  # each replica its own batch
    ids = torch.randint(0, zoo.DEMO_GPT.vocab_size, entry.args[0].shape, generator=generator)
    program = parallelize(entry.model, plan, device=device)
    optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
    losses = []

    def train_step():
        losses.append(float(program.step(ids, labels=ids)))
        optimizer.step()
        # Gradients stay allocated between steps, as the cost model counts them (sharded_state);
        # set_to_none=True frees them and lowers the real peak by up to the gradient shard.
        optimizer.zero_grad(set_to_none=False)

    train_step()  # warm-up: allocates optimizer state, as every later step has it
    report("warm-up")
    grads = [
        p.grad for p in program.parameters() if p.grad is not None
    ]  # kept from the warm-up step
    peak = peak_step_bytes(train_step, entry.model, optimizer, *program.parameters(), *grads)
    report("memory")
    seconds = []
    for step in range(steps):
        seconds.append(step_time_s(train_step, 1))
        report(f"step {step + 1}")
    peak = int(all_reduce_max(torch.tensor(peak)))
    return Measured(peak_bytes=peak, step_times_s=tuple(seconds), losses=tuple(losses))


def comparison_rows(plan: Plan, measured: Measured) -> list[tuple[str, str, str, str]]:
    """(what, predicted, measured, predicted / measured) for the demo's table."""
    peak, step = plan.predicted.peak_bytes, plan.predicted.step_time_s
    return [
        (
            "peak memory per rank",
            format_bytes(peak),
            format_bytes(measured.peak_bytes),
            f"{peak / measured.peak_bytes:.2f}",
        ),
        (
            f"step time (fastest of {len(measured.step_times_s)})",
            f"{step * 1e3:.1f} ms",
            f"{measured.step_time_s * 1e3:.1f} ms",
            f"{step / measured.step_time_s:.2f}",
        ),
    ]


def load_note(measured: Measured) -> str:
    """The steps' spread and this machine's load: what to read a step-time ratio against."""
    load = os.getloadavg()[0]
    busy = (
        f"; the load is {load / (os.cpu_count() or 1):.1f}x the {os.cpu_count()} cores, so other work slows "
        "the steps (and the calibration's rounds): run it on a quiet machine for the documented accuracy"
        if load > (os.cpu_count() or 1)
        else ""
    )
    return (
        f"step times {', '.join(f'{s * 1e3:.0f}' for s in measured.step_times_s)} ms (mean "
        f"{measured.mean_step_time_s * 1e3:.1f} ms); load average {load:.1f}{busy}"
    )


def resolve_hardware(spec: str | None, world_size: int, progress: bool = True) -> HardwareProfile:
    """A named or saved profile; by default, a medium calibration of this machine (see DEMO_CALIBRATION)."""
    if spec is not None:
        return get_hardware(spec)
    from shardplan.calibration.calibrate import calibrate

    return calibrate(world_size=max(world_size, 2), mode=DEMO_CALIBRATION, progress=progress)
