"""Tracing a module that has forward hooks: the hooks become run-time nodes around its body.

``module(x)`` runs the module's forward pre-hooks, its ``forward``, then its
forward hooks. Plain fx tracing runs those hooks once, at trace time, on
proxies, and never again: a user's hook is silently skipped on every run,
and FSDP2's hooks (all-gather before, reshard after, ``fully_shard``) run
their collectives and lazy initialisation on proxies and leave the model
broken. fxdebug traces only the body and puts the hooks in the graph::

    _Tracer.call_module(module) with forward hooks
      └─ hooked_forward(...)(*args, **kwargs)
           ├─ get_attr  module                           the module itself, read at run time
           ├─ forward_pre_hooks(module, key, args, kwargs) -> leaves; getitem per tensor
           ├─ module.forward traced on those               captures inside still happen
           └─ forward_hooks(module, key, args, kwargs, out) -> leaves; the module's output
                (paths=: each leaf's path, where a ModelOutput's None fields drop out when run)

so the hooks run at run time, in eager's order, with eager's values, and
nothing runs at trace time. The root module's hooks run the same way around
the whole graph, on :class:`~fxdebug.runtime.HookedRoot` (the model itself).
A module with backward hooks (``register_full_backward_hook``), or whose hook
registries this torch does not expose, is traced as a leaf instead: it runs
whole, hooks and all, as in eager. Hook nodes carry keys of their own
(``blocks.0.forward_pre_hooks``) and no capture acts on them.
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx as fx

from .. import runtime
from ..base import torch_compat
from .keys import META_PASS

__all__ = ["runs_hooks_in_graph", "runs_whole", "hooked_forward", "fixed_keys",
           "check_root_reads", "HOOKS_PASS"]

HOOKS_PASS = "module_hooks"
"""``node.meta["fxdebug_pass"]`` of the nodes that run a module's hooks."""


def runs_hooks_in_graph(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward hooks (its own or global) that the graph runs around its
    traced body.

    >>> lin = torch.nn.Linear(1, 1)
    >>> before = runs_hooks_in_graph(lin)
    >>> _ = lin.register_forward_hook(lambda *args: None)
    >>> before, runs_hooks_in_graph(lin)
    (False, True)
    """
    return torch_compat.has_module_hooks(module, backward=False) and not runs_whole(module)


def runs_whole(module: torch.nn.Module) -> bool:
    """Whether ``module`` must be called whole (a leaf): it has backward hooks, which wrap
    its inputs and outputs in ways fx cannot split, or hooks fxdebug cannot run itself.

    >>> lin = torch.nn.Linear(1, 1)
    >>> _ = lin.register_full_backward_hook(lambda *args: None)
    >>> runs_whole(lin), runs_whole(torch.nn.ReLU())
    (True, False)
    """
    if torch_compat.has_module_hooks(module, forward=False):
        return True
    return torch_compat.has_module_hooks(module, backward=False) and \
        not torch_compat.forward_hooks_readable(module)


@contextlib.contextmanager
def fixed_keys(tracer, prefix: str):
    """Nodes created inside are keyed ``prefix``, ``prefix_1``... and marked as hook nodes,
    without taking a key the tracer's allocator would give a node of the user's code."""
    count = [0]

    def key_of(node: fx.Node) -> str:
        count[0] += 1
        node.meta[META_PASS] = HOOKS_PASS
        return prefix if count[0] == 1 else f"{prefix}_{count[0] - 1}"

    previous = tracer.key_override
    tracer.key_override = key_of
    try:
        yield
    finally:
        tracer.key_override = previous


def _rebuild(node, structure):
    """``structure`` with each Proxy leaf replaced by ``node[i]`` (i: its place among the leaves)."""
    leaves, spec = torch_compat.tree_flatten(structure)
    return torch_compat.tree_unflatten(
        [node[i] if isinstance(leaf, fx.Proxy) else leaf for i, leaf in enumerate(leaves)], spec)


def _paths(structure) -> dict:
    """The hook node's ``paths=`` where the leaves' places depend on the values (a Hugging Face
    ``ModelOutput`` traced with Proxy fields that are None when run), else nothing."""
    paths = runtime.leaf_paths(structure)
    return {} if paths is None else {"paths": paths}


def hooked_forward(tracer, target: str, key: str, body):
    """The function fx traces for a call of the module at ``target`` (a get_attr path):
    hook nodes around ``body`` (the module's ``forward``)."""
    prefix = f"{key}." if key else ""

    def forward(*args, **kwargs):
        with fixed_keys(tracer, f"{prefix}forward_pre_hooks"):
            module = tracer.create_proxy("get_attr", target, (), {})
            pre = tracer.create_proxy("call_function", runtime.forward_pre_hooks,
                                      (module, key, args, kwargs), _paths((args, kwargs)))
            args, kwargs = _rebuild(pre, (args, kwargs))
        output = body(*args, **kwargs)
        with fixed_keys(tracer, f"{prefix}forward_hooks"):
            post = tracer.create_proxy("call_function", runtime.forward_hooks,
                                       (module, key, args, kwargs, output), _paths(output))
            return _rebuild(post, output)

    return forward


def check_root_reads(graph: fx.Graph, owner: torch.nn.Module) -> None:
    """Read the root's own parameters and buffers after the root's pre-hooks ran, as its
    eager forward does: ``get_attr`` nodes of them are moved after the pre-hooks node (the
    GraphModule shares the root's parameter registry, so a parameter the hooks swap in,
    FSDP2's gathered ``cls_token``, is the one the graph reads)."""
    pre = next((node for node in graph.nodes if node.op == "call_function"
                and node.target is runtime.forward_pre_hooks and node.args[1] == ""), None)
    if pre is None:
        return
    own = {**torch_compat.own_parameters(owner), **torch_compat.own_buffers(owner)}
    anchor = pre
    for node in list(graph.find_nodes(op="get_attr")):
        if node.target in own and own[node.target] is not None:
            anchor.append(node)
            anchor = node
