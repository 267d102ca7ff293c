"""Nested values (tuples, lists, dicts, namedtuples, dataclasses, model outputs): the one walker.

Module outputs come nested (``(h, {"gate": g})``, a transformers ``ModelOutput``,
torchvision detection's list of dicts); captures flatten them into ``/`` keys
(``enc/0``, ``enc/1/gate``, ``out/0/boxes``), and runs that must not see each
other's in-place writes take copies of their inputs. Everything in fxdebug that
looks inside such a value goes through this module.

The walk is torch's pytree (``tree_flatten_with_path``, through
:mod:`fxdebug.runtime.torch_compat`): every type pytree knows (tuple, list,
dict, namedtuple, ``OrderedDict``, ``torch.Size``, ``torch.return_types``,
transformers' ``ModelOutput``, what a library registered) is walked as pytree
walks it; plain tuples, lists, dicts and namedtuples are read directly, with the
names pytree gives them (pytree's own walk costs ~10x more, and this runs on
every capture). Containers pytree leaves whole are opened here, once:
dataclasses, unregistered subclasses of tuple/list/dict, and slices
(``(start, stop, step)``). A key is the ``/``-joined path: list and tuple
positions, dict keys, namedtuple and dataclass field names.

The dumped folder's run.py carries :func:`named_leaves` and the functions it
calls (see ``fxdebug.dumping.folder_runtime``), so they use nothing from
fxdebug but ``tree_flatten_with_path`` and ``tree_is_leaf``. :func:`outputs_loss`,
the one default loss, calls nothing but named_leaves, so run.py carries it too and a
dump's expected gradients are those every check compares.

Also here, built on the same walk: :func:`json_safe` (what every report's
``to_dict()`` returns; the report shape sits below the runtime, so
:mod:`fxdebug.tables.report` is handed it when this module is imported).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from typing import Any, Callable

import torch

from ..tables.report import Report, use_json_converter
from .torch_compat import tree_flatten_with_path, tree_is_leaf, tree_unflatten

__all__ = ["children", "named_leaves", "leaves", "flatten_tensors", "map_leaves", "map_tensors",
           "clone_inputs", "outputs_loss", "json_safe", "WALKER_FUNCTIONS"]


def _key_name(entry) -> str:
    """The text of one pytree key entry: a position, a dict key or a field name."""
    for attribute in ("idx", "key", "name"):  # SequenceKey, MappingKey, GetAttrKey
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def _opened_here(value):
    """``[(name, item)]`` of a container pytree keeps whole, else None."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(field.name, getattr(value, field.name)) for field in dataclasses.fields(value)]
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return list(zip(value._fields, value))
    if isinstance(value, (tuple, list)):
        return [(str(index), item) for index, item in enumerate(value)]
    if isinstance(value, dict):
        return [(str(key), item) for key, item in value.items()]
    if isinstance(value, slice):
        return [("0", value.start), ("1", value.stop), ("2", value.step)]
    return None


def children(value):
    """One level of a nested value: ``[(name, item)]`` of a container, None for a leaf.

    Plain tuples, lists, dicts and namedtuples are read directly (the names
    pytree gives them, without its cost: this runs on every capture).

    >>> children({"a": 1}), children([5]), children(3), children(())
    ([('a', 1)], [('0', 5)], None, [])
    """
    if isinstance(value, (torch.Tensor, str, int, float, type(None))):  # leaves: no pytree question
        return None
    kind = type(value)
    if kind is tuple or kind is list:
        return [(str(index), item) for index, item in enumerate(value)]
    if kind is dict:
        return [(str(key), item) for key, item in value.items()]
    if tree_is_leaf(value):  # pytree keeps it whole
        return _opened_here(value)
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return list(zip(value._fields, value))
    flat = tree_flatten_with_path(value, is_leaf=lambda item: item is not value)[0]
    return [(_key_name(path[0]), item) for path, item in flat]


def named_leaves(value, prefix="", *, is_leaf=None):
    """``[(key, leaf)]`` of a nested value, in order; ``is_leaf(item)`` stops the walk at ``item``.

    Keys join the path with ``/`` after ``prefix`` (the value itself is keyed ``prefix``).
    ``None`` is a leaf; an empty container has none. :func:`leaves` takes the same
    arguments in the same order.

    >>> import collections
    >>> Pair = collections.namedtuple("Pair", "h c")
    >>> named_leaves((1, {"b": Pair(2, None)}, []), "out")
    [('out/0', 1), ('out/1/b/h', 2), ('out/1/b/c', None)]
    """
    if isinstance(value, (torch.Tensor, str, int, float, type(None))) or (
            is_leaf is not None and is_leaf(value)):
        return [(prefix, value)]
    items = children(value)
    if items is None:
        return [(prefix, value)]
    found = []
    for name, item in items:
        found.extend(named_leaves(item, f"{prefix}/{name}" if prefix else name, is_leaf=is_leaf))
    return found


def leaves(value: Any, prefix: str = "", *, is_leaf: Callable[[Any], bool]) -> list[tuple[str, Any]]:
    """``(key, leaf)`` for every leaf ``is_leaf`` accepts (the others left out): :func:`named_leaves`
    (same arguments, same order) filtered.

    >>> leaves((1, {"b": 2, "c": "x"}), is_leaf=lambda v: isinstance(v, int))
    [('0', 1), ('1/b', 2)]
    >>> leaves([3], "args", is_leaf=lambda v: isinstance(v, int))
    [('args/0', 3)]
    """
    return [(key, leaf) for key, leaf in named_leaves(value, prefix, is_leaf=is_leaf) if is_leaf(leaf)]


def flatten_tensors(value: Any, prefix: str = "", notes: list | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(key, tensor)`` for every tensor in a nested value, in order (keys as :func:`named_leaves`).

    ``notes`` (when given) receives a line per leaf that is neither a tensor nor None.

    >>> [k for k, _ in flatten_tensors((torch.ones(1), {"b": torch.ones(1)}), "blk")]
    ['blk/0', 'blk/1/b']
    >>> notes = []; _ = flatten_tensors((torch.ones(1), "text"), "blk", notes); notes
    ['blk/1: str is not a tensor, skipped']
    """
    found: list[tuple[str, torch.Tensor]] = []
    for name, leaf in named_leaves(value, prefix):
        if isinstance(leaf, torch.Tensor):
            found.append((name, leaf))
        elif leaf is not None and notes is not None:
            notes.append(f"{name}: {type(leaf).__name__} is not a tensor, skipped")
    return found


def _rebuilt(value: Any, items: list) -> Any:
    """``value``'s container (one :func:`children` opens) holding ``items`` instead."""
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(items)
    if kind is dict:
        return dict(zip(value.keys(), items))
    if isinstance(value, tuple) and hasattr(kind, "_fields"):
        return kind(*items)
    if not tree_is_leaf(value):  # a type pytree knows: pytree rebuilds it
        return tree_unflatten(items, tree_flatten_with_path(value, is_leaf=lambda item: item is not value)[1])
    if dataclasses.is_dataclass(value):
        new = copy.copy(value)
        for field, item in zip(dataclasses.fields(value), items):
            object.__setattr__(new, field.name, item)  # frozen dataclasses too
        return new
    if isinstance(value, dict):
        return kind(zip(value.keys(), items))
    if isinstance(value, slice):
        return slice(*items)
    return kind(items)


def map_leaves(function: Callable[[Any], Any], value: Any, is_leaf: Callable[[Any], bool]) -> Any:
    """``value`` rebuilt with ``function(leaf)`` in place of each leaf ``is_leaf`` accepts.

    >>> map_leaves(str, (1, {"k": [2, "x"]}), lambda item: isinstance(item, int))
    ('1', {'k': ['2', 'x']})
    """
    if is_leaf(value):
        return function(value)
    items = children(value)
    if items is None:
        return value
    return _rebuilt(value, [map_leaves(function, item, is_leaf) for _, item in items])


def map_tensors(function: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``value`` rebuilt with ``function(tensor)`` in place of each tensor; other leaves kept.

    >>> map_tensors(lambda t: t * 2, (torch.ones(1), {"k": [torch.ones(1), "x"]}))
    (tensor([2.]), {'k': [tensor([2.]), 'x']})
    """
    return map_leaves(function, value, _is_tensor)


def _is_tensor(value) -> bool:
    return isinstance(value, torch.Tensor)


def _clone(tensor: torch.Tensor) -> torch.Tensor:
    copied = tensor.detach().clone()
    if tensor.requires_grad:
        copied.requires_grad_(True)
    return copied


def clone_inputs(value: Any) -> Any:
    """A copy of nested inputs: tensors cloned (``requires_grad`` kept), the rest as is.

    >>> x = torch.ones(2, requires_grad=True)
    >>> y = clone_inputs((x, {"k": [x]}))
    >>> y[0] is x, y[0].requires_grad, y[1]["k"][0] is x
    (False, True, False)
    """
    return map_tensors(_clone, value)


WALKER_FUNCTIONS = (_key_name, _opened_here, children, named_leaves)
"""What the dumped folder's run.py copies (their source) to flatten outputs without fxdebug."""


def outputs_loss(value):
    """The one default loss: the scalar a default backward starts from, the sum of every
    floating tensor in ``value`` that requires grad (of a complex one, its real part), or
    None where there is none.

    check_equivalence, check_compiled, find_nonfinite and watch_nonfinite start backward
    from it; the dumped folder's run.py, which cannot import fxdebug, carries its source
    (``fxdebug.dumping.folder_runtime.RUN_PY_FUNCTIONS``).

    >>> out = {"a": torch.ones(2, requires_grad=True), "b": torch.ones(3), "n": 4}
    >>> outputs_loss(out)
    tensor(2., grad_fn=<SumBackward0>)
    >>> outputs_loss([torch.ones(2, dtype=torch.complex64, requires_grad=True)])
    tensor(2., grad_fn=<SumBackward0>)
    >>> outputs_loss(torch.ones(2)) is None
    True
    """
    terms = [t.real.sum() if t.is_complex() else t.sum() for _, t in named_leaves(value)
             if isinstance(t, torch.Tensor) and t.requires_grad and (t.is_floating_point() or t.is_complex())]
    return sum(terms[1:], terms[0]) if terms else None


JSON_DEPTH = 12
"""json_safe writes a value nested deeper than this as its ``str`` (a cycle cannot hang it)."""


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON-safe data: dataclasses and mappings as dicts, other containers as lists
    (opened as :func:`children` opens them), tensors as their shape and dtype, non-finite
    floats as text, reports as their ``to_dict()``, anything else as ``str``.

    What every report's ``to_dict()`` returns (:class:`fxdebug.tables.report.Report`).

    >>> json_safe({"t": torch.zeros(2, 3), "x": float("nan"), "xs": (1, "a")})
    {'t': {'shape': [2, 3], 'dtype': 'float32'}, 'x': 'nan', 'xs': [1, 'a']}
    """
    if depth > JSON_DEPTH:
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, Report):
        return value.to_dict()
    items = children(value)
    if items is None:
        shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
        if shape is not None and dtype is not None:  # a tensor (or array): its description, never its data
            return {"shape": list(shape), "dtype": str(dtype).replace("torch.", "")}
        return str(value)
    fields = dataclasses.is_dataclass(value)
    if fields or isinstance(value, dict):
        return {name: json_safe(item, depth + 1) for name, item in items
                if not (fields and name.startswith("_"))}
    return [json_safe(item, depth + 1) for _, item in items]


use_json_converter(json_safe)
