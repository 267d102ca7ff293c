"""Gradient nodes: record a gradient, edit a gradient, without touching the caller's tensors.

Generated code (``grads=True`` and ``GradTransform.zero(include=["fc.bias"])``)::

    x_own = fxdebug_runtime_own_value(x)                  # x's uses in the graph go through x_own
    fc_bias = self.fc.bias
    edit_grads_fc_bias = fxdebug_runtime_edited_parameter(fxdebug_grad_edit_0, fc_bias, 'fc.bias')
    fc = fxdebug_runtime_call_with_parameters(self.fc, {'bias': edit_grads_fc_bias}, x_own)
    record_grads_fc = fxdebug_runtime_record_grads(fxdebug_recorder, fc, 'fc', 'Linear')

Every hook fxdebug registers sits on a tensor made by this forward (an
activation, or a view the forward takes of an input or a parameter), so it
lives exactly as long as that run's autograd graph: every backward through
the run sees it (``retain_graph=True``, ``autograd.grad``), and nothing
outside the instrumented module ever does. The caller's inputs and the
shared parameters never get a hook.
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling
from torch.fx.node import has_side_effect
from torch.overrides import TorchFunctionMode

from ..errors import FxdebugError
from .nodes import Recorder, emit_if_tracing
from .records import Records
from .torch_compat import add_tensor_hook, run_eagerly_from_compiled_code
from .values import flatten_tensors, map_tensors

__all__ = ["PASSES_THROUGH", "GradEdit", "own_value", "record_grads", "edit_grads", "edited_parameter",
           "call_with_parameters"]


def _own(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        return tensor.view_as(tensor)
    return tensor


@has_side_effect
def own_value(value):
    """``value`` with each tensor that requires grad replaced by a view this forward makes.

    Hooks then go on the view, never on the caller's tensor; the view's
    gradient is the gradient of the value through this forward.

    >>> import torch
    >>> from fxdebug.runtime import own_value
    >>> x = torch.ones(2, requires_grad=True)
    >>> own = own_value((x, [x]))
    >>> own[0] is x, own[0].grad_fn is not None, own[1][0] is x
    (False, True, False)
    """
    emitted = emit_if_tracing(own_value, (value,), {})
    if emitted is not None:
        return emitted
    return map_tensors(_own, value)


class _StoreGrad:
    """Tensor hook that files a gradient under its key; changes nothing."""

    __slots__ = ("records", "key", "op", "stats_only")

    def __init__(self, records: Records, key: str, op: str, stats_only: bool) -> None:
        self.records, self.key, self.op, self.stats_only = records, key, op, stats_only

    def __call__(self, grad):
        if self.stats_only:
            self.records.grads.add_grad_stats(self.key, self.op, grad)
        else:  # the short way of a capture node (one plain tensor; anything else: add)
            self.records.grads.add_tensor(self.key, self.op, grad)
        return None


@has_side_effect
def record_grads(recorder: Recorder, value, key: str, op: str, stats_only: bool = False):
    """Register a hook on every tensor in ``value`` that requires grad; the hook keeps its gradient.

    The hook sees the gradient of the value *at this node*, even when a later
    in-place op rewrites the tensor. Nothing is done under ``torch.no_grad()``.
    A leaf tensor (one the caller owns) never gets a hook: the GradHooks pass
    records inputs through :func:`own_value`; a leaf met here is noted.
    This runs once per hooked activation, so the usual value, one plain tensor,
    takes a short way (no walk of the value, no re-tracing check, torch's hook
    dict filled directly: :func:`~fxdebug.runtime.torch_compat.add_tensor_hook`).
    """
    if is_compiling():  # torch.compile traces: register the hooks eagerly (a graph break)
        from .compiled_grads import register_grad_hooks  # imports dynamo: only when compiling
        register_grad_hooks(record_grads, recorder, value, key, op, stats_only)
        return None
    if type(value) is torch.Tensor:  # one plain tensor (never an fx Proxy)
        if value.requires_grad and torch.is_grad_enabled():
            if value.grad_fn is None:
                _note_leaf(recorder.latest, key)
            else:
                add_tensor_hook(value, _StoreGrad(recorder.latest, key, op, stats_only))
        return None
    kwargs = {"stats_only": True} if stats_only else {}
    emitted = emit_if_tracing(record_grads, (recorder, value, key, op), kwargs)
    if emitted is not None:
        return emitted
    if torch.is_grad_enabled():
        records = recorder.latest
        for name, tensor in flatten_tensors(value, key):
            if not tensor.requires_grad:
                continue
            if tensor.is_leaf:
                _note_leaf(records, name)
                continue
            add_tensor_hook(tensor, _StoreGrad(records, name, op, stats_only))
    return None


# After the graph break, compiled code calls record_grads itself: dynamo runs it eagerly (see
# compiled_grads.py) instead of compiling a graph of it per new activation shape
run_eagerly_from_compiled_code(record_grads)


def _note_leaf(records: Records, name: str) -> None:
    records.notes.append(f"{name}: a leaf tensor of the caller (an input or a "
                         f"parameter); its gradient is its .grad, not recorded")


class GradEdit(torch.nn.Module):
    """Holds a gradient edit ``fn(grad) -> grad`` for ``edit_grads`` nodes (submodule ``fxdebug_grad_edit_N``).

    >>> edit = GradEdit(lambda g: g.clamp(min=0), "clamp(min=0)")
    >>> edit.fn(torch.tensor([-1.0, 2.0]))
    tensor([0., 2.])
    """

    def __init__(self, fn, description: str) -> None:
        super().__init__()
        if not callable(fn):
            raise TypeError(f"a gradient edit must be callable (grad -> grad), got {fn!r}")
        self.fn = fn
        self.description = description

    def forward(self, *args, **kwargs):
        raise TypeError("GradEdit is applied by edit_grads nodes and is not callable.")

    def extra_repr(self) -> str:
        return self.description


@has_side_effect
def edit_grads(edit: GradEdit, value, key: str):
    """Make backward use ``edit.fn(grad)`` instead of the gradient of ``value`` (activations).

    The hook goes on the activation this forward made, so it edits every
    backward through this run and nothing else.
    """
    emitted = emit_if_tracing(edit_grads, (edit, value, key), {})
    if emitted is not None:
        return emitted
    if not torch.is_grad_enabled():
        return None
    for name, tensor in flatten_tensors(value, key):
        if not tensor.requires_grad:
            continue
        if tensor.is_leaf:
            raise FxdebugError(
                f"GradTransform node {name!r}: the value is a leaf tensor the caller owns (an "
                f"input or a parameter), and a hook on it would edit gradients outside the "
                f"instrumented module. Re-run fxdebug.instrument so the pass edits it through "
                f"its use in the graph.")
        tensor.register_hook(edit.fn)
    return None


@has_side_effect
def edited_parameter(edit: GradEdit, parameter, key: str):
    """A view of ``parameter`` for this forward whose gradient backward replaces by ``edit.fn(grad)``.

    The graph uses the view wherever it used the parameter (directly, or
    inside a module through :func:`call_with_parameters`), so the edit
    applies to every backward through this run and the shared parameter
    itself never gets a hook.

    >>> import torch
    >>> from fxdebug.runtime import GradEdit, edited_parameter
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> view = edited_parameter(GradEdit(lambda g: g * 0, "zero"), w, "w")
    >>> (view * 3).sum().backward()
    >>> w.grad, w._backward_hooks
    (tensor([0., 0.]), None)
    """
    emitted = emit_if_tracing(edited_parameter, (edit, parameter, key), {})
    if emitted is not None:
        return emitted
    if not (isinstance(parameter, torch.Tensor) and parameter.requires_grad
            and torch.is_grad_enabled()):
        return parameter
    view = parameter.view_as(parameter)
    view.register_hook(edit.fn)
    return view


def _writes_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return ((name.endswith("_") and not name.endswith("__")) or name.startswith("__i")
            or name in ("__setitem__", "__get__", "__set__"))


class _UseViews(TorchFunctionMode):
    """While a module runs: every torch call that reads a parameter reads its edited view."""

    def __init__(self, views: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.views = views
        self.used: set[int] = set()

    def _swap(self, tensor: torch.Tensor) -> torch.Tensor:
        view = self.views.get(id(tensor))
        if view is None:
            return tensor
        self.used.add(id(tensor))
        return view

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _writes_in_place(func):
            args, kwargs = map_tensors(self._swap, args), map_tensors(self._swap, kwargs)
        return func(*args, **kwargs)


@has_side_effect
def call_with_parameters(module: torch.nn.Module, parameters: dict, *args, **kwargs):
    """Call ``module(*args, **kwargs)`` with each named parameter read as the given view.

    The module's attributes are never changed (other threads and the
    caller's model see the parameter itself): a thread-local torch function
    mode hands the view to every torch call that reads the parameter.
    """
    emitted = emit_if_tracing(call_with_parameters, (module, parameters) + args, kwargs)
    if emitted is not None:
        return emitted
    views = {}
    for name, view in parameters.items():
        parameter = module.get_parameter(name)
        if view is not parameter:
            views[id(parameter)] = view
    if not views:
        return module(*args, **kwargs)
    mode = _UseViews(views)
    with mode:
        result = module(*args, **kwargs)
    missed = [name for name, view in parameters.items()
              if view is not module.get_parameter(name)
              and id(module.get_parameter(name)) not in mode.used]
    if missed:
        raise FxdebugError(
            f"GradTransform: {type(module).__name__} ran without a torch call reading "
            f"parameter(s) {', '.join(map(repr, missed))} that fxdebug could see (a custom "
            f"autograd Function or C++ code reads it), so the gradient edit would be silently "
            f"lost. Edit the gradient of the module's output instead (include=[module key]).")
    return result


# fxdebug's nodes whose value the graph uses: which argument it stands for. A tool that runs
# the graph without fxdebug's nodes (shape propagation) uses that argument instead.
PASSES_THROUGH = {own_value: 0, edited_parameter: 1}
