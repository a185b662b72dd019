"""CPU ranks keep the memory they free, as CUDA's caching allocator does on a GPU.

[Note: freed host memory] A step allocates and frees the same large buffers every time (a unit's
gathered parameters, twice a step under FULL_SHARD; activations; the flat gradient). glibc's malloc
hands buffers above its mmap threshold back to the kernel when they are freed, and trims its heap's
top once it is free, so the next step's buffer is faulted in again, page by page (about 1.2 us a 4 KiB
page on the 2-core box: a Mixtral FULL_SHARD step faulted 17k pages, 20 ms of a 245 ms
step, where SHARD_GRAD_OP's faulted 3.7k and a REPLICATE one none). How many pages a step faults
depends on what was allocated and freed before (another program's step, the calibration), so it is
not a term a cost model can price; the calibration times its ops on buffers it reuses. With the mmap
threshold and the trim threshold at their largest, freed memory stays in the process for the next
step, and a step faults nothing once the heap has grown to its high-water mark, a few steps in (what a
GPU's caching allocator holds too). Tensor memory, what MemTracker and the cost model count, does not change.
"""

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST = 2**31 - 1
"""mallopt takes an int: buffers above 2 GiB are still mapped and unmapped each time."""

_kept = False


def keep_freed_host_memory() -> None:
    """Make glibc's malloc keep freed memory in this process (once; nothing on another C library)."""
    global _kept
    if _kept or not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    mallopt = (
        getattr(ctypes.CDLL(name), "mallopt", None) if name else None
    )  # glibc's; musl has none
    if mallopt is None:
        return
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _LARGEST)
    )
