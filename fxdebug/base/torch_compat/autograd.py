"""What autograd keeps private: a tensor's version counter, its dict of gradient hooks, and
the tensors a ``grad_fn`` saved for backward (with their saved-tensor hooks).
"""

from __future__ import annotations

import operator
from collections import OrderedDict

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["add_tensor_hook", "at_backward_end", "read_version", "saved_tensor_has_unpack_hooks",
           "saved_tensor_names", "tensor_version", "tensor_versions"]

# tensor._version (2.9.1, 2.14.1) read without a Python frame, for the capture fast path: it
# raises RuntimeError on an inference tensor and AttributeError where torch drops the
# attribute; the caller falls back to None (as tensor_version does).
read_version = operator.attrgetter("_version")


def at_backward_end(callback) -> bool:
    """Have ``callback()`` run once the backward pass now running ends, on the thread that
    started it (``torch.autograd.Variable._execution_engine.queue_callback``, what DDP and
    FSDP use; 2.9.1, 2.14.1). False where nothing is queued: outside a backward pass (a
    gradient hook called by hand) or where torch drops the name; the caller then does the
    work at once.

    >>> at_backward_end(lambda: None)  # no backward is running
    False
    """
    engine = getattr(getattr(torch.autograd, "Variable", None), "_execution_engine", None)
    queue = getattr(engine, "queue_callback", None)
    if queue is None:
        return False
    try:
        queue(callback)
    except RuntimeError:  # "Final callbacks can only be installed during backward pass"
        return False
    return True


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


def add_tensor_hook(tensor: torch.Tensor, hook) -> None:
    """``tensor.register_hook(hook)`` without the handle (it is never removed), at a sixth
    of its host time: what ``Tensor.register_hook`` does (2.9.1, 2.14.1), written out for
    a plain tensor that has a ``grad_fn``: file the hook in ``tensor._backward_hooks``
    (created on first use and given to ``grad_fn._register_hook_dict``, which runs the
    dict's hooks in backward) under a fresh ``RemovableHandle`` id, so a handle the caller
    holds never collides with it. Anything else (a subclass, a leaf, a torch without
    those names) goes through the public ``register_hook``.

    >>> x = torch.ones(2, requires_grad=True); y = x * 2; seen = []
    >>> add_tensor_hook(y, seen.append); y.sum().backward(); seen
    [tensor([1., 1.])]
    """
    fn = tensor.grad_fn
    if type(tensor) is not torch.Tensor or fn is None or not _HOOK_DICT:
        tensor.register_hook(hook)
        return
    hooks = tensor._backward_hooks
    if hooks is None:
        hooks = tensor._backward_hooks = OrderedDict()
        fn._register_hook_dict(tensor)
    key = RemovableHandle.next_id
    RemovableHandle.next_id = key + 1
    hooks[key] = hook


# the names add_tensor_hook writes out (2.9.1, 2.14.1); without them: register_hook
_HOOK_DICT = (hasattr(torch.Tensor, "_backward_hooks") and isinstance(
    getattr(RemovableHandle, "next_id", None), int) and hasattr(
    (torch.ones(1, requires_grad=True) * 1).grad_fn, "_register_hook_dict"))


def tensor_versions(tensors) -> list[int | None]:
    """:func:`tensor_version` of each tensor, in one call (``tensor._version``, 2.9.1, 2.14.1).

    >>> a = torch.zeros(1); before = tensor_versions([a]); _ = a.add_(1)
    >>> tensor_versions([a])[0] - before[0]
    1
    """
    try:
        return list(map(read_version, tensors))
    except (RuntimeError, AttributeError):
        return [tensor_version(tensor) for tensor in tensors]


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
