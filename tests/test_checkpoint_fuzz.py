"""Fuzzing the checkpoint loader: structure-aware mutations of one saved checkpoint's files.

One tiny GPT is saved once, in this process (a gloo world of one). Each example copies the checkpoint,
mutates shardplan.json, the DCP metadata or a shard (as damage would, or as an attacker would, who
also rewrites the manifest's checksums so the loader gets past them), and loads it. Every load either
succeeds or raises a ShardplanError of one line, and a failed load leaves the program and the
optimizer as they were (see [Note: load as a transaction] in shardplan/runtime/checkpoint.py).
"""

import copy
import datetime
import hashlib
import json
import pickle
import shutil
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from shardplan.errors import ShardplanError
from shardplan.models import zoo
from shardplan.plan import ShardStrategy
from shardplan.runtime import checkpoint, manual_plan, parallelize

CONFIG = zoo.GPTConfig(vocab_size=16, seq_len=4, n_layer=1, n_head=1, d_model=4)
GROUPS = [("wte", "wpe"), ("h.0",), ("ln_f", "lm_head")]
STRATEGIES = (ShardStrategy.REPLICATE, ShardStrategy.FULL_SHARD, ShardStrategy.SHARD_OPTIMIZER)
FUZZ = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
"""Deterministic examples (the same in every CI run), four tests × 250: about 20 s on one core."""

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8)
    | st.sampled_from(["float32", "load", "shaped", "scalar", ".metadata", "../x"]),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(program, optimizer, the checkpoint's directory, a snapshot of the program's and optimizer's state)."""
    dist.init_process_group(
        "gloo",
        store=dist.HashStore(),  # in this process: no TCP port another world could take first
        rank=0,
        world_size=1,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.manual_seed(0)
        model = zoo.gpt(CONFIG).model
        program = parallelize(model, manual_plan(model, GROUPS, dp=1, strategies=STRATEGIES))
        optimizer = torch.optim.AdamW(program.parameters(), lr=1e-2)
        ids = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))
        program.step(ids, labels=ids)
        optimizer.step()
        optimizer.zero_grad()
        directory = tmp_path_factory.mktemp("fuzz") / "base"
        program.save(directory, optimizer)
        yield program, optimizer, directory, snapshot(program, optimizer)
    finally:
        dist.destroy_process_group()


def snapshot(program, optimizer) -> tuple:
    return (program.export_full_state_dict(), copy.deepcopy(optimizer.state_dict()))


def same(first: tuple, second: tuple) -> bool:
    return (
        repr(first[1]["param_groups"]) == repr(second[1]["param_groups"])
        and all(torch.equal(first[0][key], second[0][key]) for key in first[0])
        and all(
            all(
                torch.equal(torch.as_tensor(value), torch.as_tensor(second[1]["state"][index][key]))
                for key, value in state.items()
            )
            for index, state in first[1]["state"].items()
        )
    )


def load_mutated(saved, tmp_path, mutate) -> None:
    """Copy the checkpoint, `mutate(directory)`, load: success, or one line of ShardplanError and no change."""
    program, optimizer, base, before = saved
    directory = tmp_path / "mutated"
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(base, directory)
    mutate(directory)
    try:
        program.load(directory, optimizer)
    except ShardplanError as error:
        assert "\n" not in str(error), str(error)
        assert same(snapshot(program, optimizer), before), (
            f"a failed load changed the state: {error}"
        )
        return
    program.load(
        base, optimizer
    )  # a mutation that still loads (a learning rate, say): back to the base


def restamp(directory: Path, name: str) -> None:
    """Rewrite `name`'s manifest entry, as an attacker who changed it would."""
    file = directory / checkpoint.METADATA_FILE
    metadata = json.loads(file.read_text())
    data = (directory / name).read_bytes()
    metadata.setdefault("files", {})[name] = {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    file.write_text(json.dumps(metadata))


def damaged(data: bytes, where: float, how: str, value: int) -> bytes:
    at = min(int(where * len(data)), len(data) - 1)
    if how == "flip":
        return data[:at] + bytes([data[at] ^ (value or 1)]) + data[at + 1 :]
    if how == "truncate":
        return data[:at]
    return data[:at] + bytes([value]) * 64 + data[at:]


BYTE_DAMAGE = (
    st.floats(0, 1),
    st.sampled_from(["flip", "truncate", "insert"]),
    st.integers(0, 255),
)


@FUZZ
@given(data=st.data())
def test_mutated_shardplan_json(saved, tmp_path, data):
    """Replace, drop or deepen a value anywhere in shardplan.json's tree, or damage its bytes."""

    def mutate(directory: Path) -> None:
        file = directory / checkpoint.METADATA_FILE
        if data.draw(st.booleans(), label="as bytes"):
            file.write_bytes(damaged(file.read_bytes(), *(data.draw(s) for s in BYTE_DAMAGE)))
            return
        tree = json.loads(file.read_text())
        parent, key = None, None
        node = tree
        while (
            isinstance(node, (dict, list))
            and node
            and data.draw(st.integers(0, 3), label="descend") > 0
        ):
            parent = node
            key = data.draw(
                st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node)))
            )
            node = node[key]
        action = data.draw(st.sampled_from(["replace", "drop", "deepen"]), label="action")
        if parent is None:
            tree = (
                data.draw(JSON_VALUES)
                if action == "replace"
                else [tree]
                if action == "deepen"
                else {}
            )
        elif action == "replace":
            parent[key] = data.draw(JSON_VALUES, label="value")
        elif action == "drop":
            del parent[key]
        else:
            parent[key] = json.loads("[" * 40 + json.dumps(parent[key]) + "]" * 40)
        file.write_text(json.dumps(tree))

    load_mutated(saved, tmp_path, mutate)


def dcp_metadata(directory: Path):
    with open(directory / ".metadata", "rb") as handle:
        return pickle.load(handle)  # this test's own checkpoint: trusted


@FUZZ
@given(data=st.data())
def test_mutated_dcp_metadata(saved, tmp_path, data):
    """Change a field of the DCP metadata to an odd value, or a class it never holds, with a matching manifest."""

    def mutate(directory: Path) -> None:
        metadata = dcp_metadata(directory)
        fqn = data.draw(st.sampled_from(sorted(metadata.state_dict_metadata)), label="entry")
        entry = metadata.state_dict_metadata[fqn]
        index = data.draw(st.sampled_from(sorted(metadata.storage_data, key=str)), label="storage")
        info = metadata.storage_data[index]
        odd = st.one_of(
            st.integers(-3, 2**40),
            st.none(),
            st.text(max_size=4),
            st.just(torch.Size([2, 2])),
            st.just([]),
            st.just(torch.float16),
            st.just(BytesStorageMetadata()),
        )
        field = data.draw(
            st.sampled_from(
                [
                    "size",
                    "chunk offsets",
                    "chunk sizes",
                    "chunks",
                    "dtype",
                    "entry",
                    "path",
                    "offset",
                    "length",
                    "transform",
                    "storage key",
                    "drop storage",
                    "foreign class",
                ]
            ),
            label="field",
        )
        value = data.draw(odd, label="value")
        if field == "size":
            entry.size = value
        elif field in ("chunk offsets", "chunk sizes"):
            setattr(entry.chunks[0], field.split()[1], value)
        elif field == "chunks":
            entry.chunks = value if data.draw(st.booleans()) else entry.chunks * 2
        elif field == "dtype":
            entry.properties.dtype = value
        elif field == "entry":
            metadata.state_dict_metadata[fqn] = value
        elif field in ("path", "offset", "length"):
            setattr(info, {"path": "relative_path"}.get(field, field), value)
        elif field == "transform":
            info.transform_descriptors = ["zstd"]
        elif field == "storage key":
            metadata.storage_data[repr(value)] = metadata.storage_data.pop(index)
        elif field == "drop storage":
            del metadata.storage_data[index]
        else:
            metadata.planner_data = collections_counter()
        (directory / ".metadata").write_bytes(pickle.dumps(metadata))
        restamp(directory, ".metadata")

    load_mutated(saved, tmp_path, mutate)


def collections_counter():
    import collections

    return collections.Counter("a class DCP metadata never holds")


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp"])
@FUZZ
@given(restamped=st.booleans(), damage=st.tuples(*BYTE_DAMAGE))
def test_damaged_file_bytes(saved, tmp_path, name, restamped, damage):
    """Damaged bytes of the DCP metadata or a shard: caught by the checksum, or, with the manifest rewritten,
    by the restricted unpickler or torch.load(weights_only=True)."""

    def mutate(directory: Path) -> None:
        file = directory / name
        file.write_bytes(damaged(file.read_bytes(), *damage))
        if restamped:
            restamp(directory, name)

    load_mutated(saved, tmp_path, mutate)


def test_a_huge_memo_index_is_refused_at_once(tmp_path):
    """Found by this fuzz test: four flipped bytes naming memo slot 1.4e9 made the C unpickler zero 11 GB
    for over a minute (slot 3e8: 2.4 GB, 3.5 s here); the metadata reader answers in milliseconds."""
    from shardplan.errors import CheckpointError
    from shardplan.runtime.dcp_storage import read_dcp_metadata

    file = tmp_path / ".metadata"
    file.write_bytes(
        pickle.PROTO
        + b"\x04"
        + pickle.EMPTY_DICT
        + pickle.LONG_BINPUT
        + (300_000_000).to_bytes(4, "little")
        + pickle.STOP
    )
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match="is not the DCP metadata"):
            read_dcp_metadata(file, {})
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_bytes < 2**20  # no memo sized by the index
