"""dtypes by name. Plans, chains and checkpoints spell a dtype as torch does without its module
("float32", not "torch.float32"); this is the one place that converts that name to and from a
torch.dtype and counts its bytes. Torch is imported only to make a torch.dtype: the planner runs
without it."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
"""dtypes parameters may be gathered, computed and reduced in, as torch spells them."""
INPUT_DTYPES = FLOAT_DTYPES + (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "complex64",
    "complex128",
)
"""dtypes an example input may have."""
BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "complex64": 8,
    "complex128": 16,
}
"""Bytes of one element of each dtype in INPUT_DTYPES."""


def dtype_name(dtype: "torch.dtype | str") -> str:
    """A torch.dtype, or either spelling of its name, as shardplan spells it: "float32"."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(dtype: "torch.dtype | str") -> "torch.dtype":
    """The torch.dtype of a name in either spelling."""
    import torch

    return getattr(torch, dtype_name(dtype))


def dtype_bytes(dtype: "torch.dtype | str") -> int:
    """Bytes of one element of a dtype (a torch.dtype or its name)."""
    return BYTES[dtype_name(dtype)]
