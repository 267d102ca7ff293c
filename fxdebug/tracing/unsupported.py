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
from ..runtime.formatting import format_location
from .locations import user_location

__all__ = ["refuse_unsupported", "fsdp2_modules"]


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
        f"Fix: use the fx front end, the default: fxdebug.trace(model) or "
        f"fxdebug.instrument(model).")
