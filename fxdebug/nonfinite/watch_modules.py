"""A watch's replay for a model torch.fx cannot trace: module by module, with forward hooks.

``find_nonfinite`` runs a traced graph node by node. A model whose root cannot be
traced (a Hugging Face model called as ``model(input_ids=..., labels=...)``) is
replayed here instead, once, with a forward hook on every module::

    replay_by_modules(module, args, kwargs, loss)
      ├─ forward hooks on every module (removed after the run): a module whose output
      │    is non-finite is a hit, keyed by its path and call (``encoder.layer.1``,
      │    ``fc_1`` for a second call, as fxdebug keys module calls); it CREATED the
      │    values when what it received (its arguments and its own parameters and
      │    buffers) was finite and no module it called made them. Hooks fire as calls
      │    return, so the first hit is the innermost module with non-finite output, and
      │    its forward is the source line
      ├─ Tensor.register_hook on each module output: the first non-finite output
      │    gradient in backward order
      ├─ torch.autograd.grad(loss(output), parameters): non-finite parameter gradients
      │    (no .grad is touched)
      └─ NonfiniteReport, with a note saying the model ran module by module

The caller (``NonfiniteWatch.replay``) restores the step's random-number state and
buffers around it, as around ``find_nonfinite``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..runtime import flatten_tensors, outputs_loss, tensor_stats
from ..runtime.placement import dtensor_placement, local_value
from ..base.formatting import dtype_text, shape_text
from .nonfinite import BackwardHit, ForwardHit, NonfiniteReport, ValueStats

__all__ = ["replay_by_modules"]


def _floats(value: Any) -> list[tuple[str, torch.Tensor]]:
    return [(path, t) for path, t in flatten_tensors(value) if t.is_floating_point() or t.is_complex()]


def _finite(tensors) -> bool:
    return all(bool(torch.isfinite(t.detach()).all()) for _, t in tensors)


def _source(module: torch.nn.Module) -> tuple[str, int] | None:
    try:
        forward = type(module).forward
        return inspect.getsourcefile(forward) or "?", inspect.getsourcelines(forward)[1]
    except (OSError, TypeError):
        return None


def _stats(name: str, tensor: torch.Tensor) -> ValueStats:
    placement = dtensor_placement(tensor)
    if placement is not None and placement.sharded:  # a shard: its statistics, labelled
        tensor = local_value(tensor)
        name = f"{name} (this rank's piece)"
    return ValueStats(name, shape_text(tensor.shape), dtype_text(tensor.dtype),
                      tensor_stats(tensor))


class _Hooks:
    """Hooks on every module of ``root``: non-finite outputs in return order, non-finite
    output gradients in backward order, and the modules that made non-finite values."""

    def __init__(self, root: torch.nn.Module) -> None:
        self.calls: dict[str, int] = {}
        self.hits: list[ForwardHit] = []
        self.creators: list[str] = []
        self.grads: list[BackwardHit] = []
        self.open: list[int] = []  # len(self.hits) when each open call started
        self.handles = []
        for name, module in root.named_modules():
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._hook(name or "output"),
                                                             with_kwargs=True))

    def _enter(self, module, args) -> None:
        self.open.append(len(self.hits))

    def _hook(self, name: str):
        def hook(module, args, kwargs, output):
            inner_hits = len(self.hits) - self.open.pop()
            count = self.calls.get(name, 0)
            self.calls[name] = count + 1
            key = name if count == 0 else f"{name}_{count}"
            outputs = _floats(output)
            for _, tensor in outputs:
                if tensor.requires_grad:
                    tensor.register_hook(self._grad_hook(key, module))
            if _finite(outputs):
                return None
            received = ([(f"argument {path}", t) for path, t in _floats(args)]
                        + [(f"argument {path}", t) for path, t in _floats(kwargs)])
            own = [(n, t) for n, t in list(module.named_parameters(recurse=False))
                   + list(module.named_buffers(recurse=False)) if t.is_floating_point()]
            first = outputs[0][1]
            hit = ForwardHit(
                key=key, op=type(module).__name__, source=_source(module),
                shape=shape_text(first.shape), dtype=dtype_text(first.dtype),
                nan=sum(int(torch.isnan(t).sum()) for _, t in outputs),
                inf=sum(int(torch.isinf(t).sum()) for _, t in outputs),
                numel=sum(t.numel() for _, t in outputs),
                inputs=tuple(_stats(path, t.detach()) for path, t in received),
                parameters=tuple(_stats(f"{name}.{n}", t.detach()) for n, t in own))
            if hit.created and not inner_hits:  # nothing it called made them either
                self.creators.append(key)
            self.hits.append(hit)
            return None
        return hook

    def _grad_hook(self, key: str, module: torch.nn.Module):
        def hook(grad: torch.Tensor) -> None:
            bad = int(grad.numel() - torch.isfinite(grad).sum())
            if bad and all(seen.key != key for seen in self.grads):
                self.grads.append(BackwardHit(key, type(module).__name__, _source(module),
                                              shape_text(grad.shape), bad, grad.numel(), ()))
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def replay_by_modules(module: torch.nn.Module, args: tuple, kwargs: dict, loss,
                      why: str) -> NonfiniteReport:
    """One forward of ``module(*args, **kwargs)`` with a hook on every module, then the
    gradients of ``loss(output)`` (default: :func:`~fxdebug.runtime.values.outputs_loss`, the
    one default loss) for the parameters,
    every module output's gradient checked as the backward reaches it.

    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.fc = torch.nn.Linear(2, 2)
    ...     def forward(self, x):
    ...         return self.fc(x).log()
    >>> net = Net()
    >>> with torch.no_grad():
    ...     _ = net.fc.weight.copy_(-torch.eye(2))
    >>> report = replay_by_modules(net, (torch.ones(1, 2),), {}, None, "for the example")
    >>> report.forward.key, report.forward.created
    ('output', True)
    """
    hooks = _Hooks(module)
    try:
        with torch.enable_grad():
            output = module(*args, **kwargs)
    finally:
        hooks.remove()
    parameter_grads: list[tuple[str, int, int]] = []
    notes = [f"replayed module by module (a forward hook on each): {why}; a hit is the "
             f"innermost module whose output is non-finite, its source the line of its forward"]
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    value = loss(output) if loss is not None else outputs_loss(output)
    backward_ran = isinstance(value, torch.Tensor) and value.requires_grad and bool(named)
    if backward_ran and isinstance(value, torch.Tensor):
        grads = torch.autograd.grad(value.reshape(()), [p for _, p in named], allow_unused=True)
        for (name, _), grad in zip(named, grads):
            if grad is not None and not bool(torch.isfinite(grad).all()):
                parameter_grads.append((name, int(grad.numel() - torch.isfinite(grad).sum()),
                                        grad.numel()))
    first = hooks.hits[0] if hooks.hits else None
    first_key = None if first is None else first.key
    later = list(dict.fromkeys(hit.key for hit in hooks.hits[1:] if hit.key != first_key))
    inputs = ", ".join(f"{shape_text(t.shape)} {dtype_text(t.dtype)}"
                       for _, t in flatten_tensors((args, kwargs))) or "none"
    return NonfiniteReport(forward=first, backward=hooks.grads[0] if hooks.grads else None,
                           later_forward=later,
                           later_backward=[hit.key for hit in hooks.grads[1:]],
                           parameter_grads=parameter_grads,
                           backward_ran=backward_ran, model_name=type(module).__name__,
                           inputs=inputs, mode="train" if module.training else "eval",
                           loss="sum(out.sum())" if loss is None else
                           getattr(loss, "__name__", "loss"), notes=notes,
                           creators=hooks.creators)
