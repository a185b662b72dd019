"""Warnings that point at the user's line, however deep in shardplan they are raised."""

import os
import sys
import warnings
from types import FrameType

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def warn_at_caller(message: str) -> None:
    """`warnings.warn(message)` attributed to the first frame outside the shardplan package: the
    line that called into it (a program's call, `step` through a pipeline's schedule), where a
    fixed stacklevel would name a frame of ours whenever the path to the warning is one call longer."""
    frame: FrameType | None = sys._getframe(1)
    level = 2  # stacklevel 1 is this function
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)
