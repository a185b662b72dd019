"""The one process every child process shardplan starts is forked from.

A spawned child starts a fresh interpreter and imports torch, shardplan and, for the Hugging Face
models, transformers again: 3-4 s of CPU a rank, more than many a rank's whole job, and a world of 4
ranks on 2 cores waits for all of them. A forkserver imports them once, when it starts, and forks
every child from that warm state; multiprocessing then prepares the child as it prepares a spawned
one (the parent's sys.path, working directory and main module), but its environment and standard
streams are the server's as it started (runtime/launch.py hands ranks the caller's environment).

Python runs one forkserver per process, preloaded with the modules named before it first starts, so
every caller asks for it here, with one list.
"""

import multiprocessing
from multiprocessing.context import ForkServerContext

PRELOADED = (
    "torch",
    "shardplan",  # the runtime, the front end and the cost model, and torch.distributed under them
    "shardplan.compile",
    "shardplan.cli.model_spec",  # the plan-quality gate's cases load their models with it
    "transformers.modeling_utils",  # the zoo's Hugging Face models; skipped where not installed
)
"""Modules the forkserver imports before its first fork; one that cannot be imported is skipped."""


def forkserver_context() -> ForkServerContext:
    """multiprocessing's forkserver context, its server preloaded with PRELOADED."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))
    return context
