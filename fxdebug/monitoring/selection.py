"""Which modules a monitor watches: ``select=`` by module-name pattern and by module type.

``select`` is a pattern, a module class, or a list of both. A module is selected when
its path matches one of the patterns (a glob, or the path lies inside the module the
pattern names, as ``instrument(include=)``), and is an instance of one of the classes;
a missing group does not restrict. ``None`` selects every module but the root.

>>> import torch
>>> net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
>>> [name for name, _ in selected_modules(net, torch.nn.Linear)]
['0', '2']
>>> [name for name, _ in selected_modules(net, ["1", "2"])]
['1', '2']
>>> module_of_key("layer1.0.conv1_1/0", {"layer1.0.conv1"})
'layer1.0.conv1'
"""

from __future__ import annotations

import difflib
import re
from typing import Iterable

import torch

from ..errors import SelectionError
from ..tracing.selection import matches, patterns_and_classes

__all__ = ["selected_modules", "module_of_key", "own_parameters"]

_CALL_SUFFIX = re.compile(r"_\d+$")


def _groups(select) -> tuple[list[str], tuple[type, ...]]:
    return patterns_and_classes(select, "fxdebug.monitor: select=",
                                "select=['*.attn.*', torch.nn.Linear]")


def selected_modules(model: torch.nn.Module, select=None) -> list[tuple[str, torch.nn.Module]]:
    """``[(path, module)]`` of the modules ``select`` names, in ``named_modules()`` order.

    A model without submodules selects itself, under the key ``output`` (as
    :func:`fxdebug.instrument` keys its output). Raises
    :class:`~fxdebug.errors.SelectionError` when nothing matches, naming close paths.
    """
    every = [(name, module) for name, module in model.named_modules() if name]
    if not every:
        every = [("output", model)]
    if select is None:
        return every
    patterns, types = _groups(select)
    chosen = [(name, module) for name, module in every
              if (not patterns or any(matches(name, p) for p in patterns))
              and (not types or isinstance(module, types))]
    if not chosen:
        names = [name for name, _ in every]
        close = [c for p in patterns for c in difflib.get_close_matches(p, names, n=3)]
        hint = f" Close paths: {', '.join(dict.fromkeys(close))}." if close else \
            f" The model's first paths: {', '.join(names[:5])}."
        kinds = ", ".join(t.__name__ for t in types) or "any class"
        raise SelectionError(
            f"fxdebug.monitor: select={select!r} matches no module of {type(model).__name__} "
            f"(patterns {patterns or 'any'}, of {kinds}).{hint} Patterns are globs over "
            f"module paths as model.named_modules() names them.")
    return chosen


def module_of_key(key: str, modules: Iterable[str] | set[str]) -> str | None:
    """The module path a capture key belongs to (``path``, ``path_1`` for its second call,
    ``path/0`` for a part of a nested output), or None when it is none of ``modules``."""
    names = modules if isinstance(modules, (set, frozenset, dict)) else set(modules)
    base = key.split("/", 1)[0]
    if base in names:
        return base
    plain = _CALL_SUFFIX.sub("", base)
    return plain if plain in names else None


def own_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters a module holds itself (not its submodules'), trainable ones only.

    >>> len(own_parameters(torch.nn.Linear(2, 2))), len(own_parameters(torch.nn.Sequential()))
    (2, 0)
    """
    return [p for p in module.parameters(recurse=False) if p.requires_grad]
