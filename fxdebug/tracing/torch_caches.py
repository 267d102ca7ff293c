"""torch's own caches, kept as they are in a process that never ran fxdebug.

While fxdebug traces, a few torch functions are replaced (:mod:`.fidelity`:
``torch.is_grad_enabled``, ``torch.from_numpy``, the grad-mode and autocast
context managers). torch memoizes look-ups of its own functions with
``functools.lru_cache``: ``torch.overrides.get_ignored_functions()`` and its
siblings, dynamo's rule tables, and more. A cache filled for the first time
inside that window would hold fxdebug's replacements for the rest of the
process, and every tool that trusts it (a ``TorchFunctionMode`` that skips
ignored functions, torchlens) would misbehave long after the trace. Two guards,
for every cache rather than a list of known ones::

    warm_overrides()       before the patches go in: torch.overrides' caches filled with
                           torch's own functions (torch.fx asks them on the first traced op)
    CacheWatch()           before: every lru_cache without arguments of every loaded torch
                           module, and the object each holds
      └─ .repair(patched)  after the patches are out: a cache filled during the window that
                           holds a replacement gets torch's function in its place, in the
                           same set, dict or list (torch may add to what it cached: dynamo's
                           rule map); one that cannot be changed (a tuple) is emptied, and
                           torch fills it again; a torch module first imported during the
                           window that kept a replacement gets torch's function back

>>> watch = CacheWatch()
>>> watch.repair({})
[]
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

import torch

__all__ = ["warm_overrides", "CacheWatch"]

_CACHE = type(functools.lru_cache(maxsize=None)(len))  # the type of every lru_cache / cache function
_known: dict[str, list[Any]] = {}  # module name -> its caches without arguments, found once


def warm_overrides() -> None:
    """Fill ``torch.overrides``' caches with torch's own functions, before any patch goes in.

    Each is filled once per process anyway: torch.fx's Proxy asks
    ``is_tensor_method_or_property`` on the first traced op.

    >>> warm_overrides(); torch.is_grad_enabled in torch.overrides.get_ignored_functions()
    True
    """
    overrides = torch.overrides
    overrides.get_ignored_functions()
    overrides.get_testing_overrides()
    overrides.get_overridable_functions()
    overrides.is_tensor_method_or_property(torch.Tensor.add)  # the tensor-methods cache
    nowrap = getattr(overrides, "get_default_nowrap_functions", None)
    if nowrap is not None:
        nowrap()
    for name, value in sorted(vars(overrides).items()):  # any other cache it grows later
        if type(value) is _CACHE and _takes_no_arguments(value):
            value()


def _takes_no_arguments(cache) -> bool:
    """A cache of a plain Python function called with no arguments: one entry, readable."""
    wrapped = getattr(cache, "__wrapped__", None)
    if not inspect.isfunction(wrapped):
        return False
    return all(p.default is not p.empty and p.kind is not p.VAR_POSITIONAL
               for p in inspect.signature(wrapped).parameters.values())


def _torch_modules() -> list[str]:
    return [name for name in list(sys.modules)
            if name == "torch" or name.startswith("torch.")]


def _caches_of(module) -> list[Any]:
    """The lru_caches without arguments a module holds at its top level and in its classes."""
    try:
        namespace = dict(vars(module))
    except TypeError:
        return []
    found = []
    for value in namespace.values():
        kind = type(value)  # never getattr: some module attributes warn when read
        if kind is _CACHE:
            found.append(value)
        elif issubclass(kind, type) and vars(value).get("__module__") == module.__name__:
            for member in list(vars(value).values()):
                inner = member.__func__ if isinstance(member, (classmethod, staticmethod)) \
                    else member
                if type(inner) is _CACHE:
                    found.append(inner)
    return [cache for cache in found if _takes_no_arguments(cache)]


def _held(cache) -> Any:
    """What a cache without arguments holds (reading it is a hit: nothing computed), or None."""
    return cache() if cache.cache_info().currsize else None


class CacheWatch:
    """The caches of torch's loaded modules before a trace, to repair what the trace left."""

    def __init__(self) -> None:
        self.modules = set(_torch_modules())
        for name in self.modules:
            if name not in _known:
                module = sys.modules.get(name)
                _known[name] = _caches_of(module) if module is not None else []
        self.held = {id(cache): (cache, _held(cache))
                     for name in self.modules for cache in _known[name]}

    def repair(self, patched: dict[int, tuple[Any, Any]]) -> list[str]:
        """Undo what the window left: ``patched`` maps ``id(replacement)`` to
        ``(replacement, torch's original)``. Returns what was repaired (qualified names)."""
        repaired = []
        for cache, before in self.held.values():
            now = _held(cache)
            if now is not None and now is not before and _holds(now, patched):
                _put_back(cache, now, patched)  # filled in the window (or emptied and refilled)
                repaired.append(_name(cache))
        for name in sorted(set(_torch_modules()) - self.modules):  # imported in the window
            module = sys.modules.get(name)
            if module is None:
                continue
            for cache in _known.setdefault(name, _caches_of(module)):
                if _holds(_held(cache), patched):
                    _put_back(cache, _held(cache), patched)
                    repaired.append(_name(cache))
            try:
                namespace = vars(module)
            except TypeError:
                continue
            for attribute, value in list(namespace.items()):
                if id(value) in patched and patched[id(value)][0] is value:
                    namespace[attribute] = patched[id(value)][1]
                    repaired.append(f"{name}.{attribute}")
        return repaired


def _holds(value: Any, patched: dict[int, tuple[Any, Any]], depth: int = 3) -> bool:
    """Whether ``value`` (sets, dicts, lists, tuples, nested ``depth`` deep) holds a replacement."""
    if id(value) in patched and patched[id(value)][0] is value:
        return True
    if depth == 0:
        return False
    if isinstance(value, dict):
        return any(_holds(k, patched, depth - 1) or _holds(v, patched, depth - 1)
                   for k, v in value.items())
    if isinstance(value, (set, frozenset, list, tuple)):
        return any(_holds(item, patched, depth - 1) for item in value)
    return False


def _put_back(cache, value: Any, patched: dict[int, tuple[Any, Any]]) -> None:
    """torch's originals in place of the replacements in ``value``; emptied where immutable."""
    if not _replace_in(value, patched):
        cache.cache_clear()


def _original(item: Any, patched: dict[int, tuple[Any, Any]]) -> Any:
    found = patched.get(id(item))
    return found[1] if found is not None and found[0] is item else item


def _replace_in(value: Any, patched: dict[int, tuple[Any, Any]], depth: int = 3) -> bool:
    """Replace in place, ``depth`` deep; False where a replacement sits in something immutable."""
    if depth == 0 or not _holds(value, patched, depth):
        return True
    if isinstance(value, set):
        found = [item for item in value if _original(item, patched) is not item]
        value.difference_update(found)
        value.update(_original(item, patched) for item in found)
        return all(_replace_in(item, patched, depth - 1) for item in value)
    if isinstance(value, dict):
        for key in [k for k in value if _original(k, patched) is not k]:
            value[_original(key, patched)] = value.pop(key)
        for key, item in list(value.items()):
            value[key] = _original(item, patched)
        return all(_replace_in(item, patched, depth - 1) for item in value.values())
    if isinstance(value, list):
        value[:] = [_original(item, patched) for item in value]
        return all(_replace_in(item, patched, depth - 1) for item in value)
    return False  # a tuple or frozenset holding one: the cache is emptied instead


def _name(cache) -> str:
    wrapped = cache.__wrapped__
    return f"{getattr(wrapped, '__module__', '?')}.{getattr(wrapped, '__qualname__', '?')}"
