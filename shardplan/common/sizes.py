"""Memory sizes as people write them ("70GiB", "512 MB", 1e9) and as they read them."""

import math
import re

from shardplan.errors import ShardplanError

_UNIT_BYTES = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
LARGEST_SIZE_BYTES = 2**50
"""1 PiB: no device or host holds that much per rank (the largest hosts have a few TiB), so a
larger size is a typo (an exponent or unit too many), never a budget."""


def parse_bytes(value: int | float | str) -> int:
    """`parse_bytes("1.5GiB") == 1610612736`; plain numbers are bytes, from 1 B to 1 PiB; fractions of a
    byte are dropped."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _checked(value, value)
    match = _QUANTITY.match(str(value))
    unit = match.group(2).lower() if match else None
    if unit == "":
        unit = "b"
    if match is None or unit not in _UNIT_BYTES:
        raise ShardplanError(
            f"cannot read memory size {value!r}: write a number of bytes or a number with one of "
            f"the units {', '.join(sorted(_UNIT_BYTES))} (e.g. '70GiB')"
        )
    return _checked(float(match.group(1)) * _UNIT_BYTES[unit], value)


def _checked(size: int | float, written) -> int:
    """`size` as whole bytes, if it lies in the range a memory size can take."""
    if not (isinstance(size, int) or math.isfinite(size)) or not 1 <= size <= LARGEST_SIZE_BYTES:
        raise ShardplanError(
            f"memory size {written!r} is out of range: write between 1 B and 1 PiB "
            f"({LARGEST_SIZE_BYTES} bytes) per rank, e.g. '70GiB'"
        )
    return int(size)


def format_bytes(size: float) -> str:
    """`format_bytes(3 * 2**30) == '3.00 GiB'`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"
