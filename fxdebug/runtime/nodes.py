"""The functions that fxdebug's inserted nodes call, and the Recorder they write to.

Generated code looks like this (resnet18, ``capture="modules"``)::

    fxdebug_recorder = self.fxdebug_recorder
    begin_run = fxdebug_runtime_begin_run(fxdebug_recorder, (x,))
    conv1 = self.conv1(x)
    capture_conv1 = fxdebug_runtime_capture(fxdebug_recorder, conv1, 'conv1', 'Conv2d')
    bn1 = self.bn1(conv1)
    capture_bn1 = fxdebug_runtime_capture(fxdebug_recorder, bn1, 'bn1', 'BatchNorm2d', clone = True)
    relu = self.relu(bn1)            # in place: that is why bn1's capture clones

Each function is registered with ``torch.fx.node.has_side_effect`` so
``eliminate_dead_code`` keeps the node, and emits itself again when called
with fx Proxies, so re-tracing (and ``torch.load`` of a saved GraphModule,
which re-traces) keeps the nodes. The runtime never imports the passes.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect, map_aggregate

from .records import Records
from .values import flatten_tensors

__all__ = ["Recorder", "RECORDER_ATTR", "GradEdit", "begin_run", "capture", "capture_stats",
           "record_grads", "edit_grads", "emit_if_tracing"]

# The attribute of an instrumented GraphModule that holds its Recorder.
RECORDER_ATTR = "fxdebug_recorder"


class Recorder(torch.nn.Module):
    """Submodule ``fxdebug_recorder`` of an instrumented GraphModule: holds the latest Records.

    It has no parameters and is never called; capture nodes read it through a
    ``get_attr`` node. Copies and pickles of the module start with empty
    Records (the values of a run belong to that run, not to the model).

    >>> Recorder().latest.keys()
    []
    """

    def __init__(self) -> None:
        super().__init__()
        self.latest = Records()

    def forward(self, *args, **kwargs):
        raise TypeError("Recorder holds fxdebug's Records and is not callable; "
                        "use fxdebug.records(gm) to read them.")

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__.copy()
        state = dict(state)
        state["latest"] = Records()
        return state


def _first_proxy(*values):
    found = []

    def visit(value):
        if isinstance(value, fx.Proxy) and not found:
            found.append(value)
        return value

    map_aggregate(values, visit)
    return found[0] if found else None


def emit_if_tracing(fn, args, kwargs):
    """Under re-tracing (an fx Proxy among the arguments): emit ``fn`` as a node and return its proxy."""
    proxy = _first_proxy(args, kwargs)
    if proxy is None:
        return None
    return proxy.tracer.create_proxy("call_function", fn, args, kwargs)


@has_side_effect
def begin_run(recorder: Recorder, inputs: tuple):
    """Start a new Records for this forward; ``inputs`` are the placeholders (kept for re-tracing)."""
    emitted = emit_if_tracing(begin_run, (recorder, inputs), {})
    if emitted is not None:
        return emitted
    if recorder.latest.accumulating:
        recorder.latest.start_run()  # statistics merge over runs (fxdebug.accumulate_stats)
    else:
        recorder.latest = Records()
    return None


@has_side_effect
def capture(recorder: Recorder, value, key: str, op: str, clone: bool = False):
    """Keep ``value`` (a tensor or nested structure of tensors) under ``key``.

    Tensors are stored as detached views; ``clone=True`` (set by the capture
    pass when a later in-place op writes to the value) stores a copy.
    """
    emitted = emit_if_tracing(capture, (recorder, value, key, op), {"clone": clone} if clone else {})
    if emitted is not None:
        return emitted
    recorder.latest.add(key, op, value, clone=clone)
    return None


@has_side_effect
def capture_stats(recorder: Recorder, value, key: str, op: str):
    """Keep only summary statistics of ``value`` under ``key`` (constant memory per node)."""
    emitted = emit_if_tracing(capture_stats, (recorder, value, key, op), {})
    if emitted is not None:
        return emitted
    recorder.latest.add(key, op, value, stats_only=True)
    return None


class _StoreGrad:
    """Tensor hook that files a gradient under its key; changes nothing."""

    __slots__ = ("records", "key", "op", "stats_only")

    def __init__(self, records: Records, key: str, op: str, stats_only: bool) -> None:
        self.records, self.key, self.op, self.stats_only = records, key, op, stats_only

    def __call__(self, grad):
        self.records.grads.add(self.key, self.op, grad, stats_only=self.stats_only)
        return None


@has_side_effect
def record_grads(recorder: Recorder, value, key: str, op: str, stats_only: bool = False):
    """Register a hook on every tensor in ``value`` that requires grad; the hook keeps its gradient.

    The hook sees the gradient of the value *at this node*, even when a later
    in-place op rewrites the tensor. Nothing is done under ``torch.no_grad()``.
    """
    kwargs = {"stats_only": True} if stats_only else {}
    emitted = emit_if_tracing(record_grads, (recorder, value, key, op), kwargs)
    if emitted is not None:
        return emitted
    if torch.is_grad_enabled():
        for name, tensor in flatten_tensors(value, key):
            if tensor.requires_grad:
                tensor.register_hook(_StoreGrad(recorder.latest, name, op, stats_only))
    return None


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
        self._leaf_handles: dict[str, object] = {}

    def forward(self, *args, **kwargs):
        raise TypeError("GradEdit is applied by edit_grads nodes and is not callable.")

    def extra_repr(self) -> str:
        return self.description

    def __getstate__(self):
        state = dict(super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__)
        state["_leaf_handles"] = {}
        return state


class _EditOnce:
    """Hook on a leaf tensor (a parameter): applies the edit to one backward, then removes itself."""

    __slots__ = ("fn", "handle")

    def __init__(self, fn) -> None:
        self.fn, self.handle = fn, None

    def __call__(self, grad):
        if self.handle is not None:
            self.handle.remove()
        return self.fn(grad)


@has_side_effect
def edit_grads(edit: GradEdit, value, key: str):
    """Make backward use ``edit.fn(grad)`` instead of the gradient of ``value``.

    Parameters (leaf tensors) are shared with the original model, so their
    hooks fire for one backward only and are replaced on the next forward:
    no hook outlives the run it belongs to.
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
            stale = edit._leaf_handles.pop(name, None)
            if stale is not None:
                stale.remove()
            once = _EditOnce(edit.fn)
            once.handle = tensor.register_hook(once)
            edit._leaf_handles[name] = once.handle
        else:
            tensor.register_hook(edit.fn)
    return None
