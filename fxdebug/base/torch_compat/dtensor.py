"""What tensor parallelism keeps private: the layout a ParallelStyle hook gives a module's output.

``parallelize_module(module, mesh, {"fc1": ColwiseParallel()})`` calls
``distribute_module``, which registers a forward hook
``lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh)`` whose ``output_fn`` is
``functools.partial(Style._prepare_output_fn, ...)``. With ``use_local_output=True`` that hook
turns the module's DTensor output into a plain local tensor: the layout it had is only known
from the hook itself. :func:`parallel_output_layout` reads it from the hook's closure
(``module._forward_hooks``, the closure cells ``output_fn`` / ``input_fn`` and
``device_mesh``, the partial's arguments), checked on torch 2.9.1 and 2.14.1. Where any of it
is missing or shaped otherwise it returns None: the capture then says "local, placement
unknown" rather than guess.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["ParallelLayout", "parallel_output_layout", "distribute_module_applied"]

# style name -> positions of (output placements, use_local_output) in its output partial's args
_STYLES = {"ColwiseParallel": 2, "RowwiseParallel": 2, "SequenceParallel": 1}


class ParallelLayout(tuple):
    """``(style, placements, use_local_output, mesh)``: what a module's ParallelStyle hook hands on.

    >>> ParallelLayout(("ColwiseParallel", (), True, None)).style
    'ColwiseParallel'
    """

    @property
    def style(self) -> str:
        return self[0]

    @property
    def placements(self) -> tuple:
        return self[1]

    @property
    def use_local_output(self) -> bool:
        return self[2]

    @property
    def mesh(self):
        return self[3]


def _cells(fn) -> dict:
    code = getattr(fn, "__code__", None)
    closure = getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    try:
        return {name: cell.cell_contents for name, cell in zip(code.co_freevars, closure)}
    except ValueError:  # an empty cell
        return {}


def _style_partial(hook, cell: str) -> tuple[str, functools.partial, object] | None:
    """``(style class name, the partial, the mesh)`` held by a distribute_module hook's closure
    cell ``cell`` (``output_fn`` / ``input_fn``) and ``device_mesh``; the partial's function a
    style's ``_prepare_*`` (torch 2.9.1 and 2.14.1); None otherwise."""
    cells = _cells(hook)
    fn, mesh = cells.get(cell), cells.get("device_mesh")
    if not isinstance(fn, functools.partial) or mesh is None:
        return None
    owner, _, method = getattr(fn.func, "__qualname__", "").rpartition(".")
    return (owner, fn, mesh) if method.startswith("_prepare_") else None


def _hooks(module: torch.nn.Module, name: str) -> list:
    """The hooks of the registry ``name`` of ``module`` in order (torch 2.9.1 and 2.14.1)."""
    registry = getattr(module, name, None)  # module._forward_hooks: an OrderedDict (2.9-2.14)
    return list(registry.values()) if isinstance(registry, dict) else []


def parallel_output_layout(module: torch.nn.Module) -> ParallelLayout | None:
    """The layout ColwiseParallel / RowwiseParallel / SequenceParallel gives ``module``'s output,
    or None (not such a module, another forward hook runs after it, or torch changed the hook).
    Reads ``module._forward_hooks`` / ``_forward_pre_hooks`` (torch 2.9.1 and 2.14.1).

    >>> parallel_output_layout(torch.nn.Linear(2, 2)) is None
    True
    """
    hooks = _hooks(module, "_forward_hooks")
    if not hooks or getattr(module, "_forward_hooks_with_kwargs", None):
        return None
    found = _style_partial(hooks[-1], "output_fn")  # the last hook hands the output on
    if found is None or found[0] not in _STYLES or len(found[1].args) != _STYLES[found[0]]:
        return None
    style, output_fn, mesh = found
    if style == "SequenceParallel":
        pre = [p for p in (_style_partial(h, "input_fn") for h in _hooks(module, "_forward_pre_hooks"))
               if p is not None and p[0] == style]
        if len(pre) != 1 or len(pre[0][1].args) != 1:
            return None
        placements, use_local = pre[0][1].args[0], output_fn.args[0]
    else:
        placements, use_local = output_fn.args
    if not isinstance(placements, tuple) or not isinstance(use_local, bool):
        return None
    return ParallelLayout((style, placements, use_local, mesh))




def distribute_module_applied(module: torch.nn.Module) -> bool:
    """Whether ``distribute_module`` (any ParallelStyle, or a user's input/output functions) ran
    on ``module`` (its flag ``_distribute_module_applied``, 2.9.1 and 2.14.1; False without it).

    >>> distribute_module_applied(torch.nn.Linear(2, 2))
    False
    """
    return getattr(module, "_distribute_module_applied", False) is True
