"""Copies of a module tree that share its parameters and buffers.

Tracing runs ``forward``; whatever a ``forward`` writes onto its module (a
cache of sizes, fx's tensor constants) must land on a copy, never on the
user's model.
"""

from __future__ import annotations

import copy

import torch

from ..base import torch_compat

__all__ = ["shallow_module_copy", "module_tree_copy"]


def shallow_module_copy(module: torch.nn.Module, share_parameters: bool = False) -> torch.nn.Module:
    """A copy of ``module`` alone: same parameters, buffers and submodules, own dictionaries.

    ``share_parameters``: the copy's parameter dictionary *is* the module's, so a parameter
    the module is given later (FSDP2's all-gather swaps its sharded parameters for full
    ones before each forward, and back after) is the copy's too.

    >>> lin = torch.nn.Linear(2, 2)
    >>> twin = shallow_module_copy(lin)
    >>> twin.weight is lin.weight, twin._parameters is lin._parameters
    (True, False)
    >>> shallow_module_copy(lin, share_parameters=True)._parameters is lin._parameters
    True
    """
    new = object.__new__(type(module))  # not copy.copy: some modules pickle their state oddly
    new.__dict__.update(module.__dict__)
    for name, value in module.__dict__.items():
        if name.startswith("_") and isinstance(value, (dict, set)):
            new.__dict__[name] = copy.copy(value)
    if share_parameters:
        torch_compat.share_parameters(new, module)
    return new


def module_tree_copy(model: torch.nn.Module, share_parameters: bool = False) -> torch.nn.Module:
    """A copy of every module in the tree that shares the parameters and buffers.

    Tracing runs ``forward`` on it, so attributes a ``forward`` sets (a cache
    of sizes, fx's tensor constants) land on the copy, never on the user's
    model. Each module gets its own submodule, parameter, buffer and hook
    dictionaries; the tensors in them are the model's own. ``share_parameters``:
    each copy's parameter dictionary is its module's (see :func:`shallow_module_copy`).

    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    >>> twin = module_tree_copy(net)
    >>> twin is net, twin[0] is net[0], twin[0].weight is net[0].weight
    (False, False, True)
    """
    memo: dict[int, torch.nn.Module] = {}

    def copy_module(module: torch.nn.Module) -> torch.nn.Module:
        if id(module) in memo:
            return memo[id(module)]
        new = memo[id(module)] = shallow_module_copy(module, share_parameters)
        for name, child in torch_compat.own_children(module).items():
            if child is not None:
                torch_compat.set_child(new, name, copy_module(child))
        return new

    return copy_module(model)
