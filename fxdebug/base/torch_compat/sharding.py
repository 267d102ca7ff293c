"""What FSDP2 and tensor parallelism leave on a module, and a module copied without it.

``fully_shard(module)`` swaps the module's class for a subclass ``FSDP<Class>`` of
``(FSDPModule, Class)`` and registers forward (pre-)hooks that all-gather and reshard
its parameters; ``parallelize_module`` (``distribute_module``) registers forward
(pre-)hooks that turn inputs and outputs into DTensors. Both set a few flags in the
module's ``__dict__`` (FSDP2 its state, too). A plain copy of such a module undoes all of that::

    class_before_sharding(module)        the class before fully_shard's swap
    registered_by_torch_distributed(fn)  a hook torch.distributed defined
    module_shell(module, cls, ...)       a new ``cls`` instance with the module's attributes,
                                         the registries given, the hooks kept that are asked

Checked on torch 2.9.1 and 2.14.1.
"""

from __future__ import annotations

import collections
import functools

import torch

from .module_internals import BUFFERS_ATTR, CHILDREN_ATTR, PARAMETERS_ATTR

__all__ = ["SHARDING_FLAGS", "class_before_sharding", "registered_by_torch_distributed",
           "module_shell"]

SHARDING_FLAGS = ("_is_fsdp_managed_module", "_fsdp_use_orig_params",
                  "_distribute_module_applied")
"""The flags ``fully_shard`` and ``distribute_module`` write into a module's ``__dict__``
(torch 2.9.1, 2.14.1): a copy that is neither leaves them out (torch.compile reads them)."""

_COMPOSABLE_STATE = "__composable_api_state_key"
"""How the keys begin under which ``torch.distributed._composable.contract`` keeps a composable
API's state (FSDP2's ``FSDPState``, which holds the sharded modules) in a module's ``__dict__``
(``generate_state_key``, torch 2.9.1 and 2.14.1): a copy leaves them out."""


def _sharding_state(name: str) -> bool:
    """Whether a module's ``__dict__`` entry ``name`` is sharding's: :data:`SHARDING_FLAGS` and
    FSDP2's state (keys from ``_composable.contract.generate_state_key``, 2.9.1 and 2.14.1)."""
    return name in SHARDING_FLAGS or name.startswith(_COMPOSABLE_STATE)

# nn.Module's hook registries {handle id: hook} (2.9.1, 2.14.1)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks",
          "_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
          "_load_state_dict_post_hooks")
# ... and the registries that flag some of those hooks {handle id: True} (2.9.1, 2.14.1)
_HOOK_FLAGS = ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
_NON_PERSISTENT = "_non_persistent_buffers_set"  # a set of buffer names (2.9.1, 2.14.1)


def class_before_sharding(module: torch.nn.Module) -> type:
    """``module``'s class before ``fully_shard`` swapped in its ``FSDP<Class>`` subclass: the
    first class of its MRO that is not an ``FSDPModule`` (``(FSDPLinear, FSDPModule,
    Linear, ...)`` on 2.9.1 and 2.14.1); the module's own class for any other module.

    >>> class_before_sharding(torch.nn.Linear(1, 1)).__name__
    'Linear'
    """
    cls = type(module)
    if not torch.distributed.is_available():
        return cls
    from torch.distributed.fsdp import FSDPModule
    if not isinstance(module, FSDPModule):
        return cls
    return next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))


def _functions(hook) -> list:
    """``hook`` and what it wraps: a partial's function, a bound method's function,
    ``functools.wraps``' ``__wrapped__``, nn.Module's ``_WrappedHook.hook`` (2.9.1, 2.14.1)."""
    found: list = []
    todo = [hook]
    while todo and len(found) < 16:
        current = todo.pop()
        found.append(current)
        for inner in (current.func if isinstance(current, functools.partial) else None,
                      getattr(current, "__func__", None), getattr(current, "__wrapped__", None),
                      getattr(current, "hook", None)):
            if inner is not None and callable(inner) and inner is not current:
                todo.append(inner)
    return found


def registered_by_torch_distributed(hook) -> bool:
    """Whether the hook ``hook`` was defined in ``torch.distributed`` (FSDP2's all-gathers, a
    ParallelStyle's input and output layouts): its ``__module__`` or that of a function it
    wraps (checked on 2.9.1 and 2.14.1, where FSDP2's hooks are wrapped twice).

    >>> registered_by_torch_distributed(lambda *args: None)
    False
    """
    return any(str(getattr(fn, "__module__", "") or "").startswith("torch.distributed")
               for fn in _functions(hook))


def module_shell(module: torch.nn.Module, cls: type, parameters: dict, buffers: dict,
                 children: dict, keep_hook) -> torch.nn.Module:
    """A new ``cls`` instance (neither ``cls.__new__`` nor ``__init__`` runs: FSDP2's classes
    construct another class there) with ``module``'s attributes, the registries
    ``parameters``, ``buffers`` and ``children`` (new dicts; the names of non-persistent
    buffers kept), and new hook registries holding the hooks for which ``keep_hook(hook)``
    is true, in their order; :data:`SHARDING_FLAGS` and FSDP2's state left out. Writes ``__dict__`` and its
    ``_parameters``, ``_buffers``, ``_modules`` and hook registries (2.9.1, 2.14.1).

    >>> lin = torch.nn.Linear(2, 2)
    >>> _ = lin.register_forward_hook(lambda m, a, out: out * 0)
    >>> copy = module_shell(lin, torch.nn.Linear, dict(lin.named_parameters()), {}, {},
    ...                     keep_hook=lambda hook: False)
    >>> copy.weight is lin.weight, bool(copy(torch.ones(2)).abs().sum())
    (True, True)
    """
    state = {name: value for name, value in vars(module).items() if not _sharding_state(name)}
    kept: set[int] = set()
    for name in _HOOKS:
        registry = state.get(name)
        if isinstance(registry, dict):
            state[name] = collections.OrderedDict(
                (handle, hook) for handle, hook in registry.items() if keep_hook(hook))
            kept.update(state[name])
    for name in _HOOK_FLAGS:
        registry = state.get(name)
        if isinstance(registry, dict):
            state[name] = collections.OrderedDict(
                (handle, flag) for handle, flag in registry.items() if handle in kept)
    if isinstance(state.get(_NON_PERSISTENT), set):
        state[_NON_PERSISTENT] = set(state[_NON_PERSISTENT])
    state[PARAMETERS_ATTR] = dict(parameters)
    state[BUFFERS_ATTR] = dict(buffers)
    state[CHILDREN_ATTR] = dict(children)
    shell: torch.nn.Module = object.__new__(cls)
    vars(shell).update(state)
    return shell
