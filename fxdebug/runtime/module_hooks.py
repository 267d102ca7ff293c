"""A traced-through module's forward hooks, run when the graph runs, as ``module(...)`` runs them.

fx traces through a module by calling its ``forward``; its forward pre-hooks
and forward hooks (a user's, FSDP2's all-gather and reshard) must run at run
time, around the traced body, never at trace time on proxies. The tracer
(``fxdebug/tracing/module_hooks.py``) puts two nodes around the body::

    blocks_0 = self.blocks[0]                       the module itself (get_attr)
    pre = fxdebug_runtime_forward_pre_hooks(blocks_0, 'blocks.0', (x,), {})
    ...                                             the body, on pre[0], pre[1], ...
    post = fxdebug_runtime_forward_hooks(blocks_0, 'blocks.0', (pre[0],), {}, add)
    ...                                             the caller reads post[0], ...

Each returns the leaves of what the hooks handed back, in ``tree_flatten``
order; the graph was traced with the structure the hooks were given, so a
hook that changes that structure, or a non-tensor argument, stops the run
with an error naming the module (make it a leaf module instead). Where that
structure holds a mapping whose keys depend on the values (a Hugging Face
``ModelOutput`` leaves out its ``None`` fields: ``hidden_states`` is a Proxy when
traced, ``None`` when run), the node is given ``paths=``, each trace-time leaf's
path (:func:`leaf_paths`), and returns what the hooks' result holds at each path,
``None`` where a field was left out, as reading the attribute gives in eager. The root
module's hooks run the same way, on :class:`HookedRoot` (the caller's model,
which the GraphModule stands in for).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.fx.node import has_side_effect

from ..errors import FxdebugError
from ..base import torch_compat
from .nodes import emit_if_tracing
from .values import leaves

__all__ = ["HookedRoot", "ROOT_HOOKS_ATTR", "forward_pre_hooks", "forward_hooks", "leaf_paths"]

ROOT_HOOKS_ATTR = "fxdebug_root_hooks"
"""The submodule of a traced GraphModule that holds the model whose root hooks the graph runs."""


class HookedRoot(torch.nn.Module):
    """Submodule ``fxdebug_root_hooks``: the model a GraphModule was traced from, whose forward
    hooks the graph runs. The model is held, not registered: its parameters and submodules
    are not this module's (they are the GraphModule's own already).

    >>> net = torch.nn.Linear(1, 1)
    >>> held = HookedRoot(net)
    >>> held.model is net, list(held.parameters())
    (True, [])
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not registered: no second path to its parameters

    def extra_repr(self) -> str:
        return type(self.__dict__["model"]).__name__


def _owner(module: torch.nn.Module) -> torch.nn.Module:
    return module.__dict__["model"] if isinstance(module, HookedRoot) else module


def _value_keyed(structure) -> bool:
    """Whether ``structure`` holds a mapping other than a plain dict (its keys may depend on
    the values: a ``ModelOutput`` leaves out its ``None`` fields)."""
    return bool(leaves(structure, is_leaf=lambda value: isinstance(value, Mapping)
                       and type(value) is not dict))


def leaf_paths(structure) -> tuple | None:
    """Each leaf's path in ``structure`` (``tree_flatten`` order): a tuple of mapping keys,
    sequence indices and attribute names; None where the leaves' places cannot change with
    the values (no mapping but plain dicts), or a path is not made of str and int.

    >>> from collections import OrderedDict
    >>> leaf_paths((1, {"a": 2})) is None
    True
    >>> leaf_paths((1, OrderedDict(a=2, b=[3])))
    ((0,), (1, 'a'), (1, 'b', 0))
    """
    if not _value_keyed(structure):
        return None
    try:
        found, _ = torch_compat.tree_flatten_with_path(structure)
    except Exception:  # noqa: BLE001 - a node type registered without keys: no paths
        return None
    paths = []
    for path, _ in found:
        steps = []
        for entry in path:
            step = next((getattr(entry, name) for name in ("key", "idx", "name")
                         if hasattr(entry, name)), None)
            if not isinstance(step, (str, int)) or isinstance(step, bool):
                return None
            steps.append(step)
        paths.append(tuple(steps))
    return tuple(paths)


def _at(structure, path: tuple):
    """What ``structure`` holds at ``path`` (:func:`leaf_paths`), None where a mapping leaves
    the key out."""
    for step in path:
        if structure is None:
            return None
        if isinstance(structure, Mapping):
            structure = structure.get(step)
        elif isinstance(step, int):
            structure = structure[step]
        else:
            structure = getattr(structure, step)
    return structure


def _same_leaves(before, after, key: str, what: str, paths: tuple | None = None) -> list:
    """The leaves of ``after``, which must have ``before``'s structure and non-tensor values."""
    old, old_spec = torch_compat.tree_flatten(before)
    new, new_spec = torch_compat.tree_flatten(after)
    changed = "structure" if old_spec != new_spec else ""
    if not changed:
        for was, now in zip(old, new):
            if isinstance(was, torch.Tensor) and isinstance(now, torch.Tensor):
                continue
            try:
                same = was is now or (type(was) is type(now) and bool(was == now))
            except Exception:  # noqa: BLE001 - an object without a plain ==: not the same
                same = False
            if not same:
                changed = f"value {was!r} -> {now!r}"
                break
    if changed:
        where = f"module {key!r}" if key else "the root module"
        raise FxdebugError(
            f"fxdebug: the {what} of {where} changed the {changed} of what they were given; "
            f"the graph was traced with what they were given, so running on would compute "
            f"something else than eager. Trace {where} as a leaf module "
            f"(fxdebug.instrument(fxdebug.trace(model, leaf_modules=[{key!r}])) or "
            f"leaf_modules=[...] in fxdebug.trace): it then runs eagerly with its hooks.")
    return new if paths is None else [_at(after, path) for path in paths]


@has_side_effect
def forward_pre_hooks(module: torch.nn.Module, key: str, args: tuple, kwargs: dict,
                      reads: dict | None = None, paths: tuple | None = None) -> list:
    """Run ``module``'s forward pre-hooks on ``(args, kwargs)``; the leaves of the result.

    ``reads``: ``{name: tensor}``, parameters and buffers of the root module that the graph
    holds itself: the hooks must leave them registered (a hook that swaps them, as FSDP2's
    all-gather does, would leave the graph computing with the old ones: an error says so).
    ``paths``: the trace-time leaves' paths (:func:`leaf_paths`), where their places depend on
    the values.

    >>> import torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_pre_hook(lambda m, a: (a[0] * 2,))
    >>> forward_pre_hooks(lin, "fc", (torch.ones(1),), {})
    [tensor([2.])]
    """
    emitted = emit_if_tracing(forward_pre_hooks, (module, key, args, kwargs),
                              {**({"reads": reads} if reads else {}),
                               **({"paths": paths} if paths is not None else {})})
    if emitted is not None:
        return emitted
    owner = _owner(module)
    hooked = torch_compat.run_forward_pre_hooks(owner, args, kwargs)
    for name, held in (reads or {}).items():
        now = owner.get_parameter(name) if name in dict(owner.named_parameters(recurse=False)) \
            else getattr(owner, name, None)
        if now is not held:
            raise FxdebugError(
                f"fxdebug: the forward pre-hooks of {type(owner).__name__} (the root) replaced "
                f"its own {name!r}, which the traced forward reads directly (FSDP2's "
                f"fully_shard(model) all-gathers it so); the graph would compute with the old "
                f"tensor. Move {name!r} into a submodule (fully_shard that one), or instrument "
                f"a submodule of the model.")
    return _same_leaves((args, kwargs), hooked, key, "forward pre-hooks", paths)


@has_side_effect
def forward_hooks(module: torch.nn.Module, key: str, args: tuple, kwargs: dict, output,
                  paths: tuple | None = None) -> list:
    """Run ``module``'s forward hooks on its ``output`` (called with ``args``, ``kwargs``);
    the leaves of the result (``paths``: as for :func:`forward_pre_hooks`).

    >>> import torch
    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_forward_hook(lambda m, a, out: out + 1)
    >>> forward_hooks(lin, "fc", (torch.ones(1),), {}, torch.zeros(1))
    [tensor([1.])]
    """
    emitted = emit_if_tracing(forward_hooks, (module, key, args, kwargs, output),
                              {"paths": paths} if paths is not None else {})
    if emitted is not None:
        return emitted
    result = torch_compat.run_forward_hooks(_owner(module), args, kwargs, output)
    return _same_leaves(output, result, key, "forward hooks", paths)
