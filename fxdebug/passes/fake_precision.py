"""FakePrecision: chosen nodes run in bfloat16, float16 or float8, everything else as it was.

Each converted node gets explicit rounding nodes around it (see
:mod:`fxdebug.runtime.fake_casts`), so ``gm.code`` shows what runs in which precision
and :func:`fxdebug.diff` shows the change like any pass's::

    fc1_in0_fake = fxdebug_runtime_fake_casts_fake_cast(x, 'float8_e4m3fn', None, None, None)
    fc1_module = self.fc1
    fc1_weight = self.fc1.weight
    fc1_weight_fake = fxdebug_runtime_fake_casts_fake_cast(fc1_weight, 'float8_e4m3fn', None, None, None)
    fc1 = fxdebug_runtime_call_with_parameters(fc1_module, {'weight': fc1_weight_fake}, fc1_in0_fake)
    fc1_fake = fxdebug_runtime_fake_casts_fake_cast(fc1, None, None, 'float8_e5m2', None)

What is rounded, by dtype:

* ``bfloat16`` / ``float16`` (autocast's way): every floating input of the node
  (parameters included) and its output, forward, and with ``grads=True`` the
  gradients flowing back into the node's output and out of its inputs.
* ``float8_e4m3fn`` / ``float8_e5m2`` (torchao's float8 training): the two operands of a
  matrix product (a Linear's input and weight, never its bias; a convolution's input and
  weight; ``matmul``, ``mm``, ``bmm``, ``addmm``, ``baddbmm``), each with its own amax
  scale; the product runs in float32 on the rounded values and its output stays float32.
  With ``grads=True`` the gradient flowing into the output is rounded too: to
  ``float8_e5m2`` with tensor-wise scaling, to ``float8_e4m3fn`` with row-wise scaling
  (torchao's recipes). Another node selected by its key has every floating input rounded.

Scaling (float8 only): ``"tensorwise"``, one scale per tensor; ``"rowwise"``, one scale
per row of the dimension the product reduces (a Linear's input: per row of its last
dimension; its weight: per output feature; a convolution's input per position over
channels, its weight per output channel). Scales are not rounded to powers of two.

Which nodes (``select``): keys or globs, and module classes. A pattern selects the nodes
whose key it matches (``"fc1"``, ``"*.ln_1"``) and the matrix products inside the modules
it names (``"layer1"``, ``"transformer.h.0.attn.c_attn"``); a class selects the matrix
products inside modules of that class and the calls of such modules. ``None``: every
matrix product.
"""

from __future__ import annotations

import difflib
import fnmatch
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..base import torch_compat
from ..errors import FxdebugError, SelectionError, renamed_arguments
from ..runtime import call_with_parameters
from ..runtime.fake_casts import FLOAT8, check_dtype, fake_cast
from ..tracing.keys import META_KEY, META_PASS, META_SOURCE, module_path, node_key
from ..tracing.selection import matches, patterns_and_classes
from ..tracing.unsupported import fsdp2_modules
from .base import Pass

__all__ = ["FakePrecision", "fake_precision", "precision_nodes", "is_matrix_product",
           "fake_output_key", "owning_module", "copy_graph_module", "refuse_sharded"]

_PASS = "fake-precision"
_SCALINGS = ("tensorwise", "rowwise")
_LEFT, _RIGHT, _ROWS = (-1,), (-2,), (-1,)  # rowwise axes: a [.., M, K] @ [.., K, N] product

_aten = torch.ops.aten
# call_function targets: {target: ((argument index, rowwise axis), ...)}
_Spec = tuple[tuple[int, "tuple[int, ...] | None"], ...]
_PRODUCTS: dict[object, _Spec] = {}
_PRODUCTS.update(dict.fromkeys((F.linear, _aten.linear.default), ((0, _ROWS), (1, _ROWS))))
_PRODUCTS.update(dict.fromkeys((torch.matmul, operator.matmul, torch.mm, torch.bmm,
                                _aten.matmul.default, _aten.mm.default, _aten.bmm.default),
                               ((0, _LEFT), (1, _RIGHT))))
_PRODUCTS.update(dict.fromkeys((torch.addmm, torch.baddbmm, _aten.addmm.default,
                                _aten.baddbmm.default), ((1, _LEFT), (2, _RIGHT))))
_PRODUCTS.update(dict.fromkeys((F.conv1d, F.conv2d, F.conv3d, _aten.conv1d.default,
                                _aten.conv2d.default, _aten.conv3d.default,
                                _aten.convolution.default),
                               ((0, (1,)), (1, None))))  # weight: all dims but the first
_METHODS = {"matmul": ((0, _LEFT), (1, _RIGHT)), "mm": ((0, _LEFT), (1, _RIGHT)),
            "bmm": ((0, _LEFT), (1, _RIGHT))}
_MODULES = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


def _module(gm: fx.GraphModule, node: fx.Node) -> torch.nn.Module | None:
    return gm.get_submodule(str(node.target)) if node.op == "call_module" else None


def is_matrix_product(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` is a matrix product float8 applies to (Linear, convolution, matmul).

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()))
    >>> [is_matrix_product(gm, n) for n in gm.graph.nodes]
    [False, True, False, False]
    """
    if node.op == "call_module":
        return isinstance(_module(gm, node), _MODULES)
    if node.op == "call_method":
        return node.target in _METHODS
    return node.op == "call_function" and node.target in _PRODUCTS


def owning_module(gm: fx.GraphModule, node: fx.Node) -> str:
    """The module path a node belongs to: a module call's target, else its enclosing module.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> [owning_module(gm, n) for n in gm.graph.nodes if n.op == "call_module"]
    ['0']
    """
    path = module_path(node)
    if path:
        return path
    modules = dict(gm.named_modules())
    parts = node_key(node).split(".")[:-1]
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts)


def _split(select) -> tuple[list[str], tuple[type, ...]]:
    return patterns_and_classes(select, "select=", "select=['fc1', torch.nn.Linear]",
                                skip=(fx.Node,))


def precision_nodes(gm: fx.GraphModule, select=None) -> list[fx.Node]:
    """The nodes ``select`` names for a precision change, in graph order (see the module doc).

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
    >>> [node_key(n) for n in precision_nodes(fxdebug.trace(net))]
    ['0', '2']
    >>> [node_key(n) for n in precision_nodes(fxdebug.trace(net), ["1", torch.nn.ReLU])]
    ['1']
    """
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")
             and META_PASS not in n.meta]
    if select is None:
        chosen = [n for n in nodes if is_matrix_product(gm, n)]
        if not chosen:
            raise SelectionError(f"{type(gm).__name__} has no matrix product (Linear, convolution, "
                                 f"matmul) to convert; name the nodes with select=[keys].")
        return chosen
    items = list(select) if isinstance(select, (list, tuple)) else [select]
    if items and all(isinstance(item, fx.Node) for item in items):  # these nodes, exactly
        return [n for n in nodes if n in items]
    patterns, types = _split(select)
    keys = [node_key(n) for n in nodes]
    for pattern in patterns:
        if not any(matches(key, pattern) for key in keys):
            close = difflib.get_close_matches(pattern, keys, n=3, cutoff=0.5)
            hint = f" Close keys: {', '.join(map(repr, close))}." if close else ""
            raise SelectionError(f"select pattern {pattern!r} matches no node key.{hint} "
                                 f"fxdebug.print_tabular(gm) lists every key.")
    chosen = []
    for node, key in zip(nodes, keys):
        product = is_matrix_product(gm, node)
        by_pattern = any(fnmatch.fnmatchcase(key, p) or (product and matches(key, p))
                         for p in patterns)
        owner = owning_module(gm, node)
        module = gm.get_submodule(owner) if owner else gm
        by_type = isinstance(module, types) and (product or node.op == "call_module")
        if (not patterns or by_pattern) and (not types or by_type):
            chosen.append(node)
    if not chosen:
        raise SelectionError(f"select={select!r} names no node to convert: patterns select nodes "
                             f"by key and the matrix products inside the modules they name; "
                             f"classes select the matrix products inside such modules.")
    return chosen


def fake_output_key(key: str) -> str:
    """The key of the node that rounds a converted node's output: ``"fc1:fake"``."""
    return f"{key}:fake"


def _axis(value: fx.Node, axis: tuple[int, ...] | None, weight_dims: int | None
          ) -> tuple[int, ...] | None:
    if axis is not None:
        return axis
    if weight_dims is None:  # a convolution weight seen only as a graph value: its rank
        val = value.meta.get("val", value.meta.get("tensor_meta"))
        weight_dims = len(val.shape) if val is not None and hasattr(val, "shape") else None
    return tuple(range(1, weight_dims)) if weight_dims else None


class FakePrecision(Pass):
    """Run the selected nodes in ``dtype`` (see the module doc), everything else unchanged.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    >>> FakePrecision(["0"], "bfloat16")(gm).modified
    True
    >>> gm.code.count("fake_cast(")
    4
    """

    name = _PASS

    @renamed_arguments({"backward": "grads"})
    def __init__(self, select=None, dtype: str = "bfloat16", scaling: str = "tensorwise",
                 grads: bool = True) -> None:
        self.dtype = check_dtype(dtype)
        if scaling not in _SCALINGS:
            raise FxdebugError(f"fxdebug.fake_precision: scaling={scaling!r}; use 'tensorwise' or "
                               f"'rowwise' (one amax scale per tensor or per row).")
        self.select, self.scaling, self.backward = select, scaling, bool(grads)

    def grad_precision(self) -> tuple[str | None, tuple[int, ...] | None]:
        """The gradient's precision at the node's output (and its rowwise axis)."""
        if not self.backward:
            return None, None
        if self.dtype not in FLOAT8:
            return self.dtype, None
        if self.scaling == "rowwise":
            return "float8_e4m3fn", _ROWS
        return "float8_e5m2", None

    def run(self, gm: fx.GraphModule) -> bool:
        for node in precision_nodes(gm, self.select):
            self._convert(gm, node)
        return True

    def _insert_cast(self, graph: fx.Graph, before: fx.Node, value: fx.Node, key: str, name: str,
                     axis) -> fx.Node:
        """A cast of ``value`` before ``before``, keyed ``key``, named ``name`` + ``_fake``."""
        float8 = self.dtype in FLOAT8
        grad = self.dtype if (self.backward and not float8) else None
        rowwise = axis if (float8 and self.scaling == "rowwise") else None
        with graph.inserting_before(before):
            cast = graph.create_node("call_function", fake_cast,
                                     (value, self.dtype, rowwise, grad, None), {},
                                     name=f"{name}_fake")
        cast.meta[META_KEY] = key
        cast.meta[META_PASS] = self.name
        cast.meta[META_SOURCE] = before.meta.get(META_SOURCE)
        return cast

    def operands(self, gm: fx.GraphModule, node: fx.Node
                 ) -> tuple[list[tuple[int, tuple[int, ...] | None]],
                            dict[str, tuple[int, ...] | None]]:
        """(argument index, rowwise axis) of the node's inputs to round, and its module's
        parameters to round {name: axis}."""
        module = _module(gm, node)
        float8 = self.dtype in FLOAT8
        node_args = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]
        if module is not None:
            if float8 and isinstance(module, _MODULES):
                conv = not isinstance(module, torch.nn.Linear)
                weight_axis = tuple(range(1, module.weight.dim())) if conv else _ROWS
                weights: dict[str, tuple[int, ...] | None] = {"weight": weight_axis}
                return [(0, (1,) if conv else _ROWS)], weights
            params: dict[str, tuple[int, ...] | None] = {
                name: _ROWS for name, p in module.named_parameters() if p.is_floating_point()}
            return [(i, _ROWS) for i in node_args], params
        spec = _METHODS.get(str(node.target)) if node.op == "call_method" else \
            _PRODUCTS.get(node.target)
        if float8 and spec is not None:
            return [(i, axis) for i, axis in spec if i < len(node.args)], {}
        return [(i, _ROWS) for i in node_args], {}

    def _convert(self, gm: fx.GraphModule, node: fx.Node) -> None:
        graph, key = gm.graph, node_key(node)
        operands, params = self.operands(gm, node)
        args: list[Any] = list(node.args)
        for index, axis in operands:
            value = args[index]
            if not isinstance(value, fx.Node):
                continue
            axis = _axis(value, axis, None) if axis is None else axis
            args[index] = self._insert_cast(graph, node, value, f"{key}:fake_in{index}",
                                            f"{node.name}_in{index}", axis)
        if params:
            with graph.inserting_before(node):
                module = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
            module.meta[META_KEY], module.meta[META_PASS] = f"{key}:module", self.name
            views = {}
            for pname, axis in params.items():
                with graph.inserting_before(node):
                    param = graph.create_node("get_attr", f"{node.target}.{pname}",
                                              name=f"{node.name}_{pname.replace('.', '_')}")
                param.meta[META_KEY], param.meta[META_PASS] = f"{key}:{pname}", self.name
                views[pname] = self._insert_cast(graph, node, param, f"{key}:fake_{pname}",
                                                 f"{node.name}_{pname.replace('.', '_')}", axis)
            node.op, node.target = "call_function", call_with_parameters
            args = [module, views] + args
        node.args = tuple(args)
        grad_dtype, grad_axis = self.grad_precision()
        out_dtype = None if self.dtype in FLOAT8 else self.dtype
        if out_dtype is None and grad_dtype is None:
            return
        with graph.inserting_after(node):
            out = graph.create_node("call_function", fake_cast,
                                    (node, out_dtype, None, grad_dtype, grad_axis), {},
                                    name=f"{node.name}_fake")
        node.replace_all_uses_with(out, delete_user_cb=lambda user: user is not out)
        out.meta[META_KEY], out.meta[META_PASS] = fake_output_key(key), self.name
        out.meta[META_SOURCE] = node.meta.get(META_SOURCE)


def refuse_sharded(model: torch.nn.Module, where: str) -> None:
    """Raise :class:`~fxdebug.errors.FxdebugError` for an FSDP2 or tensor-parallel model.

    The pass rewrites one graph that runs on one process; a sharded model's forward runs
    collectives, and a float8 scale on one rank's shard would be that shard's amax, not
    the full tensor's. :func:`fxdebug.precision_sensitivity` runs on sharded models (on an
    unsharded copy, every rank at once); the pass is refused with the way around it.

    >>> refuse_sharded(torch.nn.Linear(1, 1), "fxdebug.fake_precision")  # not sharded: nothing
    """
    why = ""
    sharded = fsdp2_modules(model)
    if sharded:
        why = f"fully_shard was applied to {sharded[0] or '(root)'!r}"
    elif torch.distributed.is_available():
        from torch.distributed.tensor import DTensor
        name = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
        why = f"parameter {name!r} is a DTensor (tensor parallelism)" if name else ""
    if why:
        raise FxdebugError(
            f"{where}: {type(model).__name__} is sharded ({why}); the pass rewrites a graph "
            f"that runs on one process, and on one rank's shard a float8 amax scale would be "
            f"the shard's, not the full tensor's. To measure what lower precision costs this "
            f"model, call fxdebug.precision_sensitivity(model, *batch) on every rank at once: "
            f"it runs on sharded models (on an unsharded copy, errors on full values), and "
            f"its report's choose() gives the nodes to convert. For the converted graph "
            f"itself, pass the unsharded model: build it unsharded and load the full state "
            f"dict (torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
            f"options=StateDictOptions(full_state_dict=True))).")


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A GraphModule with a copy of ``gm``'s graph, sharing its parameters and submodules.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Linear(2, 2))
    >>> copy_graph_module(gm).graph is gm.graph, copy_graph_module(gm).weight is gm.weight
    (False, True)
    """
    graph = fx.Graph(tracer_cls=torch_compat.graph_tracer_cls(gm.graph))
    torch_compat.copy_codegen(gm.graph, graph)
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    copied = fx.GraphModule(gm, graph, class_name=type(gm).__name__)
    copied.meta.update(gm.meta)
    return copied


@renamed_arguments({"backward": "grads"})
def fake_precision(model: torch.nn.Module, keys=None, dtype: str = "bfloat16",
                   scaling: str = "tensorwise", grads: bool = True) -> fx.GraphModule:
    """A GraphModule of ``model`` in which the nodes ``keys`` selects run in ``dtype``.

    ``model``: a module (traced with :func:`fxdebug.trace`) or a GraphModule from it
    (``fxdebug.trace(model, *inputs, frontend="auto")`` for models fx cannot trace), which
    is copied, not changed. ``keys``: keys, globs or module classes (``None``: every matrix
    product). ``dtype``: ``"bfloat16"``, ``"float16"``, ``"float8_e4m3fn"`` or
    ``"float8_e5m2"``. ``scaling``: ``"tensorwise"`` or ``"rowwise"`` (float8).
    ``grads``: round the gradients through the node as well (``backward=`` before).

    >>> import torch, fxdebug
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> gm = fxdebug.fake_precision(net, ["0"], "float8_e4m3fn")
    >>> names = [line.split(" = ")[0].strip() for line in gm.code.splitlines() if " = " in line]
    >>> [name for name in names if name.endswith("_fake")]
    ['_0_in0_fake', '_0_weight_fake', '_0_fake']
    >>> x = torch.randn(2, 4)
    >>> w8 = fxdebug.runtime.fake_casts.round_to(net[0].weight, "float8_e4m3fn")
    >>> x8 = fxdebug.runtime.fake_casts.round_to(x, "float8_e4m3fn")
    >>> torch.equal(gm(x), torch.relu(torch.nn.functional.linear(x8, w8, net[0].bias)))
    True
    """
    from ..frontend import trace

    refuse_sharded(model, "fxdebug.fake_precision")
    if isinstance(model, fx.GraphModule):
        gm = copy_graph_module(model)
    else:
        gm = trace(model)
    if not isinstance(gm, fx.GraphModule):
        raise FxdebugError(f"fxdebug.fake_precision: {type(model).__name__} could not be traced "
                           f"into one graph; trace it first with fxdebug.trace(model, *inputs, "
                           f"frontend='export') and pass the GraphModule.")
    FakePrecision(keys, dtype, scaling, grads)(gm)
    return gm
