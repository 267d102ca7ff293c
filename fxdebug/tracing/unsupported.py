"""Models fxdebug cannot trace yet, refused before anything of theirs is touched.

An FSDP2 model (``torch.distributed.fsdp.fully_shard``) keeps per-module state
that its forward hooks initialise lazily on the first forward, from the root
down. A trace runs those hooks on Proxies, and the traced module runs the
blocks' hooks without the root's: either way the state ends up initialised
the wrong way, and the user's own ``model(x)`` stops working. Until fxdebug
traces FSDP2 models itself, it says so and how to get the same captures:
instrument the model first, shard the result.
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
    blocks = [path for path in sharded if path]
    shard_again = (f"for path in {blocks[:3]!r}{' + ...' if len(blocks) > 3 else ''}: "
                   f"fully_shard(gm.get_submodule(path)); " if blocks else "")
    raise FxdebugError(
        f"fxdebug cannot trace an FSDP2 model yet (called at "
        f"{format_location(user_location())}): fully_shard was applied to "
        f"{type(model).__name__}'s module(s) {listed}, and tracing runs FSDP's forward hooks, "
        f"whose lazily initialised state would then no longer fit the model. Nothing of the model "
        f"was changed. Fix: instrument the model before sharding it and shard the result the "
        f"same way: gm = fxdebug.instrument(model); {shard_again}fully_shard(gm). To compare "
        f"the ranks of the sharded model as it is, use fxdebug.compare_ranks(model) or "
        f"fxdebug.watch_nonfinite(model).")
