"""HardwareProfile: the formulas on hand-made numbers, the JSON round trip, validation, lookup."""

import dataclasses
import functools
import json
import math
import operator
import os

import pytest
import torch

from shardplan.costmodel.hardware import (
    BUILTIN,
    COLLECTIVES,
    PROFILES_DIR,
    AttentionRate,
    CollectiveCost,
    HardwareProfile,
    LinkProfile,
    MatmulRate,
    SizeCurve,
    _figures,
    get_hardware,
    ring_factor,
)
from shardplan.errors import HardwareError


def make_profile(**changes) -> HardwareProfile:
    """Round numbers, so every expected value below is easy to compute by hand."""
    intra = LinkProfile(
        collectives={
            "all_gather_into_tensor": CollectiveCost(latency_s=1e-4, bus_bandwidth_bytes_per_s=1e9),
            "reduce_scatter_tensor": CollectiveCost(
                latency_s=2e-4, bus_bandwidth_bytes_per_s=0.5e9
            ),
            "all_reduce": CollectiveCost(
                latency_s=3e-4,
                bus_bandwidth_bytes_per_s=2e9,
                correction=SizeCurve(points=((1e6, 2.0), (1e8, 1.0))),
            ),
        }
    )
    inter = LinkProfile(
        collectives={
            kind: CollectiveCost(latency_s=1e-3, bus_bandwidth_bytes_per_s=1e8)
            for kind in COLLECTIVES
        }
    )
    fields = dict(
        name="hand-made",
        device_memory_bytes=10 * 2**30,
        usable_memory_fraction=0.8,
        matmul={
            "float32": MatmulRate(
                peak_flops_per_s=1e12, efficiency=SizeCurve(points=((1e6, 0.1), (1e10, 0.9)))
            ),
            "bfloat16": MatmulRate(
                peak_flops_per_s=4e12, efficiency=SizeCurve(points=((1.0, 0.5),))
            ),
        },
        memory_bandwidth_bytes_per_s=1e11,
        op_overhead_s=1e-5,
        devices_per_node=4,
        intra_node=intra,
        inter_node=inter,
        source="test",
    )
    fields.update(changes)
    return HardwareProfile(**fields)


def test_ring_factor():
    assert ring_factor("all_gather_into_tensor", 4) == pytest.approx(3 / 4)
    assert ring_factor("reduce_scatter_tensor", 8) == pytest.approx(7 / 8)
    assert ring_factor("all_reduce", 4) == pytest.approx(2 * 3 / 4)
    with pytest.raises(HardwareError, match="unknown collective 'all_to_all'"):
        ring_factor("all_to_all", 4)


def test_collective_time_alpha_beta_with_ring_factor():
    profile = make_profile()
    nbytes = 8e8
    assert profile.collective_time_s("all_gather_into_tensor", nbytes, 4) == pytest.approx(
        1e-4 + 8e8 * 0.75 / 1e9
    )
    assert profile.collective_time_s("reduce_scatter_tensor", nbytes, 2) == pytest.approx(
        2e-4 + 8e8 * 0.5 / 0.5e9
    )
    # all_reduce moves twice the bytes; 1.2e9 bus bytes is past the correction curve's end (factor 1).
    assert profile.collective_time_s("all_reduce", nbytes, 4) == pytest.approx(
        3e-4 + 8e8 * 1.5 / 2e9
    )


def test_collective_time_correction_is_log_interpolated():
    profile = make_profile()
    # Group of 2: bus bytes = nbytes / 2 * 2 = nbytes. 1e7 is halfway between 1e6 and 1e8 in log space,
    # so the correction is halfway between 2.0 and 1.0.
    expected = (3e-4 + 1e7 / 2e9) * 1.5
    assert profile.collective_time_s("all_reduce", 1e7, 2) == pytest.approx(expected)
    # Below the first point the factor is held at 2.0.
    assert profile.collective_time_s("all_reduce", 1e3, 2) == pytest.approx(
        (3e-4 + 1e3 / 2e9) * 2.0
    )


def test_collective_time_in_a_step_adds_the_links_wait():
    profile = make_profile(
        intra_node=dataclasses.replace(make_profile().intra_node, in_step_wait_s=5e-4)
    )
    own_s = 1e-4 + 8e8 * 0.75 / 1e9
    assert profile.collective_time_s(
        "all_gather_into_tensor", 8e8, 4, in_step=False
    ) == pytest.approx(own_s)
    assert profile.collective_time_s("all_gather_into_tensor", 8e8, 4) == pytest.approx(
        own_s + 5e-4
    )
    assert profile.collective_time_s("all_gather_into_tensor", 8e8, 8) == pytest.approx(
        1e-3 + 8e8 * 7 / 8 / 1e8
    )
    assert (
        profile.collective_time_s("all_gather_into_tensor", 8e8, 1) == 0.0
    )  # no collective, nothing to wait on


def test_collective_time_inter_node_and_trivial_cases():
    profile = make_profile()
    assert profile.collective_time_s("all_gather_into_tensor", 1e8, 8) == pytest.approx(
        1e-3 + 1e8 * 7 / 8 / 1e8
    )
    assert profile.collective_time_s("all_reduce", 1e8, 1) == 0.0
    assert profile.collective_time_s("all_reduce", 0, 8) == 0.0
    with pytest.raises(HardwareError, match="unknown collective"):
        profile.collective_time_s("broadcast", 1e8, 1)


def test_a_group_across_nodes_moves_its_bytes_over_the_rails_its_ranks_bring():
    rails = dataclasses.replace(
        make_profile().inter_node, rails=4, latency_per_node_doubling_s=2e-3
    )
    profile = make_profile(inter_node=rails)  # 4 devices a node
    bus = 1e8 * 15 / 16
    # 16 consecutive ranks fill 4 nodes: 4 ranks' links each, latency + 2 doublings of nodes
    assert profile.collective_time_s("all_gather_into_tensor", 1e8, 16) == pytest.approx(
        1e-3 + 2 * 2e-3 + bus / 4e8
    )
    # the same group with one rank a node (stages of a pipeline): one rank's links over 16 nodes
    assert profile.collective_time_s(
        "all_gather_into_tensor", 1e8, 16, ranks_per_node=1
    ) == pytest.approx(1e-3 + 4 * 2e-3 + bus / 1e8)
    # 2 ranks a node: half the rails; a group within one node never reads the inter-node link
    assert profile.collective_time_s(
        "all_gather_into_tensor", 1e8, 16, ranks_per_node=2
    ) == pytest.approx(1e-3 + 3 * 2e-3 + bus / 2e8)
    assert profile.collective_time_s("all_gather_into_tensor", 8e8, 4) == pytest.approx(
        1e-4 + 8e8 * 0.75 / 1e9
    )


def test_a_ring_across_nodes_waits_a_step_for_each_of_its_ranks_on_a_node():
    """NCCL's ring latency: a network hop per node and an NVLink step per further rank of the group on it. A
    group of 4 ranks a node (tp 2 beside it) over 32 nodes waits 3 steps a node fewer than one of 8; a
    pipeline's send (one rank a node) only the hop. The h100 figures keep the 79 us a node measured at 8."""
    link = BUILTIN["h100-80g"].inter_node
    cost = link.collectives["all_gather_into_tensor"]
    assert link.time_s("all_gather_into_tensor", 0.0, nodes=32, ranks_per_node=8) == pytest.approx(
        cost.latency_s + 31 * 79e-6, rel=1e-3
    )
    assert link.time_s("all_gather_into_tensor", 0.0, nodes=32, ranks_per_node=4) == pytest.approx(
        cost.latency_s + 31 * (29.3e-6 + 3 * 7.1e-6)
    )
    assert link.time_s("all_gather_into_tensor", 0.0, nodes=2, ranks_per_node=1) == pytest.approx(
        cost.latency_s + 29.3e-6
    )
    # all-reduce runs as NCCL's tree: its latency per doubling of nodes is what was measured with 8 ranks a node
    assert link.time_s("all_reduce", 0.0, nodes=32, ranks_per_node=4) == link.time_s(
        "all_reduce", 0.0, nodes=32, ranks_per_node=8
    )


def test_links_without_rails_price_a_group_across_nodes_as_before():
    """rails 1 and no latency growth (the defaults, the CPU profile): the plain alpha-beta of the link."""
    profile = make_profile()
    assert profile.collective_time_s("all_reduce", 1e8, 64) == pytest.approx(
        1e-3 + 1e8 * 2 * 63 / 64 / 1e8
    )
    assert profile.collective_time_s("all_reduce", 1e8, 64, ranks_per_node=1) == pytest.approx(
        1e-3 + 1e8 * 2 * 63 / 64 / 1e8
    )
    cpu = BUILTIN["cpu-gloo"]
    assert cpu.inter_node.rails == 1 and cpu.inter_node.latency_per_node_doubling_s == 0
    assert cpu.usable_memory_bytes == int(8 * 2**30 * 0.9)


def test_gloo_reduce_scatter_emulation_is_in_the_numbers():
    """Fitted on gloo, reduce_scatter has half all_gather's bus bandwidth: same formula, no special case."""
    profile = make_profile()
    gather = profile.collective_time_s("all_gather_into_tensor", 1e9, 2) - 1e-4
    scatter = profile.collective_time_s("reduce_scatter_tensor", 1e9, 2) - 2e-4
    assert scatter == pytest.approx(2 * gather)


def test_compute_time_roofline():
    profile = make_profile()
    # Arithmetic-bound: 1e10 FLOPs in one call, efficiency 0.9 at 1e10.
    assert profile.compute_time_s(1e10, 1e3) == pytest.approx(1e-5 + 1e10 / (1e12 * 0.9))
    # 1e8 FLOPs: halfway (log) between 1e6 and 1e10, efficiency 0.5.
    assert profile.compute_time_s(1e8, 0) == pytest.approx(1e-5 + 1e8 / (1e12 * 0.5))
    # Memory-bound: an elementwise op moving 1e9 bytes.
    assert profile.compute_time_s(1e6, 1e9) == pytest.approx(1e-5 + 1e9 / 1e11)
    assert profile.compute_time_s(0, 0) == 0.0


def test_compute_time_calls_and_dtype():
    profile = make_profile()
    # 100 calls of 1e8 FLOPs each: efficiency read at 1e8 (0.5), overhead paid 100 times.
    assert profile.compute_time_s(1e10, 0, calls=100) == pytest.approx(
        100 * 1e-5 + 1e10 / (1e12 * 0.5)
    )
    assert profile.compute_time_s(1e10, 0, torch.bfloat16) == pytest.approx(
        1e-5 + 1e10 / (4e12 * 0.5)
    )
    assert profile.compute_time_s(1e10, 0, "bfloat16") == profile.compute_time_s(
        1e10, 0, torch.bfloat16
    )
    with pytest.raises(
        HardwareError, match="no matmul figures for float16: it knows bfloat16, float32"
    ):
        profile.compute_time_s(1e10, 0, "float16")


def test_compute_time_op_factor_scales_the_roofline_not_the_fixed_cost():
    profile = make_profile(
        op_time_factors={
            "gelu": SizeCurve(points=((1e-3, 6.0), (1e-1, 4.0))),
            "mm": SizeCurve(points=((1.0, 1.5),)),
        }
    )
    # gelu: 2 calls moving 1e9 bytes, 5 ms each by roofline: 2 fixed costs + the factor at 5 ms x 10 ms
    factor = 6.0 + (4.0 - 6.0) * math.log(5e-3 / 1e-3) / math.log(1e-1 / 1e-3)  # log-interpolated
    assert profile.compute_time_s(0, 1e9, calls=2, op="gelu") == pytest.approx(
        2 * 1e-5 + factor * 1e9 / 1e11
    )
    assert profile.compute_time_s(0, 1e11, op="gelu") == pytest.approx(
        1e-5 + 4.0 * 1.0
    )  # past the last point
    # mm: arithmetic-bound, efficiency 0.9 at 1e10 FLOPs
    assert profile.compute_time_s(1e10, 1e3, op="mm") == pytest.approx(
        1e-5 + 1.5 * 1e10 / (1e12 * 0.9)
    )
    # an op no calibration measured is priced at its roofline
    assert (
        profile.compute_time_s(0, 1e9, op="add")
        == profile.compute_time_s(0, 1e9)
        == pytest.approx(1e-5 + 1e-2)
    )


def test_a_step_sustains_its_share_of_the_measured_matmul_rate():
    """Only the arithmetic slows at the power limit: the fixed cost and memory-bound ops do not."""
    sustained = make_profile(
        matmul={
            "float32": MatmulRate(
                peak_flops_per_s=1e12,
                efficiency=SizeCurve(points=((1e6, 0.1), (1e10, 0.9))),
                sustained_share=0.5,
            )
        }
    )
    assert sustained.compute_time_s(1e10, 1e3) == pytest.approx(1e-5 + 1e10 / (1e12 * 0.9 * 0.5))
    assert sustained.compute_time_s(1e6, 1e9) == make_profile().compute_time_s(1e6, 1e9)


def test_a_matmul_pays_its_exposed_share_of_its_memory_time_beside_its_arithmetic():
    """A GEMM of few FLOPs per byte runs slower than one of as many FLOPs and fewer bytes: its arithmetic
    plus the share of its memory time the pipeline does not hide. Memory-bound ops keep the roofline."""
    hidden, exposed = (
        make_profile(
            matmul={
                "float32": MatmulRate(
                    peak_flops_per_s=1e12,
                    efficiency=SizeCurve(points=((1.0, 0.5),)),
                    exposed_memory_share=share,
                )
            }
        )
        for share in (0.0, 0.25)
    )
    # 1e10 FLOPs at 0.5 of 1e12: 20 ms; 1e9 bytes at 1e11 B/s: 10 ms, a quarter of it shows
    assert exposed.compute_time_s(1e10, 1e9) == pytest.approx(1e-5 + 2e-2 + 0.25 * 1e-2)
    assert hidden.compute_time_s(1e10, 1e9) == pytest.approx(1e-5 + 2e-2)
    # a call bound by its bytes takes its memory time, no more
    assert exposed.compute_time_s(1e8, 1e10) == pytest.approx(1e-5 + 1e10 / 1e11)
    assert exposed.compute_time_s(0, 1e9) == hidden.compute_time_s(0, 1e9)


@pytest.mark.parametrize("share", [-0.1, 1.5, float("nan")])
def test_an_exposed_memory_share_outside_zero_to_one_is_refused(share):
    with pytest.raises(
        HardwareError, match=r"matmul\.float32\.exposed_memory_share is .*from 0 to 1"
    ):
        make_profile(
            matmul={
                "float32": MatmulRate(
                    peak_flops_per_s=1e12,
                    efficiency=SizeCurve(points=((1.0, 0.5),)),
                    exposed_memory_share=share,
                )
            }
        )


def test_gpu_profiles_fit_the_exposed_share_to_the_h100_gemm_table():
    """A pin of the profiles' data against its source: XLA's H100 GEMM table fits a third of a GEMM's memory
    time beside its arithmetic (h100-80g.json's sources); the A100s, without a table, carry it over."""
    for name in ("h100-80g", "h200", "a100-40g", "a100-80g"):
        rates = get_hardware(name).matmul
        assert rates["bfloat16"].exposed_memory_share == rates["float16"].exposed_memory_share
        assert rates["bfloat16"].exposed_memory_share == pytest.approx(0.325)
        assert rates["float32"].exposed_memory_share == 0.0
    assert get_hardware("cpu-gloo").matmul["float32"].exposed_memory_share == 0.0


def test_h100_and_h200_hold_the_published_power_limited_share_of_a_burst_matmul():
    """A pin of the profiles' data against its source (the mechanism is the test above): the best bf16 matmul of
    8 H200s (the H100's GH100 die at the same 700 W) computing together, 823.9 TFLOP/s in a burst, 698.6 held at
    the power limit (ml-engineering's mamf-finder, branch fast-mamf); XLA's table, the profiles' curve, has burst
    figures."""
    for name in ("h100-80g", "h200"):
        assert get_hardware(name).matmul["bfloat16"].sustained_share == pytest.approx(
            698.6 / 823.9, abs=5e-4
        )


def test_a_rate_slower_than_any_device_and_a_name_that_drives_the_terminal_are_refused():
    slow = LinkProfile(
        collectives={
            kind: CollectiveCost(latency_s=1e-3, bus_bandwidth_bytes_per_s=1e-300)
            for kind in COLLECTIVES
        }
    )
    with pytest.raises(
        HardwareError,
        match=r"inter_node\.collectives\..*bus_bandwidth_bytes_per_s is 1e-300, below",
    ):
        make_profile(inter_node=slow)
    with pytest.raises(HardwareError, match="memory_bandwidth_bytes_per_s is 1000.0, below"):
        make_profile(memory_bandwidth_bytes_per_s=1e3)
    with pytest.raises(HardwareError, match="holds control characters"):
        make_profile(name="gpu\x1b[2J")


def test_usable_memory():
    assert make_profile().usable_memory_bytes == int(10 * 2**30 * 0.8)
    # the runtime's own memory (CUDA context, NCCL buffers) comes off before the allocator's share
    assert make_profile(runtime_reserved_bytes=2**30).usable_memory_bytes == int(9 * 2**30 * 0.8)
    with pytest.raises(HardwareError, match="runtime_reserved_bytes .* leaves nothing"):
        make_profile(runtime_reserved_bytes=10 * 2**30)


@pytest.mark.parametrize(
    "profile",
    [
        *BUILTIN.values(),
        make_profile(),
        make_profile(
            name="with-op-factors",
            op_time_factors={"gelu": SizeCurve(points=((1e-5, 3.0), (1e-3, 2.5)))},
        ),
        make_profile(
            name="with-attention-rates",
            attention_rates={
                "_scaled_dot_product_flash_attention": AttentionRate(
                    causal={"64": SizeCurve(points=((512.0, 1e12), (4096.0, 2e12)))},
                    full={"128": SizeCurve(points=((1024.0, 3e12),))},
                )
            },
            skips_masked_flops=("_scaled_dot_product_flash_attention",),
        ),
    ],
    ids=lambda p: p.name,
)
def test_json_round_trip(profile):
    text = profile.to_json()
    again = HardwareProfile.from_json(text)
    assert again == profile
    assert again.to_json() == text
    assert json.loads(text)["schema"] == "shardplan.costmodel.hardware/1"


def test_builtin_profiles_are_sane():
    assert set(BUILTIN) >= {"a100-40g", "a100-80g", "h100-80g", "h200", "cpu-gloo"}
    for name, profile in BUILTIN.items():
        assert profile.name == name and profile.source
        # A bigger all-gather never takes less time, and bfloat16 is at least as fast as float32.
        times = [
            profile.collective_time_s("all_gather_into_tensor", 2**p, 8) for p in range(12, 31)
        ]
        assert times == sorted(times)
        assert profile.compute_time_s(1e12, 0, "bfloat16") <= profile.compute_time_s(
            1e12, 0, "float32"
        )
    assert (
        BUILTIN["h100-80g"].compute_time_s(1e15, 0, "bfloat16") > 1e15 / 989e12
    )  # never faster than peak


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_builtin_figures_name_their_sources(name):
    """Every figure of a built-in profile's file is covered by a "sources" entry for it or a field above it,
    and every entry names a field the profile has."""
    with open(os.path.join(PROFILES_DIR, f"{name}.json")) as file:
        data = json.load(file)
    for path, _ in _figures(BUILTIN[name], ""):
        assert any(path == key or path.startswith(f"{key}.") for key in data["sources"]), (
            f"{path} has no source"
        )
    for key in data["sources"]:
        functools.reduce(
            operator.getitem, key.split("."), data
        )  # a KeyError names a source of no field


_CURVE = {"points": [[512, 1e14], [4096, 2e14]]}
_RATES = {"causal": {"64": _CURVE}, "full": {"64": _CURVE}}
"""A fused attention op's rates as a profile's JSON spells them (HardwareProfile.attention_rates)."""


def _edited(mutate) -> str:
    data = json.loads(make_profile().to_json())
    mutate(data)
    return json.dumps(data)


@pytest.mark.parametrize(
    "mutate, fragments",
    [
        (
            lambda d: d.pop("memory_bandwidth_bytes_per_s"),
            ["lacks field memory_bandwidth_bytes_per_s", "shardplan calibrate"],
        ),
        (
            lambda d: d["intra_node"]["collectives"]["all_reduce"].pop("latency_s"),
            ["lacks field intra_node.collectives.all_reduce.latency_s"],
        ),
        (
            lambda d: d["intra_node"]["collectives"]["all_reduce"].update(latency_s=-1e-4),
            ["intra_node.collectives.all_reduce.latency_s is -0.0001", "positive"],
        ),
        (
            lambda d: d["matmul"]["float32"].update(peak_flops_per_s=0),
            ["matmul.float32.peak_flops_per_s is 0"],
        ),
        (
            lambda d: d.update(device_memory_bytes="80GB"),
            ["device_memory_bytes is '80GB'", "positive finite number"],
        ),
        (
            lambda d: d["matmul"]["float32"]["efficiency"].update(points=[[1e6, 0.1], [1e5, 0.9]]),
            [
                "matmul.float32.efficiency.points has sizes [1000000.0, 100000.0]",
                "strictly increasing",
            ],
        ),
        (
            lambda d: d["matmul"]["float32"]["efficiency"].update(points=[[1e6, -0.1]]),
            ["matmul.float32.efficiency.points[0][1] is -0.1"],
        ),
        (
            lambda d: d["inter_node"]["collectives"].pop("reduce_scatter_tensor"),
            ["inter_node.collectives lacks reduce_scatter_tensor"],
        ),
        (
            lambda d: d.update(usable_memory_fraction=1.5),
            ["usable_memory_fraction is 1.5", "at most 1"],
        ),
        (
            lambda d: d.update(runtime_reserved_bytes=-1),
            ["runtime_reserved_bytes is -1", "0 or more"],
        ),
        (
            lambda d: d["inter_node"].update(latency_per_node_doubling_s=-1e-3),
            ["inter_node.latency_per_node_doubling_s is -0.001", "0 or more"],
        ),
        (lambda d: d["inter_node"].update(rails=0), ["inter_node.rails is 0", "positive"]),
        (
            lambda d: d["inter_node"].update(ring_latency_per_local_rank_s=-1e-6),
            ["inter_node.ring_latency_per_local_rank_s is -1e-06", "0 or more"],
        ),
        (lambda d: d.update(peak_flops=1e12), ["unknown field peak_flops"]),
        (
            lambda d: d.update(devices_per_node=8.0),
            ["devices_per_node is 8.0, must be a whole number"],
        ),
        (
            lambda d: d.update(device_memory_bytes=8e9),
            ["device_memory_bytes is 8000000000.0, must be a whole number"],
        ),
        (
            lambda d: d.update(runtime_reserved_bytes=1e6),
            ["runtime_reserved_bytes is 1000000.0, must be a whole number"],
        ),
        (
            lambda d: d["inter_node"].update(rails=True),
            ["inter_node.rails is True, must be a positive finite number"],
        ),
        (
            lambda d: d.update(device_memory_bytes=10**400),
            ["device_memory_bytes is 1000000000", "positive finite number"],
        ),
        (
            lambda d: d.update(memory_bandwidth_bytes_per_s=10**400),
            ["memory_bandwidth_bytes_per_s is 10000000"],
        ),
        (
            lambda d: d.update(runtime_reserved_bytes=10**400),
            ["runtime_reserved_bytes is 10000000", "0 or more"],
        ),
        (
            lambda d: d.update(name=7),
            ["field name is 7, must be a string"],
        ),  # plans copy it: they would not load
        (
            lambda d: d.update(source={"by": "me"}),
            ["field source is {'by': 'me'}, must be a string"],
        ),
        (
            lambda d: d.update(device_memory_bytes=2**51),
            ["device_memory_bytes 2251799813685248 is more than 1 PiB"],
        ),
        (
            lambda d: d.update(schema="shardplan.costmodel.hardware/0"),
            ["schema 'shardplan.costmodel.hardware/0'"],
        ),
        (
            lambda d: d.update(schema="shardplan.costmodel.hardware/2"),
            [
                "schema 'shardplan.costmodel.hardware/2' is not supported by this shardplan",
                "install the version that wrote it",
            ],
        ),
        (lambda d: d.update(matmul=[]), ["matmul must be a JSON object"]),
        (
            lambda d: d.update(op_time_factors={"gelu": {"points": [[1e-4, 0]]}}),
            ["op_time_factors.gelu.points[0][1] is 0", "positive"],
        ),
        (
            lambda d: d.update(op_time_factors={"gelu": 2.5}),
            ["op_time_factors.gelu must be a JSON object"],
        ),
        (lambda d: d.update(op_time_factors=[2.0]), ["op_time_factors must be a JSON object"]),
        (
            lambda d: d["intra_node"].update(in_step_wait_s=-1e-3),
            ["intra_node.in_step_wait_s is -0.001", "0 or more"],
        ),
        (
            lambda d: d.update(collective_compute_share=1.0),
            ["collective_compute_share is 1.0", "below 1"],
        ),
        (
            lambda d: d.update(collective_compute_share=-0.1),
            ["collective_compute_share is -0.1", "0 or more"],
        ),
        (
            lambda d: d["matmul"]["float32"].update(sustained_share=1.2),
            ["matmul.float32.sustained_share is 1.2", "at most 1"],
        ),
        (
            lambda d: d["matmul"]["float32"].update(sustained_share=0),
            ["matmul.float32.sustained_share is 0", "positive"],
        ),
        (
            lambda d: d["inter_node"].update(
                bandwidth_by_nodes={"all_reduce": {"points": [[2, 0]]}}
            ),
            ["inter_node.bandwidth_by_nodes.all_reduce.points[0][1] is 0", "positive"],
        ),
        (
            lambda d: d["inter_node"].update(
                bandwidth_by_nodes={"all_reduce": {"points": [[2, 1.0], [8, 1.5]]}}
            ),
            ["inter_node.bandwidth_by_nodes.all_reduce has a share above 1", "at most 1"],
        ),
        (
            lambda d: d["inter_node"].update(
                bandwidth_by_nodes={"broadcast": {"points": [[2, 0.5]]}}
            ),
            ["inter_node.bandwidth_by_nodes names 'broadcast'", "use one of"],
        ),
        (
            lambda d: d["inter_node"].update(bandwidth_by_nodes=[0.5]),
            ["inter_node.bandwidth_by_nodes must be a JSON object"],
        ),
        (
            lambda d: d.update(skips_masked_flops="_scaled_dot_product_flash_attention"),
            [
                "skips_masked_flops is '_scaled_dot_product_flash_attention'",
                "make it a list of op names",
            ],
        ),
        (
            lambda d: d.update(
                op_time_factors={"_scaled_dot_product_flash_attention": {"points": [[1e-4, 1.5]]}},
                skips_masked_flops=["_scaled_dot_product_flash_atention"],
            ),
            [
                "skips_masked_flops names _scaled_dot_product_flash_atention, which neither op_time_factors nor "
                "attention_rates keys",
                "spell each as they key it",
            ],
        ),
        (
            lambda d: d.update(
                skips_masked_flops=["_scaled_dot_product_flash_attention"]
            ),  # an alias target, no factors
            [
                "skips_masked_flops names _scaled_dot_product_flash_attention, which neither op_time_factors nor"
            ],
        ),
        (
            lambda d: d.update(attention_rates={"_scaled_dot_product_flash_attention": _RATES}),
            [
                "attention_rates keys _scaled_dot_product_flash_attention, which skips_masked_flops does not list",
                "list it there",
            ],
        ),
        (
            lambda d: d.update(
                attention_rates={
                    "_scaled_dot_product_flash_attention": {**_RATES, "full": {"d64": _CURVE}}
                },
                skips_masked_flops=["_scaled_dot_product_flash_attention"],
            ),
            [
                "attention_rates._scaled_dot_product_flash_attention.full is keyed by ['d64']",
                "decimal digits",
            ],
        ),
        (
            lambda d: d.update(
                attention_rates={"_scaled_dot_product_flash_attention": {**_RATES, "causal": {}}},
                skips_masked_flops=["_scaled_dot_product_flash_attention"],
            ),
            [
                "attention_rates._scaled_dot_product_flash_attention.causal is keyed by []",
                "at least one",
            ],
        ),
        (
            lambda d: d.update(
                attention_rates={"_scaled_dot_product_flash_attention": {"causal": {"64": _CURVE}}},
                skips_masked_flops=["_scaled_dot_product_flash_attention"],
            ),
            ["lacks field attention_rates._scaled_dot_product_flash_attention.full"],
        ),
        (
            lambda d: d.update(
                attention_rates={
                    "_scaled_dot_product_flash_attention": {
                        "causal": {"64": {"points": [[512, 0]]}},
                        "full": {"64": _CURVE},
                    }
                },
                skips_masked_flops=["_scaled_dot_product_flash_attention"],
            ),
            [
                "attention_rates._scaled_dot_product_flash_attention.causal.64.points[0][1] is 0",
                "positive",
            ],
        ),
    ],
)
def test_validation_errors(mutate, fragments):
    with pytest.raises(HardwareError) as error:
        HardwareProfile.from_json(_edited(mutate))
    for fragment in fragments:
        assert fragment in str(error.value)


FLASH, CPU_FLASH = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def test_a_profile_without_skips_writes_none_so_code_before_them_loads_it():
    """`skips_masked_flops` joined the fields under the same schema id; a profile that lists none (every calibration's)
    leaves the key out, and code that does not know it rejects no field of such a file. One that lists skips writes
    them and reads them back."""
    plain = make_profile(op_time_factors={"gelu": SizeCurve(points=((1e-4, 2.5),))})
    assert "skips_masked_flops" not in json.loads(plain.to_json())
    assert HardwareProfile.from_json(plain.to_json()) == plain
    skipping = make_profile(
        op_time_factors={FLASH: SizeCurve(points=((1.0, 2.0),))}, skips_masked_flops=(FLASH,)
    )
    assert json.loads(skipping.to_json())["skips_masked_flops"] == [FLASH]
    assert HardwareProfile.from_json(skipping.to_json()) == skipping


def test_a_cpu_attention_call_takes_its_gpu_names_factor_and_skip_unless_the_profile_keys_its_own_name():
    """bfloat16 at 2e12 FLOP/s: 2e12 FLOPs take 1 s by roofline, the 1e12 a causal mask hides half of it; each call
    adds op_overhead_s (1e-5 s). CPU's flash op on a profile that keys only the GPU's name takes that name's factor
    (2) and skip; on one that keys CPU's name too, its own factor (3) on every FLOP; on one that keys neither, the
    roofline on every FLOP. A name no alias reaches skips under its own name (1.5 x half)."""

    def time_s(profile: HardwareProfile, op: str) -> float:
        return profile.compute_time_s(2e12, 0, "bfloat16", op=op, masked_flops=1e12)

    gpu = make_profile(
        op_time_factors={FLASH: SizeCurve(points=((1.0, 2.0),))}, skips_masked_flops=(FLASH,)
    )
    assert time_s(gpu, CPU_FLASH) == pytest.approx(1e-5 + 2.0 * 0.5)
    both = make_profile(
        op_time_factors={
            FLASH: SizeCurve(points=((1.0, 2.0),)),
            CPU_FLASH: SizeCurve(points=((1.0, 3.0),)),
        },
        skips_masked_flops=(FLASH,),
    )
    assert time_s(both, CPU_FLASH) == pytest.approx(1e-5 + 3.0 * 1.0)
    assert time_s(make_profile(), CPU_FLASH) == pytest.approx(1e-5 + 1.0)
    efficient = "_scaled_dot_product_efficient_attention"
    own = make_profile(
        op_time_factors={efficient: SizeCurve(points=((1.0, 1.5),))},
        skips_masked_flops=(efficient,),
    )
    assert time_s(own, efficient) == pytest.approx(1e-5 + 1.5 * 0.5)


def test_a_profile_without_attention_rates_writes_none_so_code_before_them_loads_it():
    """`attention_rates` joined the fields under the same schema id, as skips_masked_flops did: a profile without
    them (every calibration's) leaves the key out; one with them writes them and reads them back."""
    assert "attention_rates" not in json.loads(make_profile().to_json())
    rates = AttentionRate(
        causal={"64": SizeCurve(points=((512.0, 1e12),))},
        full={"64": SizeCurve(points=((512.0, 2e12),))},
    )
    with_rates = make_profile(attention_rates={FLASH: rates}, skips_masked_flops=(FLASH,))
    assert set(json.loads(with_rates.to_json())["attention_rates"]) == {FLASH}
    assert HardwareProfile.from_json(with_rates.to_json()) == with_rates


def test_an_attention_call_runs_at_the_rate_of_the_sequence_its_flops_and_bytes_give():
    """bfloat16 at 4e12 FLOP/s peak (efficiency 0.5: a matmul of any size runs 2e12). A causal forward of one
    sequence of 1024, one head of 64, counts 4 x 1024^2 x 64 FLOPs over 4 x 1024 x 64 elements of 2 bytes, so
    reads as 1024 keys, where the rates say 1e12 FLOP/s (halfway in log between 512 and 2048); of its FLOPs the
    causal half runs. Without a mask the same call runs all of them at the full rate, 1.5e12; as a backward
    (10 x 1024^2 x 64 FLOPs over 8 tensors) at the backward's rates. A rate above the matmul curve's is capped
    by it: a call too small to fill the device runs no faster than a GEMM of its FLOPs."""
    forward, backward = FLASH, f"{FLASH}_backward"
    curve = SizeCurve(points=((512.0, 0.5e12), (2048.0, 1.5e12)))
    profile = make_profile(
        attention_rates={
            forward: AttentionRate(
                causal={"64": curve}, full={"64": SizeCurve(points=((1.0, 1.5e12),))}
            ),
            backward: AttentionRate(
                causal={"64": SizeCurve(points=((1.0, 0.8e12),))},
                full={"64": SizeCurve(points=((1.0, 5e12),))},
            ),
        },
        skips_masked_flops=(forward, backward),
    )
    flops, nbytes = 4 * 1024**2 * 64, 4 * 1024 * 64 * 2
    causal_s = profile.compute_time_s(flops, nbytes, "bfloat16", op=forward, masked_flops=flops / 2)
    assert causal_s == pytest.approx(1e-5 + flops / 2 / 1e12)
    assert (
        profile.compute_time_s(flops, nbytes, "bfloat16", op=CPU_FLASH, masked_flops=flops / 2)
        == causal_s
    )
    assert profile.compute_time_s(flops, nbytes, "bfloat16", op=forward) == pytest.approx(
        1e-5 + flops / 1.5e12
    )
    back_flops = 2.5 * flops
    assert profile.compute_time_s(
        back_flops, 2 * nbytes, "bfloat16", op=backward, masked_flops=back_flops / 2
    ) == pytest.approx(1e-5 + back_flops / 2 / 0.8e12)
    assert profile.compute_time_s(back_flops, 2 * nbytes, "bfloat16", op=backward) == pytest.approx(
        1e-5 + back_flops / 2e12
    )  # 5e12 published, above the matmul curve's 2e12


def test_attention_rates_between_and_past_the_listed_head_dims():
    """A known head dim reads its own curve, one between two listed ones linear in head dim, one past them the
    nearest; an unknown one (0) the mean of every listed head dim's rate."""
    rate = AttentionRate(
        causal={"64": SizeCurve(points=((1.0, 1e12),)), "128": SizeCurve(points=((1.0, 2e12),))},
        full={"64": SizeCurve(points=((1.0, 1e12),))},
    )
    assert [
        rate.flops_per_s(4096, causal=True, head_dim=dim) for dim in (32, 64, 96, 128, 256)
    ] == [1e12, 1e12, 1.5e12, 2e12, 2e12]
    assert rate.flops_per_s(4096, causal=True) == 1.5e12
    assert rate.flops_per_s(4096, causal=False) == 1e12


def test_a_profile_written_before_op_factors_loads_without_them():
    data = json.loads(
        make_profile(op_time_factors={"gelu": SizeCurve(points=((1e-4, 2.5),))}).to_json()
    )
    data.pop("op_time_factors")
    assert HardwareProfile.from_json(json.dumps(data)) == make_profile()


def test_a_profile_written_before_sustained_shares_computes_at_its_measured_rate():
    data = json.loads(make_profile().to_json())
    for rate in data["matmul"].values():
        rate.pop("sustained_share")
    assert HardwareProfile.from_json(json.dumps(data)) == make_profile()
    assert make_profile().matmul["float32"].sustained_share == 1.0


HALVED_FROM_2_TO_8_NODES = {"all_reduce": SizeCurve(points=((2.0, 1.0), (8.0, 0.5)))}


def test_the_fabrics_bandwidth_by_nodes_slows_collectives_across_nodes_only():
    """Groups of 4 ranks a node: 8 ranks span 2 nodes (share 1), 32 ranks span 8 (0.5), 16 ranks 4 nodes (0.75: linear
    in log nodes), 64 ranks 16 (held at 0.5 past the end); the latency is not divided, a kind not listed keeps its
    bandwidth, and within a node the curve is never read."""
    plain = make_profile()
    curved = make_profile(
        inter_node=dataclasses.replace(
            plain.inter_node, bandwidth_by_nodes=HALVED_FROM_2_TO_8_NODES
        ),
        intra_node=dataclasses.replace(
            plain.intra_node, bandwidth_by_nodes=HALVED_FROM_2_TO_8_NODES
        ),
    )
    for ranks, share in ((8, 1.0), (16, 0.75), (32, 0.5), (64, 0.5)):
        expected = 1e-3 + 1e8 * ring_factor("all_reduce", ranks) / (1e8 * share)
        assert curved.collective_time_s("all_reduce", 1e8, ranks) == pytest.approx(expected)
    assert curved.collective_time_s("all_gather_into_tensor", 1e8, 32) == plain.collective_time_s(
        "all_gather_into_tensor", 1e8, 32
    )
    assert curved.collective_time_s("all_reduce", 1e8, 4) == plain.collective_time_s(
        "all_reduce", 1e8, 4
    )
    assert curved.intra_node.time_s("all_reduce", 1e8, nodes=1) == plain.intra_node.time_s(
        "all_reduce", 1e8, nodes=1
    )


def test_a_fabrics_measured_bandwidth_gives_the_share_that_reproduces_it():
    """A 4-node all-reduce of 1e8 bytes over 16 ranks (1.875e8 bus bytes) measured at 5e7 bus bytes/s took 3.75 s;
    the link's latency (1 ms) is taken out before the share is read, so the model takes those 3.75 s again. A
    measurement faster than the link keeps the whole bandwidth (at most 1); the kinds not measured keep no curve."""
    link = make_profile().inter_node.with_fabric(
        {"all_reduce": {2: 2e8, 4: 5e7}}, nbytes=1e8, ranks_per_node=4
    )
    assert link.bandwidth_by_nodes["all_reduce"].points == (
        (2.0, 1.0),
        (4.0, pytest.approx(1.875 / (3.75 - 1e-3))),
    )
    assert link.time_s("all_reduce", 1.875e8, nodes=4, ranks_per_node=4) == pytest.approx(3.75)
    assert set(link.bandwidth_by_nodes) == {"all_reduce"}


def test_a_fabrics_curve_survives_the_json_round_trip_and_a_profile_without_one_loads_as_before():
    curved = make_profile(
        inter_node=dataclasses.replace(
            make_profile().inter_node, bandwidth_by_nodes=HALVED_FROM_2_TO_8_NODES
        )
    )
    assert HardwareProfile.from_json(curved.to_json()) == curved
    data = json.loads(make_profile().to_json())
    for link in ("intra_node", "inter_node"):
        data[link].pop("bandwidth_by_nodes")
    assert HardwareProfile.from_json(json.dumps(data)) == make_profile()


def test_validation_on_construction():
    with pytest.raises(HardwareError, match="op_overhead_s is nan"):
        make_profile(op_overhead_s=math.nan)
    with pytest.raises(HardwareError, match="matmul lists no dtype"):
        make_profile(matmul={})


def test_not_json():
    with pytest.raises(HardwareError, match="not valid JSON"):
        HardwareProfile.from_json('{"name": ')


def test_get_hardware(tmp_path):
    assert get_hardware("h100-80g") is BUILTIN["h100-80g"]
    profile = make_profile()
    assert get_hardware(profile) is profile
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    assert get_hardware(path) == profile
    assert get_hardware(str(path)) == profile
    with pytest.raises(HardwareError, match="unknown hardware 'h100'.*did you mean 'h100-80g'"):
        get_hardware("h100")
    with pytest.raises(HardwareError, match="unknown hardware 'tpu-v9'.*shardplan calibrate"):
        get_hardware("tpu-v9")
    (tmp_path / "broken.json").write_text(profile.to_json()[:100])
    with pytest.raises(HardwareError, match="not valid JSON"):
        get_hardware(tmp_path / "broken.json")


def test_profiles_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_profile().name = "other"


def test_attention_rates_past_the_longest_sequence_rise_toward_a_ceiling():
    """Past its longest point a rising curve continues as ceiling x S / (S + S0) through its last two points
    (S0 = 1024 here: 1 / (1 + 1024 / S) at 1k, 2k, 4k); a flat or falling one holds its last rate."""
    rising = SizeCurve(points=((1024.0, 0.5e12), (2048.0, 2e12 / 3)))
    flat = SizeCurve(points=((1024.0, 1e12), (2048.0, 1e12)))
    rate = AttentionRate(causal={"64": rising}, full={"64": flat})
    assert rate.flops_per_s(2048, causal=True) == pytest.approx(2e12 / 3)
    assert rate.flops_per_s(4096, causal=True) == pytest.approx(0.8e12)
    assert rate.flops_per_s(1e9, causal=True) == pytest.approx(1e12, rel=1e-5)
    assert rate.flops_per_s(65536, causal=False) == 1e12
