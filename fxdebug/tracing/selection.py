"""Which nodes a pass acts on: ``"modules"``, ``"all"``, or keys and globs, by depth.

A pattern matches a key by ``fnmatch`` (case-sensitive), or when the key lies
inside the module the pattern names: ``"layer1"`` matches ``layer1``,
``layer1.0.conv1`` and ``layer1.0.add``; ``"*.conv1"`` matches every conv1.
A pattern that matches nothing in the graph is an error, so a typo never
silently captures nothing. A model without submodules (a forward of functional
ops only) has no module call: ``"modules"`` then selects its output, keyed
``output``.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
from typing import Iterable, Protocol, Sequence

import torch
import torch.fx as fx

from ..errors import SelectionError
from ..runtime import leaves
from .keys import META_PASS, META_RETURNS, META_SOURCE, node_key, op_name

__all__ = ["Target", "select", "matches", "key_depth", "candidates", "check_patterns",
           "close_keys_hint", "as_patterns", "root_output"]

_CAPTURABLE_OPS = ("placeholder", "call_function", "call_method", "call_module")


@dataclasses.dataclass(frozen=True)
class Target:
    """A value to act on: one node's output, or one (possibly nested) module output.

    ``value`` is the fx argument to pass on (a Node, or a dict of subpath to
    Node for nested module outputs); ``anchor`` is the node after which the
    value is complete.
    """

    key: str
    op: str
    value: fx.node.Argument
    nodes: tuple[fx.Node, ...]
    anchor: fx.Node
    is_module: bool
    source: tuple[str, int] | None = None


def key_depth(key: str) -> int:
    """Module nesting of a key: ``conv1`` 0, ``layer1.0`` 1, ``layer1.0.conv1`` 2."""
    return key.count(".")


def matches(key: str, pattern: str) -> bool:
    """Whether ``pattern`` selects ``key`` (glob, or the key lies in that module).

    >>> matches("layer1.0.conv1", "layer1"), matches("layer1.0.conv1", "*.conv1")
    (True, True)
    >>> matches("layer10.conv1", "layer1")
    False
    """
    return fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(key, pattern + ".*")


def candidates(gm: fx.GraphModule, every_node: bool) -> list[Target]:
    """Module outputs (and with ``every_node`` every value node), in graph order.

    ``candidates(gm, False)`` is ``[t for t in candidates(gm, True) if t.is_module]``.
    """
    by_name = {node.name: node for node in gm.graph.nodes}
    modules = dict(gm.named_modules(remove_duplicate=False))
    found: list[Target] = []
    for node in gm.graph.nodes:
        own = META_PASS in node.meta  # never act on fxdebug's own nodes (a module call's
        # return may end on one: the node that ran its forward hooks)
        if not own and (node.op == "call_module" or (every_node and node.op in _CAPTURABLE_OPS)):
            found.append(Target(node_key(node), op_name(node, gm, modules), node, (node,), node,
                                node.op == "call_module", node.meta.get(META_SOURCE)))
        for ret in node.meta.get(META_RETURNS, ()):
            items = [(subpath, by_name[name]) for subpath, name in ret.items if name in by_name]
            if not items:
                continue
            value = items[0][1] if len(items) == 1 and items[0][0] == "" else dict(items)
            found.append(Target(ret.key, ret.module_type, value,
                                tuple(dict.fromkeys(n for _, n in items)), node, True,
                                ret.source))
    return found


def root_output(gm: fx.GraphModule) -> list[Target]:
    """The graph's output as a target keyed ``output`` (op: the model's class), or ``[]``.

    >>> import torch, fxdebug
    >>> [(t.key, t.op) for t in root_output(fxdebug.trace(torch.nn.Identity()))]
    [('output', 'Identity')]
    """
    output = next((node for node in reversed(gm.graph.nodes) if node.op == "output"), None)
    if output is None or not output.args:
        return []
    items = leaves(output.args[0], is_leaf=lambda value: isinstance(value, fx.Node))
    if not items or output.prev is output or output.prev.op == "root":
        return []
    value = items[0][1] if len(items) == 1 and items[0][0] == "" else dict(items)
    return [Target("output", type(gm).__name__, value, tuple(dict.fromkeys(n for _, n in items)),
                   output.prev, True, output.meta.get(META_SOURCE))]


def close_keys_hint(pattern: str, keys: Sequence[str]) -> str:
    """" Close keys: ...", the keys most like a pattern that matched nothing ("" if none is close).

    >>> close_keys_hint("layer1.0.cnv1", ["layer1.0.conv1", "fc"])
    " Close keys: 'layer1.0.conv1'."
    """
    close = difflib.get_close_matches(pattern, keys, n=3, cutoff=0.5)
    return f" Close keys: {', '.join(map(repr, close))}." if close else ""


class Keyed(Protocol):
    """Anything with a ``key`` (a :class:`Target`, a part's module key)."""

    @property
    def key(self) -> str: ...


def check_patterns(kind: str, patterns: Sequence[str], pool: Sequence[Keyed]) -> None:
    keys = [target.key for target in pool]
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise SelectionError(f"{kind} entries must be keys or globs (str), got {pattern!r}.")
        if not any(matches(key, pattern) for key in keys):
            raise SelectionError(
                f"{kind} pattern {pattern!r} matches no node key.{close_keys_hint(pattern, keys)} "
                f"fxdebug.print_tabular(fxdebug.trace(model)) lists every key; globs like "
                f"'*.conv1' and module paths like 'layer1' work too.")


def as_patterns(kind: str, value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, Iterable):
        raise SelectionError(f"{kind} must be a key, a glob or a list of them, got {value!r}.")
    return list(value)


def patterns_and_classes(select, what: str, example: str, skip: tuple[type, ...] = ()
                         ) -> tuple[list[str], tuple[type, ...]]:
    """``select`` (a str, a module class, or a list of them) split into its patterns and its
    classes; items of a type in ``skip`` are passed over; anything else is named in a
    :class:`SelectionError` (``what``: the function and argument, ``example``: a good value).

    >>> patterns_and_classes(["*.attn", torch.nn.Linear], "f: select=", "['fc']")
    (['*.attn'], (<class 'torch.nn.modules.linear.Linear'>,))
    """
    patterns: list[str] = []
    classes: list[type] = []
    for item in select if isinstance(select, (list, tuple)) else [select]:
        if isinstance(item, str):
            patterns.append(item)
        elif isinstance(item, type) and issubclass(item, torch.nn.Module):
            classes.append(item)
        elif not isinstance(item, skip):
            raise SelectionError(
                f"{what} takes module-name patterns (str) and module classes (torch.nn.Linear), "
                f"or a list of them; got {item!r} of type {type(item).__name__}. Pass, e.g., "
                f"{example}.")
    return patterns, tuple(classes)


def select(gm: fx.GraphModule, capture="modules", depth: int | None = None,
           include=None, exclude=None) -> list[Target]:
    """The targets a pass acts on, in graph order, without duplicate keys.

    Args:
        capture: ``"modules"`` (every module call, leaf or not), ``"all"``
            (every node, plus module outputs) or a list of keys / globs.
        depth: keep keys nested at most this deep (``key.count(".") <= depth``),
            like hooks on ``named_modules()`` up to a level.
        include / exclude: keys or globs to keep / drop afterwards.
    """
    if depth is not None and (not isinstance(depth, int) or isinstance(depth, bool) or depth < 0):
        raise SelectionError(f"depth must be a non-negative int or None, got {depth!r}.")
    everything = candidates(gm, every_node=True)
    # candidates(gm, every_node=False), without walking the graph again: the same targets
    modules = [target for target in everything if target.is_module]
    if not modules:  # no submodule: the model's own output stands for its modules
        modules = root_output(gm)
        everything = everything + modules
    if isinstance(capture, str) and capture in ("modules", "all"):
        pool = everything if capture == "all" else modules
    elif isinstance(capture, str):
        raise SelectionError(f"capture={capture!r}: use 'modules', 'all', or a list of keys or "
                             f"globs such as ['layer1.0.conv1', '*.relu'].")
    else:
        patterns = as_patterns("capture", capture)
        check_patterns("capture", patterns, everything)
        pool = [t for t in everything if any(matches(t.key, p) for p in patterns)]
    includes = as_patterns("include", include)
    excludes = as_patterns("exclude", exclude)
    check_patterns("include", includes, everything)
    check_patterns("exclude", excludes, everything)
    chosen: dict[str, Target] = {}
    for target in pool:
        if depth is not None and key_depth(target.key) > depth:
            continue
        if includes and not any(matches(target.key, p) for p in includes):
            continue
        if any(matches(target.key, p) for p in excludes):
            continue
        chosen.setdefault(target.key, target)
    return list(chosen.values())
