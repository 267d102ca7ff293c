"""Pipeline parallelism (``torch.distributed.pipelining``): a clear stop, and what works instead.

A ``Pipe`` (from ``pipeline(...)``), a pipeline stage or a schedule runs one stage's module per
rank and sends activations between ranks in microbatches; fxdebug traces one module whose
forward runs on one rank, so it refuses these objects with an error that names them and says
what works: instrument each stage's module (``pipe.get_stage_module(i)``), then build the stage
from the instrumented module.

>>> refuse_pipelining(torch.nn.Linear(1, 1), "fxdebug.instrument") is None
True
"""

from __future__ import annotations

import torch

from ..errors import FxdebugError

__all__ = ["refuse_pipelining"]

_PACKAGE = "torch.distributed.pipelining"


def _pipelining_class(obj) -> str:
    for klass in type(obj).__mro__:
        if (klass.__module__ or "").startswith(_PACKAGE):
            return type(obj).__name__
    return ""


def refuse_pipelining(obj, caller: str) -> None:
    """Raise :class:`~fxdebug.errors.FxdebugError` when ``obj`` is a pipelining object (a
    ``Pipe``, a stage, a schedule) or a module holding a ``Pipe``."""
    name = _pipelining_class(obj)
    where = ""
    if not name and isinstance(obj, torch.nn.Module):
        for path, module in obj.named_modules():
            if path and _pipelining_class(module):
                name, where = type(module).__name__, f" (at submodule {path!r})"
                break
    if not name:
        return None
    raise FxdebugError(
        f"{caller}: {type(obj).__name__}{where} is pipeline parallelism "
        f"({name}, torch.distributed.pipelining), which fxdebug does not instrument: each rank "
        f"runs one stage on microbatches and sends activations to the next rank, which one "
        f"traced graph cannot follow. What works: instrument the module of this rank's stage "
        f"(gm = fxdebug.instrument(pipe.get_stage_module(stage_index)), or the submodule you "
        f"split by hand), build the stage from it (PipelineStage(gm, stage_index, num_stages, "
        f"device)), run the schedule; fxdebug.records(gm) then holds the captures of the last "
        f"microbatch this rank ran.")
