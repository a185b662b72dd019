"""Writing the files users keep (plans, profiles, baselines) so that a crash never loses the old one, and
reading files that may be damaged or hostile (checkpoints) without trusting their size, depth or bytes."""
import hashlib
import json
import math
import os
import tempfile


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and a rename: a crash
    mid-write leaves any previous file intact, never a truncated one."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}-", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read_json_bounded(path: str | os.PathLike, *, limit_bytes: int, limit_depth: int):
    """Parse a JSON file that may be damaged or hostile: at most `limit_bytes`, nested at most `limit_depth`,
    numbers finite. Raises OSError when unreadable, ValueError saying what is wrong otherwise."""
    with open(path, "rb") as handle:
        data = handle.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise ValueError(f"it is larger than {limit_bytes} bytes")
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(f"it is nested deeper than {limit_depth} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"it is not JSON: {error}") from None
    _check_depth_and_numbers(value, limit_depth)
    return value


def sha256_of_file(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, streamed, as 64 hex digits."""
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _refuse_constant(name: str):
    raise ValueError(f"it holds {name}, which JSON has no spelling for")


def _check_depth_and_numbers(value, limit_depth: int) -> None:
    """Without recursion: a value nested too deep for the parser's stack was refused above, this one may
    still be too deep for the code that walks it. 1e400 parses to inf without complaint."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"it holds a number beyond float range ({item})")
        if isinstance(item, (dict, list)):
            if depth > limit_depth:
                raise ValueError(f"it is nested deeper than {limit_depth} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
