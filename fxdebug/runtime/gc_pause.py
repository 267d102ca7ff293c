"""Python's cyclic garbage collector held off while fxdebug builds a large graph's objects.

Tracing, instrumenting, diffing and tabulating a graph of 10k nodes each
create some 100k objects that stay alive. Every few thousand new objects
Python's collector runs, and now and then it scans every object the program
holds (a 10k-module model, its graphs); those full scans took up to a third
of those steps' time. :func:`collection_paused` holds the collector off for
the duration of one such step and turns it back on afterwards if it was on
before; nothing is freed later than it would be without fxdebug, except
reference cycles made during the step, which the next collection frees::

    with collection_paused():       # depth 0 -> 1: gc.disable() if it was enabled
        with collection_paused():   # nested, or another thread: depth 2, nothing to do
            ...
                                    # depth 1 -> 0: gc.enable() if it was enabled at 0 -> 1

>>> import gc
>>> with collection_paused():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import contextlib
import functools
import gc
import threading
from typing import Callable, Iterator, TypeVar

__all__ = ["collection_paused", "pauses_collection"]

_F = TypeVar("_F", bound=Callable)

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Hold off ``gc`` collections inside the block (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def pauses_collection(function: _F) -> _F:
    """Decorator: ``function`` runs inside :func:`collection_paused`.

    Its frame is fxdebug's own, so warnings that point at the user's line
    (``caller_stacklevel``) still do (contextlib's decorator adds a frame of
    contextlib's).

    >>> @pauses_collection
    ... def build():
    ...     return gc.isenabled()
    >>> build(), gc.isenabled()
    (False, True)
    """
    @functools.wraps(function)
    def paused(*args, **kwargs):
        with collection_paused():
            return function(*args, **kwargs)
    return paused  # type: ignore[return-value]
