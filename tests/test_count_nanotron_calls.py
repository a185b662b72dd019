"""benchmarks/count_nanotron_calls.py against what bench_published.py prices: NANOTRON_HOST_CALLS are the calls
nanotron's own code dispatches when it runs. Needs the local git mirrors the script reads (CI has none: skipped)."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "count_nanotron_calls.py"
)
MIRRORS = (
    "/work/.mirror/huggingface+nanotron/repo",
    "/work/.mirror/Dao-AILab+flash-attention/repo",
)

pytestmark = [
    pytest.mark.skipif(
        not all(os.path.isdir(m) for m in MIRRORS),
        reason="no local git mirror of nanotron or flash-attention",
    ),
    pytest.mark.distributed,
    pytest.mark.slow,
]


def counted(*args: str) -> list[dict[str, float]]:
    """Each rank's ATen calls a micro-batch by block, as the script prints them."""
    out = subprocess.run(
        [sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=240, check=True
    ).stdout
    prefix = "ATen calls a micro-batch: "
    return [
        {block: float(n) for block, n in (part.split() for part in line[len(prefix) :].split(", "))}
        for line in out.splitlines()
        if line.startswith(prefix)
    ]


def test_the_priced_calls_are_what_the_busiest_tensor_parallel_rank_dispatches(published_bench):
    ranks = counted("--tp", "4")
    assert [rank["layer"] for rank in ranks] == [
        204,
        220,
        220,
        204,
    ]  # only middle ranks compute both side shards
    busiest = max(ranks, key=lambda rank: rank["layer"])
    assert busiest["layer"] == published_bench.NANOTRON_HOST_CALLS["layer"]
    assert busiest["embedding"] == published_bench.NANOTRON_HOST_CALLS["embedding"]
    assert busiest["head"] + busiest["engine"] == published_bench.NANOTRON_HOST_CALLS["head"]


def test_a_stage_boundary_is_priced_at_what_each_side_of_it_dispatches(published_bench):
    stages = counted("--pp", "2")
    assert [stage["boundary"] for stage in stages] == [
        published_bench.NANOTRON_HOST_CALLS["boundary"]
    ] * 2
