"""The files users keep (plans, configs, profiles, baselines): read within bounds, written so that a
crash never loses the old one.

Every file shardplan reads is read whole into memory and parsed as JSON, so each read is bounded:
at most MAX_FILE_BYTES and JSON nested at most MAX_JSON_DEPTH deep (plans nest 4). A plan lists each
parameter's name once, about 70 bytes: a 70B-parameter Llama's plan is about 60 KiB, and one of
200 000 parameter tensors still fits in 16 MiB, which loads in seconds (about 0.3 s per MiB).
"""

import errno
import json
import os
import stat
import sys
import tempfile
from typing import Any, BinaryIO, Callable, NoReturn, TypeGuard

from shardplan.errors import ShardplanError

MAX_FILE_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 32


def is_finite_number(value: object) -> TypeGuard[int | float]:
    """An int or float JSON can hold, of either sign: not a bool, NaN or infinity. Compared rather than given
    to math.isfinite, which raises OverflowError on an integer past float's range."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and abs(value) <= sys.float_info.max
    )


def read_text(
    path: str | os.PathLike,
    what: str,
    error: type[ShardplanError] = ShardplanError,
    *,
    regular_only: bool = False,
) -> str:
    """The UTF-8 text of the file at `path` (`what` names it in errors, without a leading byte order mark),
    refused past MAX_FILE_BYTES; with `regular_only`, refused unless it is a regular file (open_regular_file)."""
    shown = os.fspath(path)
    try:
        with open_regular_file(path, what, error) if regular_only else open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except OSError as problem:
        raise error(f"cannot read {what} {shown!r}: {problem.strerror or problem}") from None
    if len(data) > MAX_FILE_BYTES:
        raise error(
            f"{what} {shown!r} is larger than {MAX_FILE_BYTES // 2**20} MiB, the most shardplan "
            "reads: give the file it wrote, not another one"
        )
    try:
        return data.decode(
            "utf-8-sig"
        )  # a byte order mark, as Windows editors write, is dropped (RFC 8259 allows it)
    except UnicodeDecodeError as problem:
        raise error(
            f"{what} {shown!r} is not UTF-8 text (byte {problem.start}): it is corrupt or another "
            "kind of file"
        ) from None


def open_regular_file(
    path: str | os.PathLike, what: str, error: type[ShardplanError] = ShardplanError
) -> BinaryIO:
    """`path` opened for binary reading, refused unless it is a regular file. For the files shardplan itself
    wrote (a run's progress, a checkpoint's): opening a FIFO waits for a writer, forever if none comes, and a
    device may never end; either in their place was put there by someone else."""
    shown = os.fspath(path)
    try:
        descriptor = os.open(
            path, os.O_RDONLY | os.O_NONBLOCK
        )  # a FIFO opens at once, to be refused below
    except OSError as problem:
        raise error(f"cannot read {what} {shown!r}: {problem.strerror or problem}") from None
    try:
        _expect_regular(descriptor, shown, what, error)
        os.set_blocking(descriptor, True)
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def _expect_regular(descriptor: int, shown: str, what: str, error: type[ShardplanError]) -> None:
    mode = os.fstat(descriptor).st_mode
    if not stat.S_ISREG(mode):
        kind = (
            "a named pipe"
            if stat.S_ISFIFO(mode)
            else "a device"
            if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
            else "a socket"
            if stat.S_ISSOCK(mode)
            else "a folder"
            if stat.S_ISDIR(mode)
            else "not a file"
        )
        raise error(f"{what} {shown!r} is {kind}, not a regular file shardplan wrote: remove it")


def append_line(
    path: str | os.PathLike, line: str, what: str, error: type[ShardplanError] = ShardplanError
) -> None:
    """Append `line` and a newline to the regular file at `path` (made if missing), never through a symbolic link
    and never waiting on a FIFO: a link or a pipe in a run's folder was put there by someone else, and writing
    through it would change their file or stop the run."""
    shown = os.fspath(path)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        descriptor = os.open(path, flags, 0o666)
    except OSError as problem:
        cause = (
            "it is a symbolic link"
            if problem.errno == errno.ELOOP
            else problem.strerror or str(problem)
        )
        if problem.errno == errno.ENXIO:  # a FIFO no one reads
            cause = "it is a named pipe"
        raise error(
            f"cannot write {what} {shown!r}: {cause}; remove it, or write elsewhere"
        ) from None
    try:
        _expect_regular(descriptor, shown, what, error)
        os.set_blocking(descriptor, True)
        with os.fdopen(descriptor, "a", encoding="utf-8") as handle:
            descriptor = -1  # the handle closes it
            handle.write(line + "\n")
    except OSError as problem:
        raise error(
            f"cannot write {what} {shown!r}: {problem.strerror or problem}; write elsewhere"
        ) from None
    finally:
        if descriptor >= 0:
            os.close(descriptor)


def parse_json(text: str, what: str, error: type[ShardplanError] = ShardplanError) -> Any:
    """`text` parsed as strict JSON: no NaN or Infinity, no key twice in one object, nested at most
    MAX_JSON_DEPTH deep."""
    if len(text) > MAX_FILE_BYTES:
        raise error(
            f"{what} is longer than {MAX_FILE_BYTES // 2**20} MiB, the most shardplan reads"
        )
    try:
        data = json.loads(
            text, parse_constant=_refuse_constant, object_pairs_hook=_object_without_repeats
        )
    except json.JSONDecodeError as problem:
        raise error(
            f"{what} is not valid JSON ({problem}); it may be truncated: write it again"
        ) from None
    except RecursionError:  # nested deeper than Python's stack
        raise error(_too_deep(what)) from None
    except ValueError as problem:  # NaN, a repeated key, an integer of more than 4300 digits
        raise error(f"{what} is not valid JSON: {problem}") from None
    if _depth_exceeds(data, MAX_JSON_DEPTH):
        raise error(_too_deep(what))
    return data


def _too_deep(what: str) -> str:
    return (
        f"{what} nests JSON more than {MAX_JSON_DEPTH} levels deep, deeper than any file shardplan reads: "
        "it is corrupt or another kind of file"
    )


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not a JSON number: write a finite number")


def _object_without_repeats(pairs: list[tuple[str, object]]) -> dict:
    data = dict(pairs)
    if len(data) != len(pairs):
        repeated = sorted(
            {key for key, _ in pairs if sum(1 for other, _ in pairs if other == key) > 1}
        )
        raise ValueError(f"key {repeated[0]!r} appears twice in one object: keep one")
    return data


def _depth_exceeds(data: object, limit: int) -> bool:
    """Whether lists and objects nest more than `limit` deep (walked without recursion)."""
    level = [data]
    for _ in range(limit):
        level = [
            child
            for value in level
            if isinstance(value, (list, dict))
            for child in (value.values() if isinstance(value, dict) else value)
            if isinstance(child, (list, dict))
        ]
        if not level:
            return False
    return True


def write_text_atomically(
    path: str | os.PathLike,
    text: str,
    *,
    through_links: bool = True,
    error: type[ShardplanError] = ShardplanError,
) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a crash
    mid-write leaves any previous file intact, never a truncated one.

    The file keeps what a plain write would keep: an existing file's permissions (a new one gets
    0o666 less the umask), and a symbolic link stays a link, its target rewritten. Without
    `through_links` (a run's own files) a link at `path` is replaced by the file instead."""

    def write(handle: BinaryIO) -> None:
        handle.write(text.encode("utf-8"))

    write_atomically(path, write, through_links=through_links, error=error)


def write_atomically(
    path: str | os.PathLike,
    write: Callable[[BinaryIO], object],
    *,
    through_links: bool = True,
    error: type[ShardplanError] = ShardplanError,
) -> None:
    """Call `write` on a new temporary file beside `path`'s target, then rename it onto the target (see
    write_text_atomically). The temporary file is created anew (O_EXCL), so nothing at its name, a link or a
    FIFO, is written through or waited on."""
    path = os.fspath(path)
    if os.path.isdir(path) and (through_links or not os.path.islink(path)):
        raise error(
            f"cannot write {path!r}: it is a folder; give a file path inside it "
            f"(e.g. {os.path.join(path, 'plan.json')!r})"
        )
    target = os.path.realpath(path) if through_links else os.path.abspath(path)
    folder = os.path.dirname(target)
    try:
        descriptor, temporary = tempfile.mkstemp(
            dir=folder, prefix=f".{os.path.basename(target)}-", suffix=".tmp"
        )
    except OSError as problem:
        raise error(
            f"cannot write {path!r}: {problem.strerror or problem} in folder {folder!r}; "
            "create the folder or write elsewhere"
        ) from None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            os.fchmod(
                handle.fileno(), _permissions_for(target)
            )  # mkstemp's are 0o600, whatever the umask
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except OSError as problem:
        os.unlink(temporary)
        raise error(
            f"cannot write {path!r}: {problem.strerror or problem}; write elsewhere"
        ) from None
    except BaseException:
        os.unlink(temporary)
        raise


def _permissions_for(path: str) -> int:
    """The permission bits of the file at `path`, or those open() gives a new one: 0o666 less the umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        umask = os.umask(0)  # the one way to read it: set it and put it back
        os.umask(umask)
        return 0o666 & ~umask
