"""What ``torch.nn.Module`` keeps private: its parameter, buffer and child registries, its
hooks, which buffers persist, and the dropout base class.
"""

from __future__ import annotations

import torch

__all__ = ["BUFFERS_ATTR", "CHILDREN_ATTR", "DROPOUT_TYPES", "PARAMETERS_ATTR", "global_module_hook_names",
           "global_module_hooks_owner", "has_module_hooks",
           "is_persistent_buffer", "own_buffers", "own_children", "own_parameters", "set_child",
           "set_own_buffer"]

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


def global_module_hooks_owner():
    """The Python module that keeps torch's process-wide module hooks
    (``torch.nn.modules.module``, 2.9.1 and 2.14.1); see :func:`global_module_hook_names`.

    >>> global_module_hooks_owner().__name__
    'torch.nn.modules.module'
    """
    return torch.nn.modules.module


def global_module_hook_names() -> tuple[str, ...]:
    """Names, in :func:`global_module_hooks_owner`, of what ``register_module_forward_hook`` and
    friends change: ``_global_forward_hooks`` and the other ``_global_*`` registries and flags
    (2.9.1, 2.14.1); where torch renamed them, the ones that exist (none: nothing to keep).

    >>> "_global_forward_hooks" in global_module_hook_names()
    True
    """
    owner = global_module_hooks_owner()
    return tuple(name for name in sorted(vars(owner)) if name.startswith("_global_")
                 and (isinstance(vars(owner)[name], dict) or name == "_global_is_full_backward_hook"))


DROPOUT_TYPES: tuple[type[torch.nn.Module], ...] = tuple(dict.fromkeys(
    ([torch.nn.modules.dropout._DropoutNd] if hasattr(torch.nn.modules.dropout, "_DropoutNd")
     else [torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d])
    + [torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout]))
"""Every torch.nn dropout module type: the private base ``_DropoutNd`` (2.9.1, 2.14.1), or the
public classes where it is gone."""
