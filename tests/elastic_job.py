"""A torchrun elastic job of one-rank nodes on this machine, run by `shardplan train`: what the elastic
tests and the restart benchmark (benchmarks/bench_elastic.py) start, pace, kill and read back.

Each node is a torchrun agent with one worker, so the world is the number of nodes in the rendezvous:
starting nodes grows it, killing one (agent and worker, SIGKILL, as a machine failing) shrinks it.
"""

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import elastic_data
import torch
import torch.distributed as dist
from torch.utils.data import default_collate

from shardplan.cli.model_spec import load_model
from shardplan.runtime.sampler import ResumableSampler

ADAMW = {"lr": 1e-3, "eps": 1e-6, "weight_decay": 0.01}
"""The CLI's AdamW with --eps 1e-6 (see parity.ADAMW on eps)."""
START_TIMEOUT_S = 150.0
"""How long a phase may wait for the job: a loaded machine starts processes slowly."""
PACE_S = 0.1
"""Seconds a sample read takes while a test waits for the job (0.3 s a step on 4 ranks at a global batch of 12)."""


class Job:
    """`shardplan train gpt elastic_data:paced_tokens` under torchrun --nnodes=`nnodes`, in `workdir`."""

    def __init__(
        self, workdir: Path, *, nnodes: str, steps: int, checkpoint_every: int, global_batch: int
    ):
        self.workdir = workdir
        self.directory = workdir / "run"
        self.nnodes, self.steps, self.checkpoint_every, self.global_batch = (
            nnodes,
            steps,
            checkpoint_every,
            global_batch,
        )
        # The rendezvous store listens here, on a port the OS picked as it bound it, and every node joins
        # it as a client: a port probed free and bound later by the first node could be taken in between
        # by another job starting on this machine. It also outlives any node the tests kill.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self.nodes: list[subprocess.Popen] = []
        """The nodes started and not killed, in the order they started."""
        self.logs: dict[int, Path] = {}
        """Each node's torchrun output, by its agent's pid."""

    def __enter__(self) -> "Job":
        self.pace(PACE_S)  # slow steps until the test acts: the run is mid-way when it does
        return self

    def __exit__(self, *exc_info) -> None:
        for node in list(self.nodes):
            if node.poll() is None:
                self.kill(node)
        del self.store  # stops listening once no node is left to ask it

    def start(self, count: int) -> None:
        """Start `count` more nodes together."""
        for _ in range(count):
            log = self.workdir / f"node{len(self.logs)}.log"
            with log.open("w") as output:  # the node has its own copy of the descriptor
                node = subprocess.Popen(
                    self._command(),
                    env=self._environment(),
                    cwd=self.workdir,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.logs[node.pid] = log
            self.nodes.append(node)

    def pace(self, read_s: float | None) -> None:
        """Make every sample read take `read_s` seconds (elastic_data.SLOW), or (None) let the job run at full speed."""
        marker = self.workdir / elastic_data.SLOW
        if read_s is None:
            marker.unlink(missing_ok=True)
        else:  # whole, as the readers see it
            (self.workdir / "pace.tmp").write_text(str(read_s))
            os.replace(self.workdir / "pace.tmp", marker)

    def kill(self, node: subprocess.Popen) -> float:
        """SIGKILL a node's agent and its workers, as a machine failing would; the time of the kill."""
        workers = _children(node.pid)
        killed = time.time()
        os.killpg(node.pid, signal.SIGKILL)
        for worker in workers:
            try:
                os.kill(worker, signal.SIGKILL)
            except ProcessLookupError:
                pass
        node.wait(timeout=30)
        self.nodes.remove(node)
        return killed

    def kill_a_rank(self) -> float:
        """SIGKILL the node of a rank other than 0 (whose events.jsonl the tests read); the time of the
        kill."""
        victim = next(
            node
            for rank in range(1, len(self.nodes))
            if (node := self._node_of_rank(rank)) is not None
        )
        return self.kill(victim)

    def _node_of_rank(self, rank: int) -> subprocess.Popen | None:
        """The node whose worker is `rank` now (None between restarts)."""
        for node in self.nodes:
            for worker in _children(node.pid):
                try:
                    environment = Path(f"/proc/{worker}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"RANK={rank}".encode() in environment:
                    return node
        return None

    def finish(self) -> None:
        """Let the job run to its last step and every node exit; raises with a node's log if one fails."""
        self.pace(None)
        for node in self.nodes:
            code = node.wait(timeout=START_TIMEOUT_S)
            assert code == 0, f"node exited {code}:\n" + self.logs[node.pid].read_text()[-3000:]

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not condition():
            if time.monotonic() > deadline or any(node.poll() is not None for node in self.nodes):
                logs = "\n".join(
                    f"--- {path.name}\n{path.read_text()[-1500:]}" for path in self.logs.values()
                )
                raise AssertionError(f"gave up waiting for {what}\n{logs}")
            time.sleep(0.05)

    def logs_text(self) -> list[str]:
        return [path.read_text() for path in self.logs.values()]

    def events(self) -> list[dict]:
        path = self.directory / "events.jsonl"
        return (
            [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        )

    def starts(self) -> list[dict]:
        return [event for event in self.events() if event["event"] == "start"]

    def progress(self) -> dict:
        try:
            return json.loads((self.directory / "progress.json").read_text())
        except (OSError, ValueError):  # not written yet, or replaced under us
            return {"step": 0, "world_size": 0}

    def running_past_a_checkpoint(self, world_size: int) -> bool:
        """Whether the job runs on `world_size` ranks and has stepped past a checkpoint it wrote there."""
        begun, now = self.starts(), self.progress()
        return (
            bool(begun)
            and begun[-1]["world_size"] == world_size == now["world_size"]
            and now["step"] > begun[-1].get("resumed_step", 0) + self.checkpoint_every
        )

    def _command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.nnodes}",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{self.store.port}",
            "--rdzv-id=elastic-test",
            # a dead node leaves the rendezvous after keep_alive_interval x keep_alive_max_attempt (1 s x 3)
            "--rdzv-conf=is_host=0,last_call_timeout=2,keep_alive_interval=1",
            "--max-restarts=3",
            "--monitor-interval=0.2",
            "-m",
            "shardplan.cli.main",
            "train",
            "gpt",
            "elastic_data:paced_tokens",
            "--directory",
            str(self.directory),
            "--steps",
            str(self.steps),
            "--checkpoint-every",
            str(self.checkpoint_every),
            "--global-batch",
            str(self.global_batch),
            "--hardware",
            "cpu-gloo",
            "--eps",
            str(ADAMW["eps"]),
            "--timeout",
            "60",
        ]

    @staticmethod
    def _environment() -> dict[str, str]:
        tests = str(Path(__file__).parent)
        return {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])),
            # torch 2.13's shared rendezvous store never gives a node joining a running job the master's
            # address (the README's 'Elastic training'): both agents wait 60 s and fail
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
        }  # up to 4 ranks on 2 cores: one thread each keeps them from fighting


def lose_one_of_four(job: Job) -> float:
    """Start `job` on 4 nodes, SIGKILL one mid-run (after a checkpoint on 4 ranks) and let it finish on the
    rest; the time of the kill."""
    job.start(4)
    job.wait_for(lambda: job.running_past_a_checkpoint(4), "steps on 4 ranks past a checkpoint")
    killed = job.kill_a_rank()
    job.finish()
    return killed


def reference_losses(steps: int, global_batch: int) -> list[float]:
    """One process, the whole global batch each step, the same samples, model and optimizer as the job's."""
    torch.manual_seed(0)
    model = load_model("gpt").model
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    data, sampler = elastic_data.tokens(), ResumableSampler(elastic_data.SAMPLES, seed=0)
    losses = []
    for _ in range(steps):
        loss = model(**default_collate([data[index] for index in sampler.take(global_batch)]))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def restart_breakdown(events: list[dict], logs: list[str], killed: float) -> dict[str, float]:
    """Where the seconds from a rank's kill (wall time `killed`) to the first step on the next plan went, from
    rank 0's events.jsonl (rank 0 must survive the kill) and the agents' `logs`."""
    after = [event for event in events if event["time"] >= killed]
    failed = next(event for event in after if event["event"] == "failed")
    start = next(event for event in after if event["event"] == "start")
    first_step = next(event for event in after[after.index(start) :] if event["event"] == "step")
    seen = min(
        at for log in logs for at in _worker_failures(log, killed) if at >= killed
    )  # first agent to notice
    in_train = {
        "process_group_s": start["rendezvous_s"],
        "analysis_s": start["analyze_s"],
        "solve_s": start["solve_s"],
        "parallelize_s": start["parallelize_s"],
        "load_s": start["load_s"],
    }
    return {
        "detection_s": failed["time"]
        - killed,  # rank 0's next collective failed on the closed connection
        "worker_exit_s": seen
        - failed["time"],  # the failed worker unwinds and exits; its agent notices
        # the agents stop their other workers, meet in a new rendezvous round (once the dead node's heartbeats
        # lapse and the last call passes) and start new workers
        "rendezvous_s": start["started_at"] - start["startup_s"] - seen,
        "startup_s": start[
            "startup_s"
        ],  # Python, importing torch and shardplan, the CLI, the dataset
        **in_train,
        "first_step_s": first_step["since_start_s"]
        - sum(in_train.values()),  # and building the model
        "total_s": first_step["time"] - killed,
    }


def _worker_failures(log: str, near: float) -> list[float]:
    """When an agent logged a worker's failure: its glog lines (`E1123 23:45:52.046000 pid file:line] failed
    (exitcode: 1) ...`) give local time without the year, which `near` (a wall time) gives."""
    year = time.localtime(near).tm_year
    return [
        datetime.datetime.strptime(f"{year}{match[1]} {match[2]}", "%Y%m%d %H:%M:%S.%f").timestamp()
        for match in re.finditer(
            r"^E(\d{4}) (\d\d:\d\d:\d\d\.\d+) .*\] failed \(exitcode", log, re.MULTILINE
        )
    ]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (torchrun's workers run in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid
            ):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found
