"""Warnings that name the user's line: the first frame outside this package, torchrl and
tensordict (the ``rb.extend`` or ``transform.inv`` that inserted), whatever the depth of the
calls in between; and warnings raised in another process (a shared transform's owner, a Ray
actor), recorded there and issued again in the writer."""

from __future__ import annotations

import inspect
import os
import warnings

import tensordict
import torchrl

__all__ = ["recorded", "reissue", "warn"]

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


def recorded(caught) -> list[tuple[type[Warning], str]]:
    """The warnings of ``warnings.catch_warnings(record=True)``, as pairs that pickle."""
    return [(w.category, str(w.message)) for w in caught]


def reissue(records) -> None:
    """Issue here, on the user's line, the warnings :func:`recorded` in another process."""
    for category, message in records:
        warn(message, category)
