"""GradHooks: record the gradient of every selected activation during backward.

After ``GradHooks("modules")`` (what ``instrument(..., grads=True)`` runs)::

    conv1 = self.conv1(x)
    record_grads_conv1 = fxdebug_runtime_record_grads(fxdebug_recorder, conv1, 'conv1', 'Conv2d')

Each node registers ``Tensor.register_hook`` on the value when it is made, so
the gradient filed under ``conv1`` is that of the conv output itself, even if
a later in-place op rewrites the tensor. No ``saved_tensors_hooks`` are ever
installed: PyTorch's own "modified by an inplace operation" check stays on.
"""

from __future__ import annotations

import torch.fx as fx

from .. import runtime
from ..errors import SelectionError
from ..keys import META_KEY, META_PASS, META_SOURCE
from ..selection import select
from ._recorder import ensure_recorder
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
        graph = gm.graph
        start = recorder.next
        last_inserted: dict[fx.Node, fx.Node] = {}
        for target in targets:
            place = start if target.anchor.op == "placeholder" else target.anchor
            anchor = last_inserted.get(place, place)
            while anchor.next.op == "call_function" and anchor.next.meta.get(META_PASS) and \
                    anchor.next.target in (runtime.capture, runtime.capture_stats):
                anchor = anchor.next  # after the captures of the same node: reads before hooks
            kwargs = {"stats_only": True} if self.mode == "stats" else {}
            with graph.inserting_after(anchor):
                node = graph.create_node("call_function", runtime.record_grads,
                                         (recorder, target.value, target.key, target.op), kwargs,
                                         name=f"record_grads_{target.key}")
            node.meta[META_KEY] = f"{target.key}:grads"
            node.meta[META_PASS] = self.name
            node.meta[META_SOURCE] = target.source
            last_inserted[place] = node
        return True
