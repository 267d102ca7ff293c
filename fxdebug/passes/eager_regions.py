"""EagerRegions: capture inside the leaf modules a graph calls as one node.

A traced graph calls some modules as a single ``call_module`` node and never
looks inside: an auto-leaf (fx could not trace it), a user's leaf module, a
``torch.nn`` module with children (``TransformerEncoder``, ``MultiheadAttention``).
This pass lists the modules of each such subtree in the GraphModule's
``meta`` (``runtime.RegionForwards``); while the GraphModule runs, and only then, those
modules (the user's own, never copies) get a ``forward`` that captures::

    gm(x)                                    DebugGraphModule.__call__
      with RegionForwards.installed(gm):     forwards put in, removed after
    block = self.block(x)                    the graph is unchanged
      └─ RegionForward(entry) of block       EagerScope.region("block")
           ├─ self.conv(x) -> RegionForward  captured as "block.conv" (per call:
           │                                 "block.conv_1"...)
           └─ torch.relu(...)                with capture="all": "block.relu"

so ``capture="modules"`` sees every module call and ``capture="all"`` every
op, whichever way a part ran. The records say ``via="eager module"`` /
``"eager op"``. What such a forward writes to its module (``self.cache = x``)
lands on the user's module, as in eager. A graph without such modules is not
touched.
"""

from __future__ import annotations

import functools

import torch
import torch.fx as fx

from .. import runtime
from ..base import torch_compat
from ..partial.call_specialization import is_container, is_fx_leaf
from ..partial.part_selection import Selection
from ._placement import ensure_recorder
from .base import Pass

__all__ = ["EagerRegions", "hides_calls"]


def hides_calls(module: torch.nn.Module) -> bool:
    """Whether a graph calling ``module`` as one node misses calls or ops inside it.

    >>> hides_calls(torch.nn.Linear(2, 2)), hides_calls(torch.nn.TransformerEncoderLayer(4, 1))
    (False, True)
    """
    if "forward" in module.__dict__:  # a dispatcher of a part-by-part model, or done already
        return False
    return not is_fx_leaf(module) or next(module.children(), None) is not None


class EagerRegions(Pass):
    """Capture module calls (and, with ``capture="all"``, ops) inside leaf-module nodes.

    Args: as :class:`~fxdebug.passes.Capture`, plus ``grads`` (record the
    gradients of what is captured there too).

    Example::

        >>> import torch, fxdebug
        >>> layer = torch.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0)
        >>> gm = fxdebug.instrument(torch.nn.Sequential(layer))
        >>> _ = gm(torch.randn(3, 1, 8))
        >>> [k for k in fxdebug.records(gm).keys() if k.startswith("0.l")]
        ['0.linear1', '0.linear2']
    """

    name = "eager_regions"
    exact_modified = True  # run() returns False only where it changed nothing (base.run_passes)

    def __init__(self, capture="modules", depth=None, include=None, exclude=None,
                 grads: bool = False, mode: str = "tensor") -> None:
        self.selection = Selection(capture, depth, include, exclude, grads, mode)

    def run(self, gm: fx.GraphModule) -> bool:
        leaves = [str(node.target) for node in gm.graph.nodes if node.op == "call_module"]
        modules = dict(gm.named_modules(remove_duplicate=False))
        leaves = [path for path in dict.fromkeys(leaves)
                  if hides_calls(modules.get(path) or gm.get_submodule(path))]
        if not leaves:
            return False
        ensure_recorder(gm, self.name)
        recorder = getattr(gm, runtime.RECORDER_ATTR)
        paths = [name for name in modules if name]
        scope = runtime.EagerScope(recorder, self.selection,
                                   functools.partial(runtime.EagerKeys, tuple(paths)),
                                   record_ops=self.selection.records_ops)
        entries: list[tuple[str, bool, bool]] = []
        seen: set[int] = set()
        for path in leaves:
            entries.extend(_region_entries(gm.get_submodule(path), path, seen))
        # in meta: GraphModule's deepcopy and fxdebug's pickling keep it, with the recorder
        gm.meta[runtime.REGIONS_ATTR] = runtime.RegionForwards(scope, entries)
        return True


def _region_entries(module: torch.nn.Module, path: str, seen: set[int]):
    """``(path, entry, ops)`` of every module of the subtree that captures while a region runs."""
    def walk(original: torch.nn.Module, at: str, entry: bool):
        if id(original) in seen:
            return
        seen.add(id(original))
        if not is_container(original) and "forward" not in original.__dict__:
            ops = not is_fx_leaf(original) or next(original.children(), None) is not None
            yield at, entry, ops
        for name, child in torch_compat.own_children(original).items():
            if child is not None:
                yield from walk(child, f"{at}.{name}", False)

    return list(walk(module, path, True))
