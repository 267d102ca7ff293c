"""Capture: insert a ``capture`` node after every selected value.

Before (resnet18)::

    bn1 = self.bn1(conv1)
    relu = self.relu(bn1)

After ``Capture("modules")``::

    bn1 = self.bn1(conv1)
    capture_bn1 = fxdebug_runtime_capture(fxdebug_recorder, bn1, 'bn1', 'BatchNorm2d', clone = True)
    relu = self.relu(bn1)
    capture_relu = fxdebug_runtime_capture(fxdebug_recorder, relu, 'relu', 'ReLU')

``clone = True`` appears only where a later in-place op (here the in-place
ReLU) writes to the captured storage, or a later call whose code fx cannot
see (a leaf module, a ``torch.fx.wrap``'d function, a module with forward
hooks) receives it and may write; everywhere else the capture is a detached
view and costs no copy. Should anything else write to a view afterwards, the
record turns stale and refuses to show its value (see ``Record.stale``). Capture nodes have no users and change no
value, so the module computes exactly what it did.
"""

from __future__ import annotations

import warnings

import torch.fx as fx

from .. import runtime
from ..runtime import RECORDER_ATTR
from ..tracing.locations import caller_stacklevel
from .aliasing import AliasAnalysis
from ..errors import FidelityWarning, SelectionError
from ..tracing.selection import select
from ._placement import ensure_recorder, insert_per_target
from .base import Pass

__all__ = ["Capture"]

_MODES = ("tensor", "stats")


class Capture(Pass):
    """Insert capture nodes; after a forward, ``fxdebug.records(gm)`` holds the values.

    Args:
        capture: ``"modules"``, ``"all"`` or a list of keys / globs (see
            :func:`fxdebug.tracing.selection.select`).
        depth, include, exclude: further filters on the keys.
        mode: ``"tensor"`` keeps the values, ``"stats"`` only their summary
            statistics (constant memory per node).

    Example::

        >>> import torch, fxdebug
        >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
        >>> fxdebug.passes.Capture(["1"])(gm).modified
        True
        >>> _ = gm(torch.ones(1, 2)); fxdebug.records(gm).keys()
        ['1']
    """

    name = "capture"
    exact_modified = True  # run() returns False only where it changed nothing (base.run_passes)

    def __init__(self, capture="modules", depth=None, include=None, exclude=None,
                 mode: str = "tensor") -> None:
        if mode not in _MODES:
            raise SelectionError(f"mode={mode!r}: use 'tensor' (keep values) or 'stats' "
                                 f"(keep summary statistics only).")
        self.capture = capture
        self.depth = depth
        self.include = include
        self.exclude = exclude
        self.mode = mode

    def run(self, gm: fx.GraphModule) -> bool:
        targets = select(gm, self.capture, self.depth, self.include, self.exclude)
        recorder = ensure_recorder(gm, self.name)
        if not targets:
            # records(gm) still works, and says why it is empty
            message = (f"the selection capture={self.capture!r}, depth={self.depth!r}, "
                       f"include={self.include!r}, exclude={self.exclude!r} selects no value "
                       f"of {type(gm).__name__}, so nothing is captured. "
                       f"fxdebug.print_tabular(fxdebug.trace(model)) lists every key.")
            notes = getattr(getattr(gm, RECORDER_ATTR), "notes", None)
            if isinstance(notes, list):  # a part's recorder files into the shared one
                notes.append(message)
            warnings.warn(f"fxdebug Capture: {message}", FidelityWarning,
                          stacklevel=caller_stacklevel())
            return True
        aliases = AliasAnalysis(gm)

        def call(target):
            clone = aliases.written_after(target.nodes, target.anchor)
            function = runtime.capture_stats if self.mode == "stats" else runtime.capture
            return function, ({"clone": True} if clone else {})

        insert_per_target(gm, recorder, targets, self.name, "capture", "capture", call)
        if self.mode == "stats":
            _flush_after_last_capture(gm)
        _note_layouts(gm, targets)
        return True


def _flush_after_last_capture(gm: fx.GraphModule) -> None:
    """The last ``capture_stats`` node of the graph computes the statistics of the forward's
    small captures together (see :mod:`fxdebug.runtime.stats_batch`)."""
    last = None
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is runtime.capture_stats:
            if node.kwargs.get("flush"):
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "flush"}
            last = node
    if last is not None:
        last.kwargs = {**last.kwargs, "flush": True}


def _note_layouts(gm: fx.GraphModule, targets) -> None:
    """On a tensor-parallel model, tell the recorder each capture's module output layout."""
    module_of = {}
    for target in targets:
        node = target.anchor if target.anchor in target.nodes else target.nodes[-1]
        module_of[target.key] = (node.target if node.op == "call_module"
                                 and isinstance(node.target, str) else None)
    layouts = runtime.plan_layouts(gm, module_of)
    if layouts is not None:
        recorder = getattr(gm, RECORDER_ATTR)
        recorder.layouts = {**(getattr(recorder, "layouts", None) or {}), **layouts}
