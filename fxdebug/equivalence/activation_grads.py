"""The gradient of every activation of a keyed graph, in backward order.

Used by :func:`fxdebug.check_equivalence` with ``grads=True`` to name the
first node, in backward order, whose output gradient differs between two
modules. One forward and one backward, run node by node with
``torch.fx.Interpreter``; a ``Tensor.register_hook`` on each activation keeps a
copy of its gradient. Hooks go on the run's own activations only (never on
parameters), so none outlives the run; no ``saved_tensors_hooks`` are used.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..runtime import flatten_tensors
from ..tracing.keys import META_PASS

__all__ = ["activation_grads"]

_OPS = ("placeholder", "call_function", "call_method", "call_module")


class _Collect(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.grads: dict[fx.Node, dict[str, torch.Tensor]] = {}

    def run_node(self, node: fx.Node):
        out = super().run_node(node)
        if node.op in _OPS and META_PASS not in node.meta:
            for sub, tensor in flatten_tensors(out):
                if tensor.requires_grad and (not tensor.is_leaf or node.op == "placeholder"):
                    tensor.register_hook(self._hook(node, sub))
        return out

    def _hook(self, node: fx.Node, sub: str):
        def hook(grad: torch.Tensor) -> None:
            self.grads.setdefault(node, {}).setdefault(sub, grad.detach().clone())
        return hook


def activation_grads(gm: fx.GraphModule, args: tuple, loss_of) -> dict[fx.Node, dict[str, Any]]:
    """``{node: {subpath: gradient}}`` of ``loss_of(gm(*args))``, in the order backward reached them.

    ``loss_of(output)`` returns a scalar tensor, or None when nothing requires
    grad (then the result is empty). Parameter ``.grad`` is left alone.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()))
    >>> grads = activation_grads(gm, (torch.ones(1, 2),), lambda out: out.sum())
    >>> [node.meta["fxdebug_key"] for node in grads]
    ['1', '0']
    """
    collect = _Collect(gm)
    with torch.enable_grad():
        loss = loss_of(collect.run(*args))
    if loss is None or not loss.requires_grad:
        return {}
    wrt: list[torch.Tensor] = [p for p in gm.parameters() if p.requires_grad]
    wrt += [t for _, t in flatten_tensors(args) if t.requires_grad]
    if wrt:
        torch.autograd.grad(loss, wrt, allow_unused=True)
    return collect.grads
