"""The files users keep (plans, configs, profiles, baselines): read within bounds, written so that a
crash never loses the old one.

Every file shardplan reads is read whole into memory and parsed as JSON, so each read is bounded:
at most MAX_FILE_BYTES and JSON nested at most MAX_JSON_DEPTH deep (plans nest 4). A plan lists each
parameter's name once, about 70 bytes: a 70B-parameter Llama's plan is about 60 KiB, and one of
200 000 parameter tensors still fits in 16 MiB, which loads in seconds (about 0.3 s per MiB).
"""
import json
import os
import stat
import sys
import tempfile
from typing import Any, NoReturn, TypeGuard

from .errors import ShardplanError

MAX_FILE_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 32



def is_finite_number(value: object) -> TypeGuard[int | float]:
    """An int or float JSON can hold, of either sign: not a bool, NaN or infinity. Compared rather than given
    to math.isfinite, which raises OverflowError on an integer past float's range."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= sys.float_info.max

def read_text(path: str | os.PathLike, what: str, error: type[ShardplanError] = ShardplanError) -> str:
    """The UTF-8 text of the file at `path` (`what` names it in errors, without a leading byte order mark),
    refused past MAX_FILE_BYTES."""
    shown = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as problem:
        raise error(f"cannot read {what} {shown!r}: {problem.strerror or problem}") from None
    if len(data) > MAX_FILE_BYTES:
        raise error(f"{what} {shown!r} is larger than {MAX_FILE_BYTES // 2**20} MiB, the most shardplan "
                    "reads: give the file it wrote, not another one")
    try:
        return data.decode("utf-8-sig")  # a byte order mark, as Windows editors write, is dropped (RFC 8259 allows it)
    except UnicodeDecodeError as problem:
        raise error(f"{what} {shown!r} is not UTF-8 text (byte {problem.start}): it is corrupt or another "
                    "kind of file") from None


def parse_json(text: str, what: str, error: type[ShardplanError] = ShardplanError) -> Any:
    """`text` parsed as strict JSON: no NaN or Infinity, no key twice in one object, nested at most
    MAX_JSON_DEPTH deep."""
    if len(text) > MAX_FILE_BYTES:
        raise error(f"{what} is longer than {MAX_FILE_BYTES // 2**20} MiB, the most shardplan reads")
    try:
        data = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=_object_without_repeats)
    except json.JSONDecodeError as problem:
        raise error(f"{what} is not valid JSON ({problem}); it may be truncated: write it again") from None
    except RecursionError:  # nested deeper than Python's stack
        raise error(_too_deep(what)) from None
    except ValueError as problem:  # NaN, a repeated key, an integer of more than 4300 digits
        raise error(f"{what} is not valid JSON: {problem}") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise error(_too_deep(what))
    return data


def _too_deep(what: str) -> str:
    return (f"{what} nests JSON more than {MAX_JSON_DEPTH} levels deep, deeper than any file shardplan reads: "
            "it is corrupt or another kind of file")


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number: write a finite number")


def _object_without_repeats(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):
        repeated = sorted({key for key, _ in pairs if sum(1 for other, _ in pairs if other == key) > 1})
        raise ValueError(f"key {repeated[0]!r} appears twice in one object: keep one")
    return data


def _depth_exceeds(data: object, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` deep (walked without recursion)."""
    level = [data]
    for _ in range(limit):
        level = [child for value in level if isinstance(value, (list, dict))
                 for child in (value.values() if isinstance(value, dict) else value)
                 if isinstance(child, (list, dict))]
        if not level:
            return False
    return True


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a crash
    mid-write leaves any previous file intact, never a truncated one.

    The file keeps what a plain write would keep: an existing file's permissions (a new one gets
    0o666 less the umask), and a symbolic link stays a link, its target rewritten."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ShardplanError(f"cannot write {path!r}: it is a folder; give a file path inside it "
                             f"(e.g. {os.path.join(path, 'plan.json')!r})")
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    try:
        descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(target)}-", suffix=".tmp")
    except OSError as problem:
        raise ShardplanError(f"cannot write {path!r}: {problem.strerror or problem} in folder {folder!r}; "
                             "create the folder or write elsewhere") from None
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            os.fchmod(handle.fileno(), _permissions_for(target))  # mkstemp's are 0o600, whatever the umask
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except OSError as problem:
        os.unlink(temporary)
        raise ShardplanError(f"cannot write {path!r}: {problem.strerror or problem}; write elsewhere") from None
    except BaseException:
        os.unlink(temporary)
        raise


def _permissions_for(path: str) -> int:
    """The permission bits of the file at `path`, or those open() gives a new one: 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # the one way to read it: set it and put it back
        os.umask(umask)
        return 0o666 & ~umask
