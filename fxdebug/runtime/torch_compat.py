"""Every private torch name fxdebug uses, in one place, each with a public fallback.

fxdebug supports every torch release of the last year (``torch>=2.9``). A
private name (``torch._dynamo``, ``torch.fx.graph_module._forward_from_src``,
``grad_fn._saved_*``, ...) may change in any release, so the rest of the
package never touches one: it calls the functions below. Each says which
private name it reads, the torch versions it was checked on, and what it
does when that name is missing (a public way to the same result, or a
clear "needs torch X" error, :func:`require_torch`); ``tests/test_private_torch.py``
fails on a private torch name anywhere else in the package.

>>> torch_version() >= MINIMUM_TORCH
True
"""

from __future__ import annotations

import sys
import traceback

import torch
import torch.fx as fx

from .torch_version import MINIMUM_TORCH, require_torch, torch_version  # re-exported

require_torch(MINIMUM_TORCH, "fxdebug")  # before any private name below can fail on an old torch

import torch.utils._pytree as _pytree  # noqa: E402  no public pytree module (2.9.1, 2.14.1)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402  no public twin (2.9.1, 2.14.1)

__all__ = ["MINIMUM_TORCH", "require_torch", "TorchDispatchMode", "torch_version", "tree_leaves",
           "tree_flatten", "tree_unflatten", "treespec_dumps", "is_op_overload", "ASSERT_IS_NONE",
           "DROPOUT_TYPES", "has_module_hooks", "tensor_version", "saved_tensor_names",
           "saved_tensor_has_unpack_hooks", "copy_codegen", "graph_tracer_cls", "set_child",
           "set_graph_tracer_cls", "own_parameters", "own_buffers", "own_children",
           "set_own_buffer", "PARAMETERS_ATTR", "BUFFERS_ATTR", "CHILDREN_ATTR",
           "GRAPH_MODULE_SHARED_ATTRS", "GRAPH_MODULE_HOOK_ATTRS",
           "CODE_ATTR", "generated_code", "is_export_guard_call", "is_autocast_function",
           "is_op_packet", "op_schema", "SET_GRAD_ENABLED", "ENTER_AUTOCAST", "EXIT_AUTOCAST",
           "AUTOCAST_NODE_FUNCTIONS", "CODE_ONLY_MODULE", "autocast_arguments", "lineno_map",
           "pytree_specs", "custom_builtin_imports", "def_line", "is_persistent_buffer",
           "compiled_inner", "lookup_backend", "inductor_backend", "graph_break_reason",
           "dynamo_frame_id", "foreach_norm", "foreach_copy_", "tree_flatten_with_path",
           "tree_is_leaf", "PYTREE_IMPORT", "assert_close_tolerances"]

# torch.utils._pytree (checked on 2.9.1 and 2.14.1; torch has no public twin). treespec_dumps:
# a TreeSpec as JSON, what a dumped script loads with torch.utils._pytree.treespec_loads.
tree_leaves, tree_flatten, tree_unflatten = _pytree.tree_leaves, _pytree.tree_flatten, _pytree.tree_unflatten
treespec_dumps = _pytree.treespec_dumps

tree_flatten_with_path, tree_is_leaf = _pytree.tree_flatten_with_path, _pytree.tree_is_leaf
"""``([(key path, leaf)], spec)`` and "kept whole" (2.9.1, 2.14.1; no public twin): the walk
:mod:`fxdebug.runtime.values`, fxdebug's one nested-value walker, is built on."""

PYTREE_IMPORT = "from torch.utils._pytree import tree_flatten_with_path, tree_is_leaf"
"""The line a dumped folder's run.py imports pytree's walk with (no fxdebug there)."""


def assert_close_tolerances() -> dict[torch.dtype, tuple[float, float]]:
    """``{dtype: (rtol, atol)}`` that ``torch.testing.assert_close`` picks by default.

    Private: ``torch.testing._comparison._DTYPE_PRECISIONS`` (checked on 2.9.1 and
    2.14.1, the same table on both). Fallback: that table as written in torch 2.14
    (``tests/test_trust_runtime.py`` checks it against assert_close's verdicts).

    >>> assert_close_tolerances()[torch.float32]
    (1.3e-06, 1e-05)
    """
    try:
        from torch.testing._comparison import _DTYPE_PRECISIONS
    except ImportError:  # pragma: no cover - a torch without it
        _DTYPE_PRECISIONS = {
            torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
            torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
            torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
            torch.complex128: (1e-7, 1e-7)}
    return {dtype: (float(rtol), float(atol)) for dtype, (rtol, atol) in _DTYPE_PRECISIONS.items()}


SET_GRAD_ENABLED = torch._C._set_grad_enabled
"""What ``no_grad``/``enable_grad`` call: the grad-mode node ``torch.export`` emits too
(2.9.1, 2.14.1). torch keeps it through dead-code elimination."""

ENTER_AUTOCAST, EXIT_AUTOCAST = (torch.amp.autocast_mode._enter_autocast,
                                 torch.amp.autocast_mode._exit_autocast)
"""The autocast nodes ``torch.export`` emits (2.9.1, 2.14.1); both reach a TorchFunctionMode."""

AUTOCAST_NODE_FUNCTIONS = (ENTER_AUTOCAST, EXIT_AUTOCAST)

CODE_ONLY_MODULE: type = getattr(fx.graph_module, "_CodeOnlyModule", fx.GraphModule)
"""What ``torch.load`` re-traces a saved GraphModule into (2.9.1, 2.14.1); GraphModule if gone."""


def autocast_arguments(autocast: torch.autocast) -> tuple:
    """``(device, dtype, enabled, cache_enabled)`` of a ``torch.autocast`` object, as
    ``ENTER_AUTOCAST`` takes them (its private ``_enabled``/``_cache_enabled``, 2.9.1 and
    2.14.1; the constructor's defaults where they are gone).

    >>> autocast_arguments(torch.autocast("cpu", dtype=torch.bfloat16))
    ('cpu', torch.bfloat16, True, True)
    """
    enabled = getattr(autocast, "_enabled", True)
    cache = getattr(autocast, "_cache_enabled", torch.is_autocast_cache_enabled())
    return (autocast.device, autocast.fast_dtype, enabled, cache)


def lineno_map(code_owner) -> dict[int, int | None]:
    r"""``{line of the generated forward: node index}`` of a GraphModule or ``PythonCode``.

    Lines count from the ``def forward`` line (0). Reads the private ``_lineno_map``
    that torch.fx sets on both (checked on 2.9.1 and 2.14.1); ``{}`` where it is gone
    (errors then name no node, nothing else changes).

    >>> gm = fx.symbolic_trace(torch.nn.ReLU())
    >>> lines, names = gm.code.split("\n"), [node.name for node in gm.graph.nodes]
    >>> [(names[index], lines[def_line(gm.code) + line].strip()[:16])
    ...  for line, index in lineno_map(gm).items() if index is not None][:2]
    [('input_1', 'input_1 = input'), ('relu', 'relu = torch.nn.')]
    """
    return dict(getattr(code_owner, "_lineno_map", None) or {})


def def_line(code: str) -> int:
    r"""Index of the ``def forward`` line in generated code (public text; no private offset).

    torch 2.14 keeps it as ``PythonCode._prologue_start``; 2.9 has no such field.

    >>> def_line("import torch\n\ndef forward(self, x):\n    return x")
    2
    """
    for index, line in enumerate(code.split("\n")):
        if line.startswith("def forward"):
            return index
    return 0


def is_persistent_buffer(module: torch.nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``module`` goes into its ``state_dict``.

    Reads ``module._non_persistent_buffers_set`` (2.9.1, 2.14.1); where it is gone,
    asks the public ``state_dict`` (slower, same answer).

    >>> bn = torch.nn.Module()
    >>> bn.register_buffer("kept", torch.zeros(1)); bn.register_buffer("scratch", torch.zeros(1), persistent=False)
    >>> is_persistent_buffer(bn, "kept"), is_persistent_buffer(bn, "scratch")
    (True, False)
    """
    private = getattr(module, "_non_persistent_buffers_set", None)
    if private is not None:
        return name not in private
    return name in module.state_dict(keep_vars=True)


def pytree_specs(graph: fx.Graph):
    """``(in_spec, out_spec)`` of a graph whose code flattens pytree inputs, else None.

    torch.fx's ``_PyTreeCodeGen`` holds them in ``pytree_info`` (2.9.1, 2.14.1); the
    check is on that public attribute, not the private class.

    >>> pytree_specs(fx.symbolic_trace(torch.nn.ReLU()).graph) is None
    True
    """
    info = getattr(getattr(graph, "_codegen", None), "pytree_info", None)
    if info is None:
        return None
    return info.in_spec, info.out_spec


def custom_builtin_imports() -> dict[str, str]:
    """``{name: import line}`` of what torch.fx's generated code uses without importing
    (``inf``, ``nan``, ``device``, ``torch``...): ``torch.fx.graph._custom_builtins``
    (2.9.1, 2.14.1); the known ones where it is gone.

    >>> custom_builtin_imports()["inf"]
    'from math import inf'
    """
    builtins = getattr(fx.graph, "_custom_builtins", None)
    if builtins is None:
        return {"inf": "from math import inf", "nan": "from math import nan",
                "NoneType": "NoneType = type(None)", "torch": "import torch",
                "device": "from torch import device", "fx_pytree": "import torch.fx._pytree as fx_pytree",
                "pytree": "import torch.utils._pytree as pytree"}
    return {name: builtin.import_str for name, builtin in builtins.items()}


def foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor, as 0-dim tensors on its device, without a host read.

    ``torch._foreach_norm`` (checked on 2.9.1 and 2.14.1): one fused kernel on CUDA, one
    call on the CPU. Where it is gone, ``torch.linalg.vector_norm`` of each tensor (the
    same values, one kernel per tensor). ``ord=math.inf`` is max|x|: exact, never
    overflowing, NaN where a value is NaN.

    >>> [round(float(n), 3) for n in foreach_norm([torch.ones(4), torch.full((2,), 3.0)])]
    [2.0, 4.243]
    >>> big = [torch.tensor([3e38, -3e38])]  # finite values whose 2-norm overflows
    >>> [bool(torch.isfinite(n)) for n in foreach_norm(big) + foreach_norm(big, ord=float("inf"))]
    [False, True]
    """
    fused = getattr(torch, "_foreach_norm", None)
    if fused is not None:
        return list(fused(tensors, ord))
    return [torch.linalg.vector_norm(t, ord) for t in tensors]


def foreach_copy_(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``target.copy_(source)`` for each pair, in one call where torch has one.

    ``torch._foreach_copy_`` (checked on 2.9.1 and 2.14.1); where it is gone, one
    ``Tensor.copy_`` per pair (the same result).

    >>> targets = [torch.zeros(2), torch.zeros(1)]
    >>> foreach_copy_(targets, [torch.ones(2), torch.full((1,), 3.0)])
    >>> [t.tolist() for t in targets]
    [[1.0, 1.0], [3.0]]
    """
    fused = getattr(torch, "_foreach_copy_", None)
    if fused is not None:
        fused(targets, sources)
        return
    for target, source in zip(targets, sources):
        target.copy_(source)


def is_op_packet(value) -> bool:
    """``value`` is an ``OpOverloadPacket`` such as ``torch.ops.aten.add`` (2.9.1, 2.14.1).

    >>> is_op_packet(torch.ops.aten.add), is_op_packet(torch.add)
    (True, False)
    """
    packet_type = getattr(torch._ops, "OpOverloadPacket", None)
    if packet_type is not None:
        return isinstance(value, packet_type)
    return callable(getattr(value, "overloads", None)) and hasattr(value, "default")


def op_schema(op) -> "torch.FunctionSchema":
    """The schema of an ``OpOverload`` (its ``_schema``, 2.9.1 and 2.14.1).

    >>> [arg.name for arg in op_schema(torch.ops.aten.relu.default).arguments]
    ['self']
    """
    return op._schema


def compiled_inner(module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``module`` is what it returned; else None.

    Private: ``torch._dynamo.eval_frame.OptimizedModule`` and its ``_orig_mod``
    (checked on torch 2.9.1 and 2.14.1; torch's own docs name ``_orig_mod``
    for state dicts). Fallback: a module whose class is named
    ``OptimizedModule`` and that holds a module in ``_orig_mod``. Never
    imports dynamo (a module compiled by torch.compile has loaded it).

    >>> compiled_inner(torch.nn.ReLU()) is None
    True
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is not None:
        if not isinstance(module, wrapper):
            return None
    elif type(module).__name__ != "OptimizedModule":
        return None
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def lookup_backend(name: str):
    """The dynamo backend callable ``(gm, example_inputs) -> callable`` registered as ``name``.

    Private: ``torch._dynamo.lookup_backend`` (checked on torch 2.9.1 and
    2.14.1; raises for an unknown name). Fallback: a backend that hands the
    graph to ``torch.compile(gm, backend=name)`` (public; dynamo traces the
    graph once more). Names: public ``torch.compiler.list_backends()``.

    >>> callable(lookup_backend("eager"))
    True
    """
    try:
        from torch._dynamo import lookup_backend as lookup
    except ImportError:  # pragma: no cover - a torch without it
        if name not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(f"unknown dynamo backend {name!r}") from None

        def by_name(gm, example_inputs):
            return torch.compile(gm, backend=name)
        return by_name
    return lookup(name)


def inductor_backend(mode: str):
    """A dynamo backend: inductor with the options of ``torch.compile(..., mode=mode)``.

    Private: ``torch._inductor.list_mode_options`` and
    ``torch._inductor.compile_fx.compile_fx(gm, example_inputs,
    config_patches=...)`` (checked on torch 2.9.1 and 2.14.1). Fallback:
    ``torch.compile(gm, backend="inductor", mode=mode)`` on the graph (public;
    dynamo traces the graph once more).

    >>> callable(inductor_backend("max-autotune"))
    True
    """
    try:
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx
    except ImportError:  # pragma: no cover - a torch without them
        def by_mode(gm, example_inputs):
            return torch.compile(gm, backend="inductor", mode=mode)
        return by_mode
    options = list_mode_options(mode)

    def inductor_with_mode(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=options)
    return inductor_with_mode


def graph_break_reason(gm) -> tuple[str, list[traceback.FrameSummary]] | None:
    """Why dynamo ended the graph ``gm`` at a graph break: ``(reason, user stack)``, else None.

    Private: the ``compile_subgraph_reason`` dynamo sets on each graph it
    hands a backend (a ``GraphCompileReason``: ``reason``, ``user_stack``,
    ``graph_break``), what ``torch._dynamo.explain`` reads (checked on torch
    2.9.1 and 2.14.1). Fallback: None (the graph is counted, its break
    reason is unknown).

    >>> graph_break_reason(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    True
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return str(getattr(reason, "reason", "")), list(getattr(reason, "user_stack", None) or ())


def dynamo_frame_id(gm) -> int | None:
    """The id of the Python frame dynamo captured ``gm`` from (None when unknown).

    Private: ``gm.meta["dynamo_compile_id"].frame_id`` (checked on torch 2.9.1
    and 2.14.1). Fallback: None (every graph counts as the start of a run).

    >>> dynamo_frame_id(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    True
    """
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    return getattr(compile_id, "frame_id", None)


def is_op_overload(value) -> bool:
    """``value`` is an ``OpOverload`` such as ``torch.ops.aten.add.Tensor`` (``torch._ops``,
    2.9.1 and 2.14.1; where it is gone: anything with an ``overloadpacket`` and a schema).

    >>> is_op_overload(torch.ops.aten.add.Tensor), is_op_overload(torch.ops.aten.add)
    (True, False)
    """
    overload_type = getattr(torch._ops, "OpOverload", None)
    if overload_type is not None:
        return isinstance(value, overload_type)
    return hasattr(value, "overloadpacket") and hasattr(value, "_schema")


ASSERT_IS_NONE = getattr(sys.modules.get("torch.fx._symbolic_trace"), "_assert_is_none", None)
"""The guard ``symbolic_trace(concrete_args={"x": None})`` inserts (``torch.fx._symbolic_trace.
_assert_is_none``, 2.9.1 and 2.14.1); None where it is gone (then no node matches it)."""

DROPOUT_TYPES: tuple[type[torch.nn.Module], ...] = tuple(dict.fromkeys(
    ([torch.nn.modules.dropout._DropoutNd] if hasattr(torch.nn.modules.dropout, "_DropoutNd")
     else [torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d])
    + [torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout]))
"""Every torch.nn dropout module type: the private base ``_DropoutNd`` (2.9.1, 2.14.1), or the
public classes where it is gone."""


def has_module_hooks(module: torch.nn.Module, backward: bool = True) -> bool:
    """Whether a call of ``module`` runs a hook: its own forward (pre-)hooks or the global ones
    (``register_module_forward_hook``), and with ``backward`` the backward ones too.

    Reads ``module._forward_hooks`` and friends and ``torch.nn.modules.module._global_*``
    (2.9.1, 2.14.1); where one is gone, answers True (a module that may have hooks is never
    treated as plain).

    >>> lin = torch.nn.Linear(1, 1)
    >>> has_module_hooks(lin), bool(lin.register_forward_hook(lambda *a: None)) and has_module_hooks(lin)
    (False, True)
    """
    kinds = ["forward_pre_hooks", "forward_hooks"] + (
        ["backward_hooks", "backward_pre_hooks"] if backward else [])
    missing = object()
    registries = [getattr(module, "_" + kind, missing) for kind in kinds]
    registries += [getattr(torch.nn.modules.module, "_global_" + kind, missing) for kind in kinds]
    return any(registry is missing or bool(registry) for registry in registries)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (``tensor._version``, 2.9.1 and 2.14.1); None for
    an inference tensor, which has none, or where torch drops the attribute.

    >>> t = torch.zeros(1); before = tensor_version(t); _ = t.add_(1); tensor_version(t) - before
    1
    """
    try:
        return tensor._version
    except (RuntimeError, AttributeError):
        return None


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def saved_tensor_names(fn) -> tuple[str, ...]:
    """Attributes of an autograd node that unpack the values it saved for backward.

    autograd names them ``_saved_<argument>`` (2.9.1, 2.14.1), and a custom Function's
    ``saved_tensors`` (with ``_raw_saved_tensors``). Where torch drops them: ``()`` (nothing
    to check; no wrong answer).

    >>> y = torch.ones(2, requires_grad=True).exp()
    >>> "_saved_result" in saved_tensor_names(y.grad_fn)
    True
    """
    kind = type(fn)
    if kind not in _SAVED_NAMES:
        names = [name for name in dir(fn) if name.startswith("_saved_")]
        if hasattr(fn, "saved_tensors") and hasattr(fn, "_raw_saved_tensors"):
            names.append("saved_tensors")
        _SAVED_NAMES[kind] = tuple(names)
    return _SAVED_NAMES[kind]


def saved_tensor_has_unpack_hooks(fn, name: str) -> bool:
    """Whether unpacking ``fn.<name>`` would run a saved-tensor hook (checkpointing, offload):
    reads ``_raw_<name>`` (2.9.1, 2.14.1) and its ``unpack_hook`` (2.14.1). torch 2.9's saved
    tensor has no ``unpack_hook`` (nor a public way to ask): False there, so lint_inplace on a
    checkpointed graph unpacks, i.e. recomputes, and may report a false hazard on torch 2.9.

    >>> y = torch.ones(2, requires_grad=True).exp()
    >>> saved_tensor_has_unpack_hooks(y.grad_fn, "_saved_result")
    False
    """
    raw = getattr(fn, "_raw_" + name.lstrip("_"), None)
    items = raw if isinstance(raw, (tuple, list)) else (raw,)
    return any(getattr(item, "unpack_hook", None) is not None for item in items)


def copy_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` the code generator of ``source`` (pytree in/out handling included).

    Reads ``source._codegen`` (2.9.1, 2.14.1) and sets it with the public ``set_codegen``.

    >>> source, target = fx.symbolic_trace(torch.nn.ReLU()).graph, fx.Graph()
    >>> copy_codegen(source, target)
    """
    codegen = getattr(source, "_codegen", None)
    if codegen is not None:
        target.set_codegen(codegen)


def graph_tracer_cls(graph: fx.Graph):
    """The tracer class a graph was made with (``graph._tracer_cls``, 2.9.1 and 2.14.1; None
    where it is gone), what ``fx.Graph(tracer_cls=...)`` takes.

    >>> graph_tracer_cls(fx.symbolic_trace(torch.nn.ReLU()).graph) is fx.Tracer
    True
    """
    return getattr(graph, "_tracer_cls", None)


def set_graph_tracer_cls(graph: fx.Graph, tracer_cls) -> None:
    """Set the tracer class ``torch.load`` re-traces a pickled GraphModule with
    (``graph._tracer_cls``, 2.9.1 and 2.14.1); None re-traces with ``fx.Tracer``.

    >>> graph = fx.Graph(); set_graph_tracer_cls(graph, None); graph_tracer_cls(graph) is None
    True
    """
    graph._tracer_cls = tracer_cls


PARAMETERS_ATTR, BUFFERS_ATTR, CHILDREN_ATTR = "_parameters", "_buffers", "_modules"
"""Where ``nn.Module`` keeps what it registers, in its ``__dict__`` (2.9.1, 2.14.1; unchanged
since torch 1.0). Read them with the functions below; change them with the public
``register_parameter``, ``register_buffer``, ``add_module`` or ``setattr``."""


def own_parameters(module: torch.nn.Module) -> dict:
    """``{name: Parameter or None}`` registered on ``module`` itself, in order, None slots
    and shared parameters included: ``module._parameters`` (2.9.1, 2.14.1; read only), else
    the public ``named_parameters(recurse=False, remove_duplicate=False)`` (no None slots).

    >>> list(own_parameters(torch.nn.Linear(1, 1)))
    ['weight', 'bias']
    """
    found = vars(module).get(PARAMETERS_ATTR)
    if found is None:
        return dict(module.named_parameters(recurse=False, remove_duplicate=False))
    return found


def own_buffers(module: torch.nn.Module) -> dict:
    """``{name: tensor or None}`` of the buffers registered on ``module`` itself (its
    ``_buffers``, 2.9.1 and 2.14.1; read only), else the public ``named_buffers``.

    >>> list(own_buffers(torch.nn.BatchNorm1d(2)))
    ['running_mean', 'running_var', 'num_batches_tracked']
    """
    found = vars(module).get(BUFFERS_ATTR)
    if found is None:
        return dict(module.named_buffers(recurse=False, remove_duplicate=False))
    return found


def own_children(module: torch.nn.Module) -> dict:
    """``{name: module or None}`` of the direct children, in order, a module registered under
    two names listed under both: ``module._modules`` (2.9.1, 2.14.1; read only), else the
    first level of the public ``named_modules(remove_duplicate=False)``.

    >>> list(own_children(torch.nn.Sequential(torch.nn.ReLU(), torch.nn.ReLU())))
    ['0', '1']
    """
    found = vars(module).get(CHILDREN_ATTR)
    if found is None:
        return {name: child for name, child in module.named_modules(remove_duplicate=False)
                if name and "." not in name}
    return found


def set_child(parent: torch.nn.Module, name: str, child: torch.nn.Module) -> None:
    """Register ``child`` as ``parent.<name>`` without running torch's global registration
    hooks (a copy, not a new module): writes ``_modules`` (2.9.1, 2.14.1), else ``add_module``.

    >>> parent = torch.nn.Module(); set_child(parent, "act", torch.nn.ReLU()); list(own_children(parent))
    ['act']
    """
    registry = vars(parent).get(CHILDREN_ATTR)
    if registry is None:
        parent.add_module(name, child)
    else:
        registry[name] = child


def set_own_buffer(module: torch.nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Replace the registered buffer ``name`` of ``module`` (persistence kept, no registration
    hook): writes ``_buffers`` (2.9.1, 2.14.1), else the public ``setattr``.

    >>> bn = torch.nn.BatchNorm1d(1); set_own_buffer(bn, "running_mean", torch.ones(1)); bn.running_mean
    tensor([1.])
    """
    registry = vars(module).get(BUFFERS_ATTR)
    if registry is None:
        setattr(module, name, tensor)
    else:
        registry[name] = tensor


GRAPH_MODULE_SHARED_ATTRS = ("_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls")
"""What a GraphModule keeps of its graph and generated code in its ``__dict__`` (2.9.1 has no
``_prologue_start``; 2.14.1 has them all): a copy may share them, read only."""

GRAPH_MODULE_HOOK_ATTRS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks",
                           "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                           "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
"""The hook registries of a module's ``__dict__`` (2.9.1, 2.14.1) that
``GraphModule.__deepcopy__`` does not copy."""

CODE_ATTR = "_code"
"""Where a GraphModule keeps its generated code, what ``gm.code``, ``print(gm)`` and
``to_folder`` read (2.9.1, 2.14.1); fxdebug's DebugGraphModule generates it on first read."""


def generated_code(gm: torch.nn.Module) -> str:
    """The code generated for ``gm`` so far, without generating it ("" when none yet).

    >>> generated_code(fx.symbolic_trace(torch.nn.ReLU())).strip().startswith("def forward")
    True
    """
    return vars(gm).get(CODE_ATTR, "")


def is_export_guard_call(node: fx.Node) -> bool:
    """A call of the shape-guard submodule (``_guards_fn``) some torch.export versions put
    in the graph of ``ExportedProgram.module()`` (2.9.1; not 2.14.1's default).

    >>> any(is_export_guard_call(n) for n in fx.symbolic_trace(torch.nn.ReLU()).graph.nodes)
    False
    """
    return node.op == "call_module" and str(node.target).startswith("_guards")


def is_autocast_function(target) -> bool:
    """``target`` enters or leaves an autocast region in an exported graph (the private
    ``_enter_autocast``/``_exit_autocast`` of ``torch.amp.autocast_mode``, 2.9.1 and 2.14.1,
    recognised by name so a re-imported copy counts too).

    >>> is_autocast_function(ENTER_AUTOCAST), is_autocast_function(torch.relu)
    (True, False)
    """
    return any(target is known for known in AUTOCAST_NODE_FUNCTIONS) or getattr(
        target, "__name__", "") in (
        "_enter_autocast", "_exit_autocast")
