"""``vjp``: a vector-Jacobian product from any node to any earlier node.

Seed 000 does this by hand with hooks that keep live tensors and
``torch.autograd.grad(y, x, grad_outputs=ones)``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import FxdebugError, renamed_arguments
from ..frontend import keyed_module
from .node_by_node import LiveRun, find_target

__all__ = ["vjp"]


@renamed_arguments({"of": "output"})
def vjp(model: torch.nn.Module, *inputs: Any, output: str, wrt: str,
        grad_outputs: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_outputs^T · d(output)/d(wrt)``: the gradient of node ``output`` w.r.t. node ``wrt``.

    Args:
        model: an ``nn.Module`` (traced by fxdebug) or a GraphModule.
        inputs: the model inputs, as the model takes them (``vjp(model, x, y, output=..., wrt=...)``).
        output: key of the node differentiated (e.g. ``"layer2"``; ``of=`` before).
        wrt: key of an earlier node (e.g. ``"layer1.0.conv1"``); the
            gradient is taken w.r.t. its value at that node, even if a later
            in-place op rewrites the tensor.
        grad_outputs: the vector (shape of ``output``); ones by default.

    Returns:
        A tensor shaped like ``wrt``'s value (zeros when ``output`` does not depend on it).

    Example::

        >>> import torch, fxdebug
        >>> net = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Tanh())
        >>> fxdebug.vjp(net, torch.zeros(1, 2), output="1", wrt="0")   # tanh'(0) = 1
        tensor([[1., 1.]])
    """
    gm = keyed_module(model)
    of_target, wrt_target = find_target(gm, output, "output"), find_target(gm, wrt, "wrt")
    order = {node: index for index, node in enumerate(gm.graph.nodes)}
    if order[of_target.anchor] < order[wrt_target.anchor]:
        raise FxdebugError(f"vjp(output={output!r}, wrt={wrt!r}): {output!r} runs before "
                           f"{wrt!r}, so it cannot depend on it; swap output and wrt.")
    found: dict[str, torch.Tensor] = {}

    def on_value(target, value):
        if not isinstance(value, torch.Tensor):
            raise FxdebugError(f"vjp: node {target.key!r} gives {type(value).__name__}, not a "
                               f"tensor; pick a node with a single tensor output.")
        if target.key == wrt:
            leaf = value.detach().requires_grad_(True)
            found["wrt"] = leaf
            value = leaf.clone()  # later in-place ops write to the clone, never to the leaf
        if target.key == output:
            found["of"] = value.clone()  # the value at this node, whatever happens later
        return value

    with torch.enable_grad():
        try:
            LiveRun(gm, [wrt_target] if output == wrt else [wrt_target, of_target], on_value).run(*inputs)
        except (TypeError, RuntimeError) as exc:
            if _one_tuple_of_inputs(inputs):
                count = len(inputs[0])
                raise FxdebugError(
                    f"vjp(model, {type(inputs[0]).__name__} of {count} tensor(s), "
                    f"output={output!r}, wrt={wrt!r}): the model failed on it ({type(exc).__name__}: "
                    f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}). vjp takes "
                    f"the model's inputs as separate arguments, as the model does: write "
                    f"fxdebug.vjp(model, *inputs, output={output!r}, wrt={wrt!r}) (for one input "
                    f"x: fxdebug.vjp(model, x, output=..., wrt=...)), not vjp(model, (x,), "
                    f"...).") from exc
            raise
        out, leaf = found["of"], found["wrt"]
        if grad_outputs is None:
            grad_outputs = torch.ones_like(out)
        elif tuple(grad_outputs.shape) != tuple(out.shape):
            raise FxdebugError(f"vjp: grad_outputs has shape {tuple(grad_outputs.shape)} but "
                               f"{output!r} has shape {tuple(out.shape)}.")
        if not out.requires_grad:
            return torch.zeros_like(leaf)
        (grad,) = torch.autograd.grad(out, leaf, grad_outputs, allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else grad


def _one_tuple_of_inputs(inputs: tuple) -> bool:
    """The call shape before vjp took ``*inputs``: one tuple or list of tensors."""
    return len(inputs) == 1 and isinstance(inputs[0], (tuple, list)) and len(inputs[0]) > 0 \
        and all(isinstance(item, torch.Tensor) for item in inputs[0])
