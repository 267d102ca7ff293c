"""Ground truth by hand: forward hooks on every module, the way seed 000 does it."""

from __future__ import annotations

import collections
import contextlib
import dataclasses

import torch


def recur_detach(store, name, output, sep="/"):
    """Seed 000's recur_detach, cloning so later in-place ops cannot change the value."""
    if isinstance(output, torch.Tensor):
        store[name] = output.detach().clone()
    elif isinstance(output, tuple) and hasattr(output, "_fields"):
        for field, value in zip(output._fields, output):
            recur_detach(store, f"{name}{sep}{field}", value, sep)
    elif isinstance(output, (tuple, list)):
        for index, value in enumerate(output):
            recur_detach(store, f"{name}{sep}{index}", value, sep)
    elif isinstance(output, dict):
        for key, value in output.items():
            recur_detach(store, f"{name}{sep}{key}", value, sep)
    elif dataclasses.is_dataclass(output):
        for field in dataclasses.fields(output):
            recur_detach(store, f"{name}{sep}{field.name}", getattr(output, field.name), sep)


def hook_captures(model: torch.nn.Module, *inputs, grad_mode: bool = False
                  ) -> "collections.OrderedDict[str, torch.Tensor]":
    """Run ``model`` with a forward hook on every submodule; keys like fxdebug's.

    The n-th call (n > 0) of a module is keyed ``name_n``. The forward runs under
    ``torch.no_grad()`` unless ``grad_mode``.
    """
    store: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()
    calls: dict[str, int] = {}
    handles = []
    for name, module in model.named_modules():
        if not name:
            continue

        def hook(_module, _inputs, output, name=name):
            count = calls.get(name, 0)
            calls[name] = count + 1
            recur_detach(store, name if count == 0 else f"{name}_{count}", output)

        handles.append(module.register_forward_hook(hook))
    try:
        with contextlib.nullcontext() if grad_mode else torch.no_grad():
            model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return store
