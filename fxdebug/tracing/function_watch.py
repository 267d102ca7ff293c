"""Which custom ``torch.autograd.Function`` s a thread applies: torch.fx and torch.export keep a
Function's forward and drop its backward, so fxdebug watches ``Function.apply`` while it traces
(:mod:`.fidelity` refuses a traced value there) and while it exports (:mod:`.export` refuses the
export)::

    watching_functions(on_apply)          one patch of Function.apply for every thread that asks,
      │                                   put in by the first and taken out by the last, in any
      │                                   order; each thread's on_apply(cls, args, kwargs) sees
      │                                   only its own calls, other threads run apply untouched
      └─ custom_functions_applied()       the Functions applied, with the user's file:line
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any

import torch

from .locations import user_location

__all__ = ["custom_functions_applied", "watching_functions"]


# autograd Functions whose backward is the derivative of their forward, traced through:
# torch.utils.checkpoint's (use_reentrant=True) recomputes the same ops in backward
_FAITHFUL_FUNCTIONS = frozenset(
    function for function in (getattr(torch.utils.checkpoint, "CheckpointFunction", None),)
    if function is not None)


# torch.autograd.Function.apply, watched while any thread asks (export, or a trace): one patch,
# put in by the first asker and taken out by the last; each thread's own callback sees its calls
_watching: dict[int, Any] = {}  # thread id -> on_apply(cls, args, kwargs)
_watch_users = [0]
_watch_lock = threading.Lock()
_torch_apply: list = []


def _apply_watched(cls, *args, **kwargs):
    on_apply = _watching.get(threading.get_ident())
    if on_apply is not None and cls not in _FAITHFUL_FUNCTIONS:
        on_apply(cls, args, kwargs)
    return _torch_apply[0].__get__(None, cls)(*args, **kwargs)


@contextlib.contextmanager
def watching_functions(on_apply):
    """Within: ``on_apply(cls, args, kwargs)`` before every custom autograd Function this
    thread applies (torch's faithful ones excepted); other threads run ``apply`` untouched.

    >>> calls = []
    >>> with watching_functions(lambda cls, args, kwargs: calls.append(cls)):
    ...     _ = torch.nn.functional.relu(torch.ones(1))
    >>> calls
    []
    """
    thread = threading.get_ident()
    with _watch_lock:
        if _watch_users[0] == 0:
            _torch_apply[:] = [vars(torch.autograd.Function)["apply"]]  # a classmethod, C or Python
            torch.autograd.Function.apply = classmethod(_apply_watched)
        _watch_users[0] += 1
        previous = _watching.get(thread)
        _watching[thread] = on_apply
    try:
        yield
    finally:
        with _watch_lock:
            if previous is None:
                _watching.pop(thread, None)
            else:
                _watching[thread] = previous
            _watch_users[0] -= 1
            if _watch_users[0] == 0:
                torch.autograd.Function.apply = _torch_apply.pop()


@contextlib.contextmanager
def custom_functions_applied():
    """Within: the custom autograd Functions this thread applies (torch.export keeps their
    forward and drops their backward), as ``(class, (file, line) or None)``; torch's own
    faithful ones (checkpoint) not listed. Other threads run ``apply`` untouched.

    >>> with custom_functions_applied() as applied:
    ...     _ = torch.nn.functional.relu(torch.ones(1))
    >>> applied
    []
    """
    found: list = []
    with watching_functions(lambda cls, args, kwargs: found.append(
            (cls, user_location(sys._getframe())))):
        yield found
