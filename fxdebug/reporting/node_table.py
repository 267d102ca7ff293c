"""``tabular`` / ``print_tabular``: torch's ``Graph.print_tabular`` made readable and stable.

torch prints targets as reprs with memory addresses (``<built-in method relu
of type object at 0x7f...>``) and nothing about shapes or where a node came
from. fxdebug prints one row per node::

    key             opcode       name            target          args           shape        dtype    module    source                           pass
    layer1.0.conv1  call_module  layer1_0_conv1  layer1.0.conv1  (maxpool,)     1x64x16x16   float32  layer1.0  torchvision/models/resnet.py:92  -

with canonical target names (``torch.relu``, ``operator.add``,
``layer1.0.conv1``), shapes and dtypes from a shape-propagation run when
inputs are given, the module path, the user's ``file:line`` and the pass that
inserted the node. Nothing in it depends on memory addresses or hash seeds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from .. import runtime
from ..base.fit_to_width import fit_table, table_width
from ..tracing.keys import META_PASS, META_SOURCE, module_path, node_key, target_name
from ..base.formatting import dtype_text, format_location, shape_text

__all__ = ["NodeView", "NodeRef", "node_views", "render_parts", "split_parts", "tabular_text",
           "print_tabular"]

COLUMNS = ("key", "opcode", "name", "target", "args", "kwargs", "shape", "dtype", "module",
           "source", "pass")
# Columns a narrow terminal gives up first.
TABULAR_DROP = ("kwargs", "name", "pass", "module", "opcode", "dtype", "args", "source")


@dataclasses.dataclass(frozen=True)
class NodeView:
    """One node as plain, printable data (what tables and diffs are made of)."""

    key: str
    opcode: str
    name: str
    target: str
    args: str
    kwargs: str
    shape: str
    dtype: str
    module: str
    source: str
    pass_name: str
    # args / kwargs in pieces, text and node names in turn (see split_parts): what diff renames
    args_parts: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    kwargs_parts: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def row(self) -> list[str]:
        return [self.key, self.opcode, self.name, self.target, self.args, self.kwargs,
                self.shape, self.dtype, self.module, self.source, self.pass_name]


class NodeRef(str):
    """A node's name inside rendered arguments (a ``str``; its type tells it from literal text)."""

    __slots__ = ()


def render_parts(value: Any) -> tuple[str, ...]:
    """Address-free text of a node argument, in pieces: node names are :class:`NodeRef`.

    ``"".join(render_parts(v))`` is the text; a rename replaces the ``NodeRef``
    pieces only, never text inside a quoted string.

    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> x = next(iter(gm.graph.nodes))
    >>> [(p, type(p).__name__) for p in render_parts((x, "x"))]
    [('(', 'str'), ('input_1', 'NodeRef'), (', ', 'str'), ("'x'", 'str'), (')', 'str')]
    """
    out: list[str] = []
    _parts(value, out)
    return tuple(out)


def split_parts(value: Any) -> tuple[str, ...]:
    """:func:`render_parts` as plain strings, text and node names in turn: the pieces at odd
    indices are node names, those at even indices the text between them (perhaps "").

    Plain ``str`` in a plain tuple: the garbage collector stops tracking such a tuple, where
    each :class:`NodeRef` is an object it tracks (a diff of 10k-node graphs kept 70k of them).

    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> x = next(iter(gm.graph.nodes))
    >>> split_parts((x, "x"))
    ('(', 'input_1', ", 'x')")
    """
    out: list[str] = []
    text: list[str] = []
    for part in render_parts(value):
        if type(part) is NodeRef:
            out.append("".join(text))
            out.append(str.__str__(part))
            text.clear()
        else:
            text.append(part)
    out.append("".join(text))
    return tuple(out)


def _joined(values, out: list[str]) -> None:
    for index, item in enumerate(values):
        if index:
            out.append(", ")
        kind = type(item)
        if kind is fx.Node:  # the common cases first: a 10k-node table renders 20k arguments
            out.append(NodeRef(item.name))
        elif kind in _PLAIN_LEAVES:
            out.append(repr(item))
        else:
            _parts(item, out)


_PLAIN_LEAVES = (int, float, bool, type(None))  # repr is their text (see _render_leaf)


def _parts(value: Any, out: list[str]) -> None:
    if isinstance(value, fx.Node):
        out.append(NodeRef(value.name))
    elif type(value) is tuple:
        out.append("(")
        _joined(value, out)
        out.append(",)" if len(value) == 1 else ")")
    elif isinstance(value, tuple) and hasattr(value, "_fields"):
        out.append(f"{type(value).__name__}(")
        _joined(value, out)
        out.append(")")
    elif isinstance(value, tuple):
        out.append("(")
        _joined(value, out)
        out.append(",)" if len(value) == 1 else ")")
    elif isinstance(value, list):
        out.append("[")
        _joined(value, out)
        out.append("]")
    elif isinstance(value, dict):
        out.append("{")
        for index, (key, item) in enumerate(value.items()):
            if index:
                out.append(", ")
            _parts(key, out)
            out.append(": ")
            _parts(item, out)
        out.append("}")
    elif isinstance(value, slice):
        out.append("slice(")
        _joined((value.start, value.stop, value.step), out)
        out.append(")")
    else:
        out.append(_render_leaf(value))


def _render(value: Any) -> str:
    """Address-free text of a node argument."""
    return "".join(render_parts(value))


def _render_leaf(value: Any) -> str:
    if isinstance(value, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.nn.Module):
        return type(value).__name__
    if isinstance(value, torch.Tensor):
        return f"tensor({shape_text(value.shape)} {value.dtype})"
    if callable(value):
        return target_name(value)
    text = repr(value)
    return type(value).__name__ if " at 0x" in text else text


def _target(node: fx.Node) -> str:
    if node.op == "call_function":
        return target_name(node.target)
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    return str(node.target)


def _shapes(gm: fx.GraphModule, inputs: tuple) -> dict[fx.Node, tuple[str, str]]:
    """Shape and dtype of every node's value from one run; fxdebug's own nodes are not run."""
    found: dict[fx.Node, tuple[str, str]] = {}

    class ShapeRun(fx.Interpreter):
        def run_node(self, node):
            if node.meta.get(META_PASS) and node.op == "call_function":
                if node.target in runtime.PASSES_THROUGH:  # a view of an input or a parameter
                    args, _ = self.fetch_args_kwargs_from_env(node)
                    return args[runtime.PASSES_THROUGH[node.target]]
                return None  # captures and hooks: nothing to propagate, no Records touched
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                found[node] = (shape_text(value.shape), dtype_text(value.dtype))
            elif isinstance(value, (tuple, list)) and value and all(
                    isinstance(v, torch.Tensor) for v in value):
                found[node] = (", ".join(shape_text(v.shape) for v in value), dtype_text(value[0].dtype))
            return value

    # eval mode: a shape run must not update batch-norm statistics (shared with the user's
    # model) or draw dropout masks; every module gets its own training flag back afterwards
    flags = [(module, module.training) for module in gm.modules()]
    try:
        gm.eval()
        with torch.no_grad():
            ShapeRun(gm).run(*inputs)
    finally:
        for module, training in flags:
            module.training = training
    return found


def node_views(gm: fx.GraphModule, *inputs) -> list[NodeView]:
    """Every node of ``gm`` as a :class:`NodeView`; shapes when ``inputs`` are given."""
    shapes = _shapes(gm, inputs) if inputs else {}
    views = []
    targets: dict[tuple[str, Any], str] = {}  # a graph names the same few targets and files
    locations: dict[tuple, str] = {}
    for node in gm.graph.nodes:
        source = node.meta.get(META_SOURCE)
        shape, dtype = shapes.get(node, ("-", "-"))
        args = split_parts(node.args)
        kwargs = split_parts(node.kwargs) if node.kwargs else ()
        key = (node.op, node.target)
        try:
            target = targets[key]
        except KeyError:
            target = targets[key] = _target(node)
        except TypeError:  # an unhashable target
            target = _target(node)
        where = "-"
        if source:
            source = tuple(source)
            where = locations.get(source) or locations.setdefault(source, format_location(source))
        views.append(NodeView(
            key=node_key(node), opcode=node.op, name=node.name, target=target,
            args="".join(args), kwargs="".join(kwargs),
            shape=shape, dtype=dtype, module=module_path(node) or "-", source=where,
            pass_name=node.meta.get(META_PASS, "-"), args_parts=args, kwargs_parts=kwargs))
    return views


def tabular_text(gm: fx.GraphModule, *inputs, wide: bool | None = None) -> str:
    """The node table of ``gm`` as a string (see the module docstring for the columns).

    Fitted to the terminal unless ``wide=True`` (see :mod:`fxdebug.base.fit_to_width`).

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU()))
        >>> print(tabular_text(gm, torch.ones(1, 2)).splitlines()[3])  # doctest: +ELLIPSIS
        0      call_module  _0      0         (input_1,)            1x3      float32  0 ...
    """
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"print_tabular expects a torch.fx.GraphModule, got {type(gm).__name__}; "
                        f"use fxdebug.trace(model) first.")
    rows = [view.row() for view in node_views(gm, *inputs)]
    return fit_table(rows, COLUMNS, width=table_width(wide), drop=TABULAR_DROP,
                     truncate=("key", "target", "args", "kwargs", "source"))


def print_tabular(gm: fx.GraphModule, *inputs, wide: bool | None = None, file=None) -> None:
    """Print the node table of ``gm``: ``Graph.print_tabular`` without addresses, with shapes
    (given ``inputs``) and sources. ``file``: where to print, as ``print``'s (an
    ``io.StringIO()`` for the text).

    >>> import torch, fxdebug
    >>> fxdebug.print_tabular(fxdebug.trace(torch.nn.ReLU()))  # doctest: +ELLIPSIS
    key     opcode       name    target    args     kwargs    shape    dtype    module    source    pass
    ...
    """
    print(tabular_text(gm, *inputs, wide=wide), file=file)
