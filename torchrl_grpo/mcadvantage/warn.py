"""Warnings that name the user's line: the first frame outside this package, torchrl and
tensordict (the ``rb.extend`` or ``transform.inv`` that inserted), whatever the depth of the
calls in between."""

from __future__ import annotations

import inspect
import os
import warnings

import tensordict
import torchrl

__all__ = ["warn"]

#: The folders whose frames a warning skips.
_INTERNAL = tuple(
    os.path.dirname(path) + os.sep
    for path in (os.path.dirname(os.path.abspath(__file__)), torchrl.__file__, tensordict.__file__)
)


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line."""
    frame, level = inspect.currentframe().f_back, 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
