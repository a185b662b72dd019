"""CPU ranks keep the memory they free, so a step's buffers are not faulted in again (runtime/host_memory.py)."""

import subprocess
import sys

_FAULTS = """
import resource
import torch
torch.set_num_threads(1)  # as CPU ranks run (runtime/launch.py)
{setup}
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
def step():  # a buffer of 64 MiB, above the largest mmap threshold glibc's malloc sets itself (32 MiB)
    torch.empty(16 << 20).fill_(1.0)
for _ in range(10):  # warm-up: the heap grows until two places alternate for the buffer (2-5 steps)
    step()
before = faults()
for _ in range(3):
    step()
print(faults() - before)
"""


def _faults_of_three_reallocations(setup: str) -> int:
    """Minor page faults of allocating, filling and freeing a 64 MiB tensor three times after ten, in a fresh process."""
    script = _FAULTS.format(setup=setup)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    return int(done.stdout.split()[-1])


def test_a_freed_buffer_is_not_faulted_in_again():
    kept = _faults_of_three_reallocations(
        "from shardplan.runtime.host_memory import keep_freed_host_memory\nkeep_freed_host_memory()"
    )
    default = _faults_of_three_reallocations("")
    assert (
        default > 40_000
    )  # glibc maps and unmaps it each time: 3 x 16k pages (what the runtime no longer pays)
    assert kept < 1_000
