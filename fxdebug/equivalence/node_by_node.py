"""Run a traced module node by node and hand selected live values to a callback.

Shared by ``vjp`` and ``jacobian_norms``: both need the values *with* their
autograd graph, which capture nodes deliberately do not keep.
"""

from __future__ import annotations

import difflib
from typing import Callable

import torch.fx as fx

from ..errors import SelectionError
from ..tracing.selection import Target, candidates


def find_target(gm: fx.GraphModule, key: str, role: str) -> Target:
    """The node (or module output) with exactly this key; an error lists close keys."""
    pool = candidates(gm, every_node=True)
    for target in pool:
        if target.key == key:
            return target
    keys = [target.key for target in pool]
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    hint = f" Close keys: {', '.join(map(repr, close))}." if close else ""
    raise SelectionError(f"{role}={key!r} is not a node key of {type(gm).__name__}.{hint} "
                         f"Keys are module paths such as 'layer1.0.conv1' or 'layer2'.")


class LiveRun(fx.Interpreter):
    """Interpreter that calls ``on_value(target, value) -> value`` when a target's value is complete.

    The returned value replaces the node's value for the rest of the run, so
    a caller can splice in a differentiable probe.
    """

    def __init__(self, gm: fx.GraphModule, targets: list[Target],
                 on_value: Callable[[Target, object], object]) -> None:
        super().__init__(gm)
        self._by_anchor: dict[fx.Node, list[Target]] = {}
        for target in targets:
            # a single-node value is spliced where it is made; nested outputs when complete
            where = target.value if isinstance(target.value, fx.Node) else target.anchor
            self._by_anchor.setdefault(where, []).append(target)
        self._on_value = on_value

    def run_node(self, node: fx.Node):
        value = super().run_node(node)
        for target in self._by_anchor.get(node, ()):
            if target.value is node:
                value = self._on_value(target, value)
            else:  # a module output made of other nodes' values
                self._on_value(target, fx.node.map_arg(target.value, lambda n: self.env[n]))
        return value
