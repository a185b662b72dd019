"""Memory sizes as people write them ("70GiB", "512 MB", 1e9) and as they read them."""
import re

from .errors import ShardplanError

_UNIT_BYTES = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str) -> int:
    """`parse_bytes("1.5GiB") == 1610612736`; plain numbers are bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ShardplanError(f"memory size must be positive, got {value}")
        return int(value)
    match = _QUANTITY.match(str(value))
    unit = match.group(2).lower() if match else None
    if unit == "":
        unit = "b"
    if match is None or unit not in _UNIT_BYTES:
        raise ShardplanError(
            f"cannot read memory size {value!r}: write a number of bytes or a number with one of "
            f"the units {', '.join(sorted(_UNIT_BYTES))} (e.g. '70GiB')")
    size = int(float(match.group(1)) * _UNIT_BYTES[unit])
    if size <= 0:
        raise ShardplanError(f"memory size must be positive, got {value!r}")
    return size


def format_bytes(size: float) -> str:
    """`format_bytes(3 * 2**30) == '3.00 GiB'`."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"
