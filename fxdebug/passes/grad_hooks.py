"""GradHooks: record the gradient of every selected activation during backward.

After ``GradHooks("modules")`` (what ``instrument(..., grads=True)`` runs)::

    conv1 = self.conv1(x)
    record_grads_conv1 = fxdebug_runtime_record_grads(fxdebug_recorder, conv1, 'conv1', 'Conv2d')

Each node registers ``Tensor.register_hook`` on the value when it is made, so
the gradient filed under ``conv1`` is that of the conv output itself, even if
a later in-place op rewrites the tensor. The graph's inputs are used through
``own_value`` (a view made in each forward), so no hook ever sits on a tensor
the caller owns and nothing outlives the run. No ``saved_tensors_hooks`` are ever
installed: PyTorch's own "modified by an inplace operation" check stays on.
"""

from __future__ import annotations

import torch.fx as fx

from .. import runtime
from ..errors import SelectionError
from ..tracing.selection import select
from ._placement import ensure_recorder, insert_per_target, own_inputs
from .base import Pass

__all__ = ["GradHooks"]


class GradHooks(Pass):
    """Insert gradient-recording nodes; after backward, ``records(gm).grads[key]``.

    Args: as :class:`~fxdebug.passes.Capture` (``capture``, ``depth``,
    ``include``, ``exclude``, ``mode``); ``mode="stats"`` keeps gradient
    statistics only.

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
        >>> _ = fxdebug.passes.GradHooks()(gm)
        >>> gm(torch.ones(1, 2)).sum().backward()
        >>> fxdebug.records(gm).grads.keys()
        ['1', '0']
    """

    name = "grads"
    exact_modified = True  # run() returns False only where it changed nothing (base.run_passes)

    def __init__(self, capture="modules", depth=None, include=None, exclude=None,
                 mode: str = "tensor") -> None:
        if mode not in ("tensor", "stats"):
            raise SelectionError(f"mode={mode!r}: use 'tensor' (keep gradients) or 'stats' "
                                 f"(keep gradient statistics only).")
        self.capture, self.depth, self.include, self.exclude = capture, depth, include, exclude
        self.mode = mode

    def run(self, gm: fx.GraphModule) -> bool:
        targets = select(gm, self.capture, self.depth, self.include, self.exclude)
        if not targets:
            return False
        recorder = ensure_recorder(gm, self.name)
        _mark_records_grads(getattr(gm, runtime.RECORDER_ATTR))
        targets = own_inputs(gm, targets, self.name)
        kwargs = {"stats_only": True} if self.mode == "stats" else {}
        # after the captures of the same node: values are read before hooks are registered
        insert_per_target(gm, recorder, targets, self.name, "record_grads", "grads",
                          lambda target: (runtime.record_grads, kwargs),
                          after=(runtime.capture, runtime.capture_stats))
        return True


def _mark_records_grads(recorder) -> None:
    """Tell the recorder (and a part's shared recorder) that its runs record gradients."""
    recorder.records_grads = True
    shared = getattr(recorder, "shared", None)
    if shared is not None:
        shared.records_grads = True
