"""torch.distributed.checkpoint storage that runs no code from a checkpoint's files (see [Note: trust model]).

[Note: trust model] DCP keeps its `.metadata` as a pickle, and unpickling runs
whatever callables the file names. Here it is read by an Unpickler whose
find_class knows only DCP's metadata dataclasses, torch.Size, torch dtypes and
layouts and pathlib's pure paths; everything else is refused before it is
looked up. The result is then checked field by field against what shardplan
writes (tensor entries only, chunks that tile each tensor, storage inside the
checkpoint's listed files, no stream transforms) and rebuilt from fresh
objects, so DCP sees nothing the file built. Tensor data is read by DCP's
FileSystemReader with torch.load(weights_only=True); byte entries, which DCP
reads with a full unpickler, are refused as metadata. The checksums in
`shardplan.json` detect corruption and mix-ups, not malice: whoever can write
the files can write the manifest too.
"""

import io
import os
import pathlib
import pickle
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from shardplan.common.files import open_regular_file
from shardplan.errors import CheckpointError

DCP_METADATA_FILE = ".metadata"
DCP_METADATA_LIMIT_BYTES = 1 << 30
"""Largest `.metadata` read: a few hundred bytes per chunk, so a million chunks fit."""

_METADATA_CLASSES = {
    cls.__name__: cls
    for cls in (
        Metadata,
        TensorStorageMetadata,
        BytesStorageMetadata,
        TensorProperties,
        ChunkStorageMetadata,
        MetadataIndex,
        StorageMeta,
        _MEM_FORMAT_ENCODING,
    )
}
_PURE_PATHS = {
    "PosixPath": pathlib.PurePosixPath,
    "PurePosixPath": pathlib.PurePosixPath,
    "WindowsPath": pathlib.PureWindowsPath,
    "PureWindowsPath": pathlib.PureWindowsPath,
}
"""The saving run's checkpoint_id, unused here: built as a pure path, which touches no file."""


class _MetadataUnpickler(pickle._Unpickler):
    """Python's own unpickler, not the C one: the C one sizes its memo by the largest index a file names,
    so four flipped bytes ask for gigabytes and a minute of zeroing; this one keeps its memo in a dict."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES:
            return _METADATA_CLASSES[name]
        if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
            return _StorageInfo
        if (module, name) == ("torch", "Size"):
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) == (
            "torch.serialization",
            "_get_layout",
        ):  # how torch pickles torch.strided
            from torch.serialization import _get_layout

            return _get_layout
        if module in ("pathlib", "pathlib._local") and name in _PURE_PATHS:
            return _PURE_PATHS[name]
        raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP metadata never holds")


def read_dcp_metadata(file: pathlib.Path, sizes_bytes: dict[str, int]) -> Metadata:
    """The DCP metadata in `file`, checked and rebuilt; `sizes_bytes`: the checkpoint's files by name (the
    manifest). Raises CheckpointError naming the file and what is wrong."""
    try:
        with open_regular_file(file, "DCP metadata", CheckpointError) as handle:
            # no more than the file holds: a read's buffer is as large as it asks for
            data = handle.read(min(os.fstat(handle.fileno()).st_size, DCP_METADATA_LIMIT_BYTES) + 1)
        if len(data) > DCP_METADATA_LIMIT_BYTES:
            raise ValueError(f"it is larger than {DCP_METADATA_LIMIT_BYTES >> 20} MiB")
        return _rebuilt(_MetadataUnpickler(io.BytesIO(data)).load(), sizes_bytes)
    except (
        Exception
    ) as error:  # junk makes the unpickler and the allowed constructors raise anything
        raise CheckpointError(
            f"{file} is not the DCP metadata shardplan writes ({one_line(error)}): the "
            "checkpoint is corrupt or was crafted; restore it from a copy, or save again"
        ) from None


def _rebuilt(loaded: Any, sizes_bytes: dict[str, int]) -> Metadata:
    """Fresh metadata holding only tensor entries whose chunks tile them and lie in the listed files."""
    _expect(type(loaded) is Metadata, "its top object is not DCP Metadata")
    _expect(
        type(loaded.state_dict_metadata) is dict and type(loaded.storage_data) is dict,
        "its entries or storage are not dicts",
    )
    entries = {fqn: _tensor_entry(fqn, entry) for fqn, entry in loaded.state_dict_metadata.items()}
    storage = {}
    for index, info in loaded.storage_data.items():
        _expect(
            type(index) is MetadataIndex
            and type(index.fqn) is str
            and index.fqn in entries
            and type(index.offset) is torch.Size,
            "a storage key names no tensor entry",
        )
        storage[MetadataIndex(fqn=index.fqn, offset=index.offset)] = _storage_info(
            index.fqn, info, sizes_bytes
        )
    for fqn, entry in entries.items():
        for chunk in entry.chunks:
            _expect(
                MetadataIndex(fqn=fqn, offset=chunk.offsets) in storage,
                f"a chunk of {fqn!r} is stored nowhere",
            )
    tensors_only: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
        **entries
    }  # dict is invariant
    return Metadata(state_dict_metadata=tensors_only, storage_data=storage)


def _tensor_entry(fqn: Any, entry: Any) -> TensorStorageMetadata:
    _expect(type(fqn) is str, "an entry's name is not a string")
    _expect(
        type(entry) is TensorStorageMetadata,
        f"entry {fqn!r} is not a tensor (shardplan stores only tensors)",
    )
    properties = entry.properties
    _expect(
        type(properties) is TensorProperties and isinstance(properties.dtype, torch.dtype),
        f"entry {fqn!r} has no tensor dtype",
    )
    _expect(
        type(entry.size) is torch.Size
        and min(entry.size, default=0) >= 0
        and type(entry.chunks) is list
        and bool(entry.chunks),
        f"entry {fqn!r} has no size or chunks",
    )
    chunks = []
    for chunk in entry.chunks:
        _expect(
            type(chunk) is ChunkStorageMetadata
            and type(chunk.offsets) is torch.Size
            and type(chunk.sizes) is torch.Size
            and len(chunk.offsets) == len(chunk.sizes) == len(entry.size),
            f"a chunk of {fqn!r} does not match its rank",
        )
        chunks.append(ChunkStorageMetadata(offsets=chunk.offsets, sizes=chunk.sizes))
    _expect(
        _tiles(entry.size, chunks),
        f"the chunks of {fqn!r} do not tile its {list(entry.size)} elements",
    )
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=properties.dtype), size=entry.size, chunks=chunks
    )


def _tiles(size: torch.Size, chunks: list[ChunkStorageMetadata]) -> bool:
    """Whether the chunks cover the tensor once: one whole chunk, or 1-D ranges end to end (what
    shardplan writes: every parameter flattened, see [Note: checkpoint format] in checkpoint.py)."""
    if len(chunks) == 1 and chunks[0].sizes == size and not any(chunks[0].offsets):
        return True
    if len(size) != 1:
        return False
    end = 0
    for chunk in sorted(chunks, key=lambda chunk: chunk.offsets[0]):
        if chunk.offsets[0] != end or chunk.sizes[0] <= 0:
            return False
        end += chunk.sizes[0]
    return end == size[0]


def _storage_info(fqn: str, info: Any, sizes_bytes: dict[str, int]) -> _StorageInfo:
    _expect(
        type(info) is _StorageInfo
        and type(info.relative_path) is str
        and info.relative_path in sizes_bytes
        and info.relative_path != DCP_METADATA_FILE,
        f"{fqn!r} is stored outside the checkpoint's listed files",
    )
    _expect(
        type(info.offset) is int
        and type(info.length) is int
        and 0 <= info.offset
        and 0 <= info.length <= sizes_bytes[info.relative_path] - info.offset,
        f"{fqn!r} is stored past the end of {info.relative_path}",
    )
    _expect(
        not getattr(info, "transform_descriptors", None),
        f"{fqn!r} is stored through a stream transform",
    )
    return _StorageInfo(relative_path=info.relative_path, offset=info.offset, length=info.length)


def _expect(condition: bool, problem: str) -> None:
    if not condition:
        raise ValueError(problem)


def one_line(error: BaseException, limit: int = 300) -> str:
    """`error` as one short line: its type and its message, whitespace runs made one space, cut at `limit`."""
    text = " ".join(str(error).split())
    text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ManifestReader(FileSystemReader):
    """Gives DCP the metadata read_dcp_metadata checked, instead of unpickling `.metadata` itself."""

    def __init__(self, path: str, metadata: Metadata):
        super().__init__(path)
        self._metadata = metadata
        self._reading = "the checkpoint"
        """The file read_data is in, for its error."""

    # no **kwargs on purpose: DCP falls back to rank-local `__<rank>.metadata` files for readers that take them
    def read_metadata(self) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        try:
            return super().read_data(plan, planner)
        except Exception as error:  # DCP reports it from every rank; say which file
            raise CheckpointError(
                f"{self._reading} holds no tensor data where its metadata says ({one_line(error)})"
            ) from None

    def _slice_file(self, file: IO[bytes], sinfo: _StorageInfo) -> IO[bytes]:
        self._reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)


class RecordingWriter(FileSystemWriter):
    """DCP's file writer that remembers which files this rank wrote (their checksums go in the manifest)."""

    def __init__(self, path: str):
        super().__init__(path)
        self.written: list[str] = []

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        future = super().write_data(plan, planner)
        self.written = sorted({result.storage_data.relative_path for result in future.value()})
        return future
