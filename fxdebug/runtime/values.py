"""Nested values (tuples, lists, dicts, namedtuples, dataclasses) of tensors: flatten, copy.

Module outputs come nested (``(h, {"gate": g})``, a transformers ``ModelOutput``);
captures flatten them into ``/`` keys (``enc/0``, ``enc/1/gate``), and runs that
must not see each other's in-place writes take copies of their inputs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

__all__ = ["children", "leaves", "flatten_tensors", "flatten_into", "clone_inputs"]


def children(value: Any) -> Iterable[tuple[Any, Any]] | None:
    """The named items of a container (namedtuple, tuple, list, dict, dataclass); None for a leaf.

    >>> list(children({"a": 1})), list(children([5])), children(3)
    ([('a', 1)], [(0, 5)], None)
    """
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return zip(value._fields, value)
    if isinstance(value, (tuple, list)):
        return enumerate(value)
    if isinstance(value, dict):
        return value.items()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return ((field.name, getattr(value, field.name)) for field in dataclasses.fields(value))
    return None


def leaves(value: Any, is_leaf: Callable[[Any], bool], path: str = "") -> list[tuple[str, Any]]:
    """``(path, leaf)`` for every leaf ``is_leaf`` accepts, nested names joined with ``/``.

    >>> leaves((1, {"b": 2, "c": "x"}), lambda v: isinstance(v, int))
    [('0', 1), ('1/b', 2)]
    """
    if is_leaf(value):
        return [(path, value)]
    found: list[tuple[str, Any]] = []
    for name, item in children(value) or ():
        found.extend(leaves(item, is_leaf, f"{path}/{name}" if path else str(name)))
    return found


def flatten_into(value: Any, key: str, out: list, notes: list) -> None:
    """Append ``(key/path, tensor)`` for every tensor in ``value`` to ``out``; a note per skipped leaf."""
    if isinstance(value, torch.Tensor):
        out.append((key, value))
        return
    items = children(value)
    if items is None:
        if value is not None:
            notes.append(f"{key}: {type(value).__name__} is not a tensor, skipped")
        return
    for name, item in items:
        flatten_into(item, f"{key}/{name}", out, notes)


def flatten_tensors(value: Any, key: str, notes: list | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(key/path, tensor)`` for every tensor in a nested value, in order.

    >>> [k for k, _ in flatten_tensors((torch.ones(1), {"b": torch.ones(1)}), "blk")]
    ['blk/0', 'blk/1/b']
    """
    found: list[tuple[str, torch.Tensor]] = []
    flatten_into(value, key, found, notes if notes is not None else [])
    return found


def clone_inputs(value: Any) -> Any:
    """A copy of nested inputs: tensors cloned (``requires_grad`` kept), the rest as is.

    >>> x = torch.ones(2, requires_grad=True)
    >>> y = clone_inputs((x, {"k": [x]}))
    >>> y[0] is x, y[0].requires_grad, y[1]["k"][0] is x
    (False, True, False)
    """
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        if value.requires_grad:
            copy.requires_grad_(True)
        return copy
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(clone_inputs(item) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(clone_inputs(item) for item in value)
    if isinstance(value, dict):
        return type(value)((key, clone_inputs(item)) for key, item in value.items())
    return value
