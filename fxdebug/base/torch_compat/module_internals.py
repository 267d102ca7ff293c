"""What ``torch.nn.Module`` keeps private: its parameter, buffer and child registries, its
hooks, which buffers persist, and the dropout base class.
"""

from __future__ import annotations

import torch

__all__ = ["BUFFERS_ATTR", "CHILDREN_ATTR", "DROPOUT_TYPES", "PARAMETERS_ATTR",
           "global_module_hook_names", "global_module_hooks_owner", "has_module_hooks",
           "forward_hooks_readable", "hook_registrations", "hook_registries", "run_forward_pre_hooks", "run_forward_hooks",
           "is_persistent_buffer", "own_buffers", "own_children", "own_parameters",
           "parameters_and_buffers", "set_child", "share_parameters",
           "set_own_buffer"]

PARAMETERS_ATTR, BUFFERS_ATTR, CHILDREN_ATTR = "_parameters", "_buffers", "_modules"
"""Where ``nn.Module`` keeps what it registers, in its ``__dict__`` (2.9.1, 2.14.1; unchanged
since torch 1.0). Read them with the functions below; change them with the public
``register_parameter``, ``register_buffer``, ``add_module`` or ``setattr``."""


def share_parameters(target: torch.nn.Module, source: torch.nn.Module) -> bool:
    """Make ``target``'s own parameter registry ``source``'s (the same dict object), so a
    parameter ``source`` is given later is ``target``'s too. Only where every parameter
    ``target`` holds itself is ``source``'s under the same name (True); else nothing
    changes (False). Where ``nn.Module`` keeps no such dict, False.

    >>> lin, twin = torch.nn.Linear(1, 1), torch.nn.Module()
    >>> twin.weight = lin.weight
    >>> share_parameters(twin, lin), list(own_parameters(twin))
    (True, ['weight', 'bias'])
    """
    mine, theirs = vars(target).get(PARAMETERS_ATTR), vars(source).get(PARAMETERS_ATTR)
    if not isinstance(mine, dict) or not isinstance(theirs, dict):
        return False
    if mine is theirs:
        return True
    if any(theirs.get(name, None) is not parameter for name, parameter in mine.items()):
        return False
    vars(target)[PARAMETERS_ATTR] = theirs
    return True


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


def parameters_and_buffers(module: torch.nn.Module) -> tuple[list, list]:
    """``(list(module.parameters()), list(module.buffers()))`` in one walk of the module tree,
    same tensors, same order (modules depth first, each module and each tensor once), at
    about a quarter of their host time: reads ``_modules``, ``_parameters`` and ``_buffers``
    (2.9.1, 2.14.1) directly; where one is gone, the public ``parameters()`` and ``buffers()``.

    >>> shared = torch.nn.BatchNorm1d(2)
    >>> net = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(2, 2), shared),
    ...                           torch.nn.BatchNorm1d(2), shared)
    >>> net.register_module("absent", None); net[0][0].register_parameter("gone", None)
    >>> net[1].weight = net[0][0].weight  # shared
    >>> net[0].add_module("again", net[0]); net.add_module("twice", net[0])  # a cycle, shared
    >>> found = parameters_and_buffers(net)
    >>> [list(map(id, tensors)) for tensors in found] == [list(map(id, net.parameters())),
    ...                                                   list(map(id, net.buffers()))]
    True
    """
    parameters: list = []
    buffers: list = []
    add_parameters, add_buffers = parameters.extend, buffers.extend
    # Only a module with children can be met twice with a subtree behind it (shared, or a
    # cycle): those are remembered. A module met again adds its tensors again, and
    # repeats are dropped at the end, keeping each tensor's first place: the order of
    # parameters(), which skips a module met before.
    containers: set[int] = set()
    stack = [module]
    pop, push = stack.pop, stack.extend  # (this runs every training step: kept tight)
    try:
        while stack:
            current = pop()
            if current is None:  # a None slot in _modules
                continue
            registries = current.__dict__
            own = registries[PARAMETERS_ATTR]
            if own:
                add_parameters(own.values())
            own = registries[BUFFERS_ATTR]
            if own:
                add_buffers(own.values())
            own = registries[CHILDREN_ATTR]
            if own and id(current) not in containers:
                containers.add(id(current))
                push(reversed(own.values()))
    except KeyError:
        return list(module.parameters()), list(module.buffers())
    return _first_of_each(parameters), _first_of_each(buffers)


def _first_of_each(tensors: list) -> list:
    """``tensors`` without None slots and without repeats (the first kept), in order; the
    usual case (neither) checked in C, and the list returned as it is."""
    ids = list(map(id, tensors))
    if id(None) not in ids and len(set(ids)) == len(ids):
        return tensors
    seen: set[int] = set()
    kept = []
    for tensor, key in zip(tensors, ids):
        if tensor is not None and key not in seen:
            seen.add(key)
            kept.append(tensor)
    return kept


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


def has_module_hooks(module: torch.nn.Module, backward: bool = True, forward: bool = True) -> bool:
    """Whether a call of ``module`` runs a hook: its own forward (pre-)hooks or the global ones
    (``register_module_forward_hook``), and with ``backward`` the backward ones too
    (``forward=False``: only those).

    Reads ``module._forward_hooks`` and friends and ``torch.nn.modules.module._global_*``
    (2.9.1, 2.14.1); where one is gone, answers True (a module that may have hooks is never
    treated as plain).

    >>> lin = torch.nn.Linear(1, 1)
    >>> has_module_hooks(lin), bool(lin.register_forward_hook(lambda *a: None)) and has_module_hooks(lin)
    (False, True)
    """
    missing = _MISSING
    for owner, name in _HOOK_NAMES[forward, backward]:  # a lookup each, up to the first hook
        registry = getattr(module if owner is None else owner, name, missing)
        if registry is missing or registry:
            return True
    return False


_MISSING = object()
_OWN = (("forward_pre_hooks", "forward_hooks"), ("backward_hooks", "backward_pre_hooks"))
# (forward, backward) -> (owner, attribute) of each registry to look at: None for the module's
# own (``_forward_hooks``...), then torch's process-wide ones (``_global_forward_hooks``...);
# private names of torch.nn.Module, checked on 2.9.1 and 2.14.1 (a missing one counts as a hook)
_HOOK_NAMES = {(forward, backward): tuple(
    (owner, prefix + kind) for owner, prefix in ((None, "_"), (torch.nn.modules.module, "_global_"))
    for kind in (_OWN[0] if forward else ()) + (_OWN[1] if backward else ()))
    for forward in (False, True) for backward in (False, True)}


def hook_registrations() -> int | None:
    """How many hooks torch has handed out a handle for so far, process-wide (modules' and
    tensors' alike): ``torch.utils.hooks.RemovableHandle.next_id`` (2.9.1, 2.14.1). Registering
    a hook raises it; removing one does not. ``None`` where torch has no such counter: the
    caller then looks at the hooks themselves on every call.

    >>> before = hook_registrations()
    >>> _ = torch.nn.Linear(1, 1).register_forward_hook(lambda *a: None)
    >>> hook_registrations() > before
    True
    """
    count = getattr(torch.utils.hooks.RemovableHandle, "next_id", None)
    return count if isinstance(count, int) else None


_HOOK_KINDS = ("forward_pre_hooks", "forward_hooks", "backward_hooks", "backward_pre_hooks")


def hook_registries(module: torch.nn.Module | None) -> list:
    """The dicts that hold ``module``'s forward and backward (pre-)hooks, or with ``None`` the
    process-wide ones (``torch.nn.modules.module._global_*``), 2.9.1 and 2.14.1; a registry
    this torch does not have is left out.

    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_hook(lambda *a: None)
    >>> [bool(registry) for registry in hook_registries(lin)]
    [False, True, False, False]
    """
    owner, prefix = (torch.nn.modules.module, "_global_") if module is None else (module, "_")
    found = [getattr(owner, prefix + kind, None) for kind in _HOOK_KINDS]
    return [registry for registry in found if isinstance(registry, dict)]


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
# nn.Module's forward hook registries (2.9.1, 2.14.1)
_FORWARD_REGISTRIES = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                       "_forward_hooks_with_kwargs", "_forward_hooks_always_called")
# torch.nn.modules.module's global forward hook registries (2.9.1, 2.14.1)
_GLOBAL_FORWARD_REGISTRIES = ("_global_forward_pre_hooks", "_global_forward_hooks",
                              "_global_forward_hooks_with_kwargs",
                              "_global_forward_hooks_always_called")


def forward_hooks_readable(module: torch.nn.Module) -> bool:
    """Whether :func:`run_forward_pre_hooks` and :func:`run_forward_hooks` can run ``module``'s
    forward hooks: its ``_forward_*hooks*`` registries and torch's ``_global_forward_*``
    ones exist (2.9.1, 2.14.1). Where one is gone, False: the caller runs the module whole,
    through ``module(...)``, which runs its hooks itself.

    >>> forward_hooks_readable(torch.nn.Linear(1, 1))
    True
    """
    return all(isinstance(getattr(module, name, None), dict) for name in _FORWARD_REGISTRIES) \
        and all(hasattr(torch.nn.modules.module, name) for name in _GLOBAL_FORWARD_REGISTRIES)


def run_forward_pre_hooks(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``(args, kwargs)`` after the global and ``module``'s forward pre-hooks, run in the order
    and with the results ``nn.Module._call_impl`` gives them (2.9.1, 2.14.1): a hook
    registered ``with_kwargs`` returns ``None`` or ``(args, kwargs)``, another ``None``, a
    tuple or one value.

    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_pre_hook(lambda m, a: (a[0] + 1,))
    >>> run_forward_pre_hooks(lin, (torch.zeros(1),), {})
    ((tensor([1.]),), {})
    """
    global_hooks = torch.nn.modules.module._global_forward_pre_hooks
    with_kwargs = module._forward_pre_hooks_with_kwargs
    for hook_id, hook in (*global_hooks.items(), *module._forward_pre_hooks.items()):
        if hook_id in with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"forward pre-hook must return None or a tuple of "
                                       f"(new_args, new_kwargs), but got {result}.")
                args, kwargs = result
        else:
            result = hook(module, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def run_forward_hooks(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    """``output`` after the global and ``module``'s forward hooks, as ``nn.Module._call_impl``
    runs them (2.9.1, 2.14.1): each sees the pre-hooked ``args`` (and ``kwargs`` where
    registered ``with_kwargs``) and may return a replacement. (``always_call`` hooks run
    here as any other; on an exception in the forward, ``_call_impl`` would also run them.)

    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_hook(lambda m, a, out: out * 0)
    >>> run_forward_hooks(lin, (torch.ones(1),), {}, torch.ones(1))
    tensor([0.])
    """
    torch_module = torch.nn.modules.module
    global_hooks = torch_module._global_forward_hooks
    global_kwargs = torch_module._global_forward_hooks_with_kwargs
    for hook_id, hook in (*global_hooks.items(), *module._forward_hooks.items()):
        if hook_id in module._forward_hooks_with_kwargs or hook_id in global_kwargs:
            result = hook(module, args, kwargs, output)
        else:
            result = hook(module, args, output)
        if result is not None:
            output = result
    return output


DROPOUT_TYPES: tuple[type[torch.nn.Module], ...] = tuple(dict.fromkeys(
    ([torch.nn.modules.dropout._DropoutNd] if hasattr(torch.nn.modules.dropout, "_DropoutNd")
     else [torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d])
    + [torch.nn.AlphaDropout, torch.nn.FeatureAlphaDropout]))
"""Every torch.nn dropout module type: the private base ``_DropoutNd`` (2.9.1, 2.14.1), or the
public classes where it is gone."""
