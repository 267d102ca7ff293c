"""Where a node came from: the first frame of user code on the stack.

"User code" is any file outside torch and fxdebug (torchvision's model files
count as user code: they are where a model's statements live).
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types

import torch

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_FXDEBUG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__)) + os.sep
# console scripts (``fxdebug``, ``torchrun``) are launchers, never where a model's code lives
_SCRIPTS_DIR = os.path.abspath(sysconfig.get_path("scripts")) + os.sep
# where fxdebug's generated forwards say they live (graph_module.GENERATED_DIR; only in linecache)
_GENERATED_DIR = os.path.join(os.sep, "fxdebug-generated") + os.sep


def is_user_file(filename: str) -> bool:
    """Return whether ``filename`` holds user code (not torch, fxdebug, the stdlib, console
    scripts or generated code).

    >>> is_user_file(torch.__file__), is_user_file("/home/me/model.py"), is_user_file("<stdin>")
    (False, True, False)
    """
    known = _USER_FILES.get(filename)
    if known is not None:
        return known
    if not filename or filename.startswith("<"):
        return False
    answer = _is_user_path(filename)
    if os.path.isabs(filename):  # code objects' usual form: the answer cannot change
        _USER_FILES[filename] = answer
    return answer  # a relative name depends on the working directory: asked again next time


_USER_FILES: dict[str, bool] = {}


def _is_user_path(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, _FXDEBUG_DIR, _SCRIPTS_DIR, _GENERATED_DIR)):
        return False
    if path.startswith(_STDLIB_DIR) and "site-packages" not in path and "dist-packages" not in path:
        return False
    return True


def user_location(frame: types.FrameType | None = None) -> tuple[str, int] | None:
    """Return ``(filename, lineno)`` of the innermost user frame above ``frame``."""
    frame = frame if frame is not None else sys._getframe(1)
    while frame is not None:
        if is_user_file(frame.f_code.co_filename):
            return frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back
    return None


def user_location_in_traceback(tb: types.TracebackType | None) -> tuple[str, int] | None:
    """Return the innermost user ``(filename, lineno)`` in a traceback."""
    found = None
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if is_user_file(filename):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def caller_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` that points at the user's line.

    The first frame that is neither fxdebug's, nor torch's (``Module.__call__``
    runs an instrumented module's forward), nor generated code.
    """
    frame: types.FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and _not_users(frame.f_code.co_filename):
        frame = frame.f_back
        level += 1
    return level


def _not_users(filename: str) -> bool:
    if filename.startswith("<") or "fxdebug-generated" in filename:
        return True
    path = os.path.abspath(filename)
    return path.startswith(_FXDEBUG_DIR) or path.startswith(_TORCH_DIR)


def short_list(items: list[str], limit: int = 2) -> str:
    """``a; b`` or ``a; b; and 3 more``: a warning stays one short line.

    >>> short_list(["a", "b", "c", "d"])
    'a; b; and 2 more'
    """
    shown = "; ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}; and {len(items) - limit} more"
