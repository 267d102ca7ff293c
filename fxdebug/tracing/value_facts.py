"""What can be proven, before any run, about the dtypes and shapes of a traced graph's values.

:func:`~fxdebug.tracing.inplace_lowering.lower_inplace_operators` turns
``x += y`` into ``x + y`` only where both compute a tensor of the same dtype
and shape; this module proves it or says "unknown". Facts are sound, not
complete: equal facts mean equal dtypes (shapes) on every run that reaches the
nodes, whatever the inputs, a later ``model.half()``, or an autocast region
the caller opens around the model (on CPU, CUDA, MPS, XPU: the autocast
lists torch itself registers). Anything not proven is ``None``. A run on
example inputs (``FakeTensorProp``) cannot stand in: it says nothing of the
next input's shape or dtype; tests/test_value_facts.py checks these facts
against such runs instead, at several shapes, dtypes and autocast dtypes.

dtype labels (tuples, compared with ``==``)::

    ("value", name)            the dtype of that node's value: equal to itself only
    ("cast", kinds, label)     what a chain of casting ops made of ``label``'s dtype
    ("mix", kinds, base, name) ``a + b`` of two labels of one base: equal to itself only,
                               but ``base``'s dtype where all of ``kinds`` keep the dtype,
                               so a chain of casts that has all ``kinds`` makes it ``base``

A casting op (Conv, Linear, matmul, BatchNorm) keeps its input's dtype or
raises (a weight of another dtype), except under autocast, where torch's op
lists (one kernel per op and device) cast every floating input but float64
to one dtype: lower precision (conv, linear, matmul) or float32
(``batch_norm`` on MPS).
So each kind either keeps the dtype or casts to a constant, and a chain gives
what its outermost non-keeping kind gives: ``kinds`` lists each kind once,
outermost first (conv after bn after conv is spelled ``(conv, bn)``).

ReLU, GELU, Sigmoid, Dropout, MaxPool2d ... (no autocast kernel on any
device; tests/test_value_facts.py asks torch's dispatcher) keep the label of
a floating input (``sigmoid`` of an integer tensor is float32); views keep
any label; ``x + y`` with equal labels: that label.

Shapes: ``Shape(lead, dims)``, the last dims spelled out (an ``int``, a symbol
``("dim", node name, -i)``, or an expression of one: ``("+", dim, c)``,
``("cdiv", dim, a, s)`` = ``(dim + a) // s + 1``, a convolution's output size)
and ``lead = ("lead", node name, m)``: that node's dims except its last ``m``.
A convolution proves its input's channel count (``in_channels``), so
``conv(x)`` with stride 1 and "same" padding has the shape of ``x``.

A value that code fx cannot see may change in place (a leaf module or a
wrapped function receives it, or a tensor that may be the very same one,
``nn.Identity()(x)``: ``x.resize_``, ``x.set_``) or that an in-place shape
change reaches has no facts at all.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..base import torch_compat
from ..runtime.inplace_ops import INPLACE_OPERATORS
from .alias_rules import is_plain_torch_module, is_torch_callable

__all__ = ["ValueFacts", "Shape", "is_autocast_node"]

# Casting ops (see the module docstring): in torch's autocast lists, else dtype-keeping.
_CAST_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d,
                 nn.BatchNorm3d)
_CAST_FUNCTIONS = (operator.matmul, torch.matmul, torch.mm, torch.bmm, F.linear, F.conv1d,
                   F.conv2d, F.conv3d)
_NORM_MODULES = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
# Output dtype == a floating input's, on every device and autocast state (no autocast kernel).
_SHAPE_KEEPING_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.Hardtanh, nn.GELU, nn.SiLU,
                          nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Mish,
                          nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.Identity)
_DTYPE_KEEPING_MODULES = _SHAPE_KEEPING_MODULES + (nn.MaxPool1d, nn.MaxPool2d, nn.Flatten,
                                                   nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d)
# Elementwise: the shape and a floating input's dtype (sigmoid of an int tensor is float32).
_FLOAT_FUNCTIONS = (torch.relu, F.relu, F.dropout, torch.sigmoid, torch.tanh, F.hardsigmoid,
                    F.hardswish, F.silu, F.gelu)
# Views and copies: any input's dtype (clone and detach: its shape too).
_VIEW_FUNCTIONS = (torch.clone, torch.detach, torch.flatten, torch.transpose, torch.permute,
                   torch.squeeze, torch.unsqueeze, torch.reshape)
# Methods that keep any input's dtype (views, copies, relu).
_DTYPE_KEEPING_METHODS = ("view", "reshape", "flatten", "permute", "transpose", "contiguous",
                          "squeeze", "unsqueeze", "expand", "expand_as", "view_as",
                          "reshape_as", "clone", "detach", "t", "relu")
_SHAPE_KEEPING_METHODS = ("contiguous", "clone", "detach", "relu")
# Arithmetic whose result has its operands' dtype when both share one (truediv: floating only).
ARITHMETIC = (operator.add, operator.sub, operator.mul, operator.truediv, torch.add,
              torch.sub, torch.mul, torch.div)
_TRUE_DIVISIONS = (operator.truediv, torch.div)
# In-place methods that change a tensor's shape or dtype.
_RESHAPING_METHODS = frozenset(("resize_", "resize_as_", "set_", "as_strided_", "squeeze_",
                                "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_"))


class Shape(NamedTuple):
    """A value's shape: ``lead`` (some node's dims but its last m) then ``dims``."""

    lead: tuple
    dims: tuple


def is_autocast_node(node: fx.Node) -> bool:
    return node.op == "call_function" and torch_compat.is_autocast_function(node.target)


def _module(root: nn.Module, node: fx.Node):
    try:
        return root.get_submodule(str(node.target))
    except AttributeError:
        return None


def _plus(dim, constant: int):
    if constant == 0:
        return dim
    if isinstance(dim, int):
        return dim + constant
    if dim[0] == "+":
        return _plus(dim[1], dim[2] + constant)
    return ("+", dim, constant)


def _conv_size(dim, kernel: int, stride: int, padding: int, dilation: int):
    offset = 2 * padding - dilation * (kernel - 1) - 1
    if isinstance(dim, int):
        return (dim + offset) // stride + 1
    if stride == 1:
        return _plus(dim, offset + 1)
    return ("cdiv", dim, offset, stride)


def _is_number(value) -> bool:
    return isinstance(value, (bool, int, float)) and not isinstance(value, complex)


class ValueFacts:
    """dtype labels, shapes and "is floating point" of a graph's nodes, computed in order.

    Call :meth:`visit` on each node in graph order (after deciding what to do with
    it); :meth:`dtype`, :meth:`shape` and :meth:`floating` then answer for it.

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Conv2d(3, 3, 3, padding=1), torch.nn.ReLU())
    >>> gm = torch.fx.symbolic_trace(net)
    >>> facts = ValueFacts(gm.graph, gm)
    >>> for node in gm.graph.nodes:
    ...     facts.visit(node)
    >>> x, conv, relu, _ = gm.graph.nodes
    >>> facts.same_shape(x, relu), facts.dtype(relu) == ("cast", ("Conv2d:zeros",), ("value", x.name))
    (True, True)
    >>> facts.floating(relu), facts.floating(x)      # conv weights are; the input may be anything
    (True, False)
    """

    def __init__(self, graph: fx.Graph, root: nn.Module) -> None:
        self.root = root
        self._dtype: dict[fx.Node, tuple | None] = {}
        self._shape: dict[fx.Node, Shape | None] = {}
        self._floating: dict[fx.Node, bool] = {}
        self._known: dict[tuple, int] = {}
        self.autocast_inside = any(is_autocast_node(node) for node in graph.nodes)
        self._unstable: dict[fx.Node, None] = {}
        for node in graph.nodes:
            if self._may_reshape_inputs(node):
                self._unstable.update(dict.fromkeys(node.all_input_nodes))
        for node in reversed(graph.nodes):  # and what may be the very same tensor
            if node in self._unstable and self._may_return_input(node):
                self._unstable.update(dict.fromkeys(node.all_input_nodes))

    def _may_reshape_inputs(self, node: fx.Node) -> bool:
        """Code fx cannot see receives the inputs, or an in-place method reshapes them."""
        if node.op == "call_method":
            return str(node.target) in _RESHAPING_METHODS
        if node.op == "call_function":
            return not is_torch_callable(node.target)
        if node.op == "call_module":
            return not is_plain_torch_module(_module(self.root, node))
        return False

    def _may_return_input(self, node: fx.Node) -> bool:
        """The node's value may be an input tensor itself (``Identity``, ``x.add_``, ``+=``)."""
        if node.op == "call_method" or self._may_reshape_inputs(node):
            return True
        if node.op == "call_function":
            return node.target in INPLACE_OPERATORS or node.target in _FLOAT_FUNCTIONS \
                or node.target in _VIEW_FUNCTIONS
        return node.op == "call_module" and type(_module(self.root, node)) in _DTYPE_KEEPING_MODULES

    # -- answers -------------------------------------------------------------------------
    def dtype(self, value) -> tuple | None:
        return self._dtype.get(value) if isinstance(value, fx.Node) else None

    def shape(self, value) -> Shape | None:
        return self._shape.get(value) if isinstance(value, fx.Node) else None

    def floating(self, value) -> bool:
        return isinstance(value, fx.Node) and self._floating.get(value, False)

    def same_dtype(self, a, b) -> bool:
        label = self.dtype(a)
        return label is not None and label == self.dtype(b)

    def same_shape(self, a, b) -> bool:
        sa, sb = self.shape(a), self.shape(b)
        return sa is not None and sb is not None and self._equal(sa, sb)

    def broadcasts_into(self, a, b) -> bool:
        """Whether broadcasting ``a`` with ``b`` gives ``a``'s shape (``a += b`` keeps it)."""
        sa, sb = self.shape(a), self.shape(b)
        if sa is None or sb is None:
            return False
        both = self._broadcast(sa, sb)
        return both is not None and self._equal(both, sa)

    # -- shapes ----------------------------------------------------------------------------
    def _expand(self, shape: Shape, width: int) -> Shape:
        """The same shape with at least ``width`` dims spelled out."""
        missing = width - len(shape.dims)
        if missing <= 0:
            return shape
        _, base, spelled = shape.lead
        new = tuple(("dim", base, -index) for index in range(spelled + missing, spelled, -1))
        return Shape(("lead", base, spelled + missing), new + shape.dims)

    def _equal(self, sa: Shape, sb: Shape) -> bool:
        width = max(len(sa.dims), len(sb.dims))
        sa, sb = self._expand(sa, width), self._expand(sb, width)
        return sa.lead == sb.lead and all(self._resolve(p) == self._resolve(q)
                                          for p, q in zip(sa.dims, sb.dims))

    def _broadcast(self, sa: Shape | None, sb: Shape | None) -> Shape | None:
        """The shape of ``a + b`` where provable (same leading dims, each dim equal or 1)."""
        if sa is None or sb is None:
            return None
        width = max(len(sa.dims), len(sb.dims))
        sa, sb = self._expand(sa, width), self._expand(sb, width)
        if sa.lead != sb.lead:
            return None
        dims = []
        for p, q in zip(sa.dims, sb.dims):
            p, q = self._resolve(p), self._resolve(q)
            if p == q or q == 1:
                dims.append(p)
            elif p == 1:
                dims.append(q)
            else:
                return None
        return Shape(sa.lead, tuple(dims))

    def _resolve(self, dim):
        if isinstance(dim, int):
            return dim
        if dim[0] == "dim":
            return self._known.get(dim, dim)
        inner = self._resolve(dim[1])
        if dim[0] == "+":
            return _plus(inner, dim[2])
        if isinstance(inner, int):
            return (inner + dim[2]) // dim[3] + 1
        return ("cdiv", inner, dim[2], dim[3])

    def _require(self, dim, size: int) -> bool:
        """An op that ran checked ``dim == size``; False where it cannot have run."""
        dim = self._resolve(dim)
        if isinstance(dim, int):
            return dim == size
        if dim[0] == "dim":
            self._known[dim] = size
        return True

    def _conv_shape(self, module, source: Shape | None) -> Shape | None:
        if source is None:
            return None
        spatial = len(module.kernel_size)
        shape = self._expand(source, spatial + 1)
        if not self._require(shape.dims[-spatial - 1], module.in_channels):
            return None
        sizes = []
        for index, dim in enumerate(shape.dims[-spatial:]):
            if module.padding == "same":
                sizes.append(dim)
                continue
            padding = 0 if module.padding == "valid" else module.padding[index]
            sizes.append(_conv_size(dim, module.kernel_size[index], module.stride[index],
                                    padding, module.dilation[index]))
        return Shape(shape.lead, shape.dims[:-spatial - 1] + (module.out_channels, *sizes))

    def _pooled_shape(self, module, source: Shape | None) -> Shape | None:
        """AdaptiveAvgPool1d/2d: the last dims become ``output_size`` (None: kept)."""
        if source is None:
            return None
        spatial = 1 if isinstance(module, nn.AdaptiveAvgPool1d) else 2
        sizes = module.output_size
        sizes = (sizes,) * spatial if isinstance(sizes, int) or sizes is None else tuple(sizes)
        shape = self._expand(source, spatial)
        kept = shape.dims[-spatial:]
        new = tuple(dim if size is None else size for dim, size in zip(kept, sizes))
        return Shape(shape.lead, shape.dims[:-spatial] + new)

    def _linear_shape(self, module: nn.Linear, source: Shape | None) -> Shape | None:
        if source is None:
            return None
        shape = self._expand(source, 1)
        if not self._require(shape.dims[-1], module.in_features):
            return None
        return Shape(shape.lead, shape.dims[:-1] + (module.out_features,))

    # -- one node --------------------------------------------------------------------------
    def visit(self, node: fx.Node) -> None:
        """Work out ``node``'s facts from its inputs' (visit nodes in graph order)."""
        dtype: tuple[Any, ...] | None = ("value", node.name)
        shape: Shape | None = None
        floating = False
        opaque = Shape(("lead", node.name, 0), ())
        first = node.args[0] if node.args else None
        if node.op == "placeholder":
            shape = opaque
        elif node.op == "get_attr":
            value: Any = self.root
            for part in str(node.target).split("."):
                value = getattr(value, part, None)
            floating = isinstance(value, torch.Tensor) and value.is_floating_point()
            shape = opaque
        elif node.op == "call_module":
            dtype, shape, floating = self._module_facts(node, first, dtype, opaque)
        elif node.op == "call_function":
            dtype, shape, floating = self._function_facts(node, first, dtype, opaque)
        elif node.op == "call_method":
            name, shape = str(node.target), opaque
            if name in _DTYPE_KEEPING_METHODS and not any(
                    isinstance(a, torch.dtype) for a in (*node.args, *node.kwargs.values())):
                dtype, floating = self.dtype(first), self.floating(first)
                shape = self.shape(first) if name in _SHAPE_KEEPING_METHODS else opaque
        if node in self._unstable:
            dtype, shape, floating = None, None, False
        self._dtype[node], self._shape[node], self._floating[node] = dtype, shape, floating

    def _cast(self, label, kind: str):
        """``label`` through one more casting op of ``kind`` (each kind once, outermost first)."""
        if label is None or self.autocast_inside:
            return None
        kinds, inner = (kind,), label
        if label[0] == "cast":
            kinds, inner = (kind, *(k for k in label[1] if k != kind)), label[2]
        if inner[0] == "mix" and set(inner[1]) <= set(kinds):
            inner = inner[2]  # where all of kinds keep the dtype, the mix has its base's
        return ("cast", kinds, inner)

    @staticmethod
    def _mixed(name: str, a, b):
        """The label of ``a + b`` for labels of one base: its base's dtype where its kinds keep."""
        parts = []
        for label in (a, b):
            kinds, inner = (label[1], label[2]) if label[0] == "cast" else ((), label)
            if inner[0] == "mix":
                kinds, inner = kinds + inner[1], inner[2]
            parts.append((kinds, inner))
        (kinds_a, base), (kinds_b, base_b) = parts
        if base != base_b:
            return ("value", name)
        kinds = tuple(sorted(set(kinds_a + kinds_b)))
        return ("mix", kinds, base, name) if kinds else base

    def _module_facts(self, node, first, dtype, opaque):
        module = _module(self.root, node)
        shape, floating = opaque, False
        if not is_plain_torch_module(module) or not isinstance(first, fx.Node):
            return dtype, shape, floating
        kind = type(module)
        if kind in _CAST_MODULES:
            weight = module.weight
            floating = weight is not None and weight.is_floating_point()
            name = f"{kind.__name__}:{getattr(module, 'padding_mode', '')}"
            dtype = self._cast(self.dtype(first), name)
            if kind is nn.Linear:
                shape = self._linear_shape(module, self.shape(first))
            elif kind in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
                shape = self._conv_shape(module, self.shape(first))
        if kind in _NORM_MODULES:
            floating, shape = True, self.shape(first)
        if kind in _DTYPE_KEEPING_MODULES and self.floating(first):
            dtype, floating = self.dtype(first), True
        if kind in _SHAPE_KEEPING_MODULES:
            shape = self.shape(first)
        if kind in (nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d):
            shape = self._pooled_shape(module, self.shape(first))
        return dtype, shape, floating

    def _function_facts(self, node, first, dtype, opaque):
        target = node.target
        shape, floating = opaque, False
        if "out" in node.kwargs or not isinstance(first, fx.Node):
            return dtype, shape, floating
        if target in _CAST_FUNCTIONS:  # both operands have one dtype (or autocast casts both)
            floating = any(self.floating(arg) for arg in node.args[:2])
            return self._cast(self.dtype(first), target.__name__), opaque, floating
        if target in _FLOAT_FUNCTIONS:
            if not self.floating(first):
                return dtype, self.shape(first), False
            return self.dtype(first), self.shape(first), True
        if target in _VIEW_FUNCTIONS:
            shape = self.shape(first) if target in (torch.clone, torch.detach) else opaque
            return self.dtype(first), shape, self.floating(first)
        if target in INPLACE_OPERATORS:  # left in place: the result is the left operand
            return self.dtype(first), self.shape(first), self.floating(first)
        if target in ARITHMETIC and len(node.args) == 2:
            return self._arithmetic_facts(target, first, node.args[1], dtype, opaque)
        return dtype, shape, floating

    def _arithmetic_facts(self, target, left, right, dtype, opaque):
        if _is_number(right):  # a Python number never widens a floating tensor's dtype
            kept = self.floating(left)
            return (self.dtype(left) if kept else dtype), self.shape(left), kept
        if target in _TRUE_DIVISIONS and not self.floating(left):
            return dtype, self._broadcast(self.shape(left), self.shape(right)) or opaque, False
        if self.same_dtype(left, right):
            dtype = self.dtype(left)
        elif self.dtype(left) is not None and self.dtype(right) is not None:
            dtype = self._mixed(dtype[1], self.dtype(left), self.dtype(right))
        floating = self.floating(left) and self.floating(right)
        return dtype, self._broadcast(self.shape(left), self.shape(right)) or opaque, floating

    def binary_keeps_left(self, target, left, right) -> bool:
        """Whether ``target(left, right)`` has ``left``'s dtype and shape (proven)."""
        if target in _TRUE_DIVISIONS and not self.floating(left):
            return False
        if _is_number(right):  # a Python number never widens a floating tensor's dtype
            return self.floating(left)
        return self.same_dtype(left, right) and self.broadcasts_into(left, right)
