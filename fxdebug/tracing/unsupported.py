"""Models a front end cannot trace, refused before anything of theirs is touched.

``torch.export`` (the ``"export"`` front end) cannot trace an FSDP2 model
(``torch.distributed.fsdp.fully_shard``): its forward hooks all-gather
parameters with collectives and initialise state lazily. The fx front end
traces such a model (the hooks run at run time, see tracing/module_hooks.py),
so the error says to use it.
"""

from __future__ import annotations

import torch

from ..errors import FxdebugError
from ..base.formatting import format_location
from .locations import user_location

__all__ = ["refuse_unsupported", "fsdp2_modules", "why_not_export"]


def fsdp2_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the modules of ``model`` that ``fully_shard`` was applied to ("" is the root).

    >>> fsdp2_modules(torch.nn.Sequential(torch.nn.Linear(1, 1)))
    []
    """
    if not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule
    return [path for path, module in model.named_modules() if isinstance(module, FSDPModule)]


def refuse_unsupported(model: torch.nn.Module) -> None:
    """Raise :class:`~fxdebug.errors.FxdebugError` for a model fxdebug cannot trace yet,
    naming the user's line that asked.

    >>> refuse_unsupported(torch.nn.Linear(1, 1))  # supported: nothing
    """
    sharded = fsdp2_modules(model)
    if not sharded:
        return
    listed = ", ".join(repr(path) for path in sharded[:6]) + (", ..." if len(sharded) > 6 else "")
    raise FxdebugError(
        f"frontend='export' cannot trace an FSDP2 model (called at "
        f"{format_location(user_location())}): fully_shard was applied to "
        f"{type(model).__name__}'s module(s) {listed}, whose forward hooks gather parameters "
        f"with collectives that torch.export cannot trace. Nothing of the model was changed. "
        f"Fix: leave frontend at its default: fxdebug.instrument(model) traces it with "
        f"torch.fx (part by part where its root cannot be traced as one graph) and runs the "
        f"hooks at run time.")


def why_not_export(model: torch.nn.Module) -> str:
    """Why ``torch.export`` is not tried on ``model`` (a sharded model), or ``""``.

    FSDP2's hooks gather parameters with collectives; DTensor parameters (tensor
    parallelism) are not traced by torch.export with the ops their layouts need.
    Part-by-part tracing then runs such a module eagerly (its children are traced
    on their own), on every configuration the same way.

    >>> why_not_export(torch.nn.Linear(1, 1))
    ''
    """
    sharded = fsdp2_modules(model)
    if sharded:
        return (f"not tried: fully_shard was applied to {sharded[0] or '(root)'!r}, whose hooks "
                f"gather parameters with collectives that torch.export cannot trace")
    if not torch.distributed.is_available():
        return ""
    from torch.distributed.tensor import DTensor
    dtensor = next((name for name, parameter in model.named_parameters()
                    if isinstance(parameter, DTensor)), None)
    if dtensor is not None:
        return (f"not tried: parameter {dtensor!r} is a DTensor (tensor parallelism), whose "
                f"collectives torch.export does not trace")
    return ""
