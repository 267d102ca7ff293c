"""The training monitor's taps inside ``torch.compile``: outputs' and gradients' moment summaries
taken by graph ops, with no graph break and nothing run in Python per key.

The compiled monitor's copy of a model (``fxdebug.monitoring.compiled_copy``) calls these where
``instrument(grads=True)`` put its capture and gradient nodes::

    fc = self.fc(x)
    tap_output(bank, fc, 'fc')                 bank.pending += (("out", "fc", summary),):
                                               graph_moments(fc), an output of the graph that
                                               dynamo stores once per run (a side effect)
    fc_tapped = tap_grads(bank, fc, 'fc', 0)   GradTap: the identity forward; its backward
    relu = self.relu(fc_tapped)                hands graph_moments(grad) + [1] out as the
                                               gradient of bank.slots[0][j], a leaf tensor
                                               the monitor reads (.grad) after the backward

Each forward of the copy gets new slots (the monitor sets ``bank.slots`` before it), so two
forwards' gradients never add up; a slot whose last number is not 1 got several backwards (the
monitor notes it rather than report a sum). A value whose later in-place op writes it is cloned by
the tap (``clone=True``): autograd forbids writing in place to a custom Function's view.

>>> bank = TapBank(1)
>>> bank.start()
>>> x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
>>> tap_output(bank, x, "x")
>>> y = tap_grads(bank, x * 1.0, "x", 0)
>>> (y * 2).sum().backward()
>>> bank.pending[0][1], bank.slots[0].grad[0].tolist()[:3]
('x', [3.0, 2.0, 0.0])
"""

from __future__ import annotations

import torch
from torch.fx.node import has_side_effect

from .moments import graph_moments
from ..runtime.values import flatten_tensors, map_tensors

__all__ = ["TapBank", "tap_output", "tap_grads", "PARTS", "WIDTH"]

PARTS = 16
"""The tensors of one module output whose gradients a tap can summarize (a tuple or dict output);
the parts past these have no ``grad`` series, and a note says so."""

WIDTH = 11
"""A gradient slot's row: the 10 numbers of a moment summary, then how many backwards wrote it."""


class TapBank(torch.nn.Module):
    """Submodule ``fxdebug_monitor_bank`` of a compiled monitor's copy: where its taps leave
    the summaries of one forward.

    ``pending``: ``(("out", name, summary), ("grad", name, (node, part)), ...)`` of the latest
    forward, in capture order; ``slots``: one leaf tensor ``(PARTS, WIDTH)`` per gradient node,
    its ``.grad`` the gradients' summaries after the backward. It has no parameters and is never
    called.
    """

    def __init__(self, nodes: int) -> None:
        super().__init__()
        self.nodes = nodes
        self.pending: tuple = ()
        self.slots: list[torch.Tensor] = []
        self.device: torch.device | None = None

    def start(self, device: torch.device | None = None) -> None:
        """New slots and an empty ``pending`` for the next forward (on ``device``)."""
        self.pending = ()
        self.slots = [torch.zeros(PARTS, WIDTH, dtype=torch.float64, device=device,
                                  requires_grad=True) for _ in range(self.nodes)]

    def forward(self, *args, **kwargs):
        raise TypeError("TapBank holds the compiled monitor's summaries and is not callable.")


@has_side_effect
def tap_output(bank: TapBank, value, key: str) -> None:
    """File the moment summary of every tensor of ``value`` (names as ``Records``: ``key/0``...)."""
    entries = tuple(("out", name, graph_moments(tensor))
                    for name, tensor in flatten_tensors(value, key) if _summarizable(tensor))
    if entries:
        bank.pending = bank.pending + entries
    return None


class GradTap(torch.autograd.Function):
    """The identity on ``value``; the gradient of ``slot`` is ``value``'s gradient's summary."""

    @staticmethod
    def forward(ctx, value, slot, clone):
        return value.clone() if clone else value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        done = torch.ones(1, dtype=torch.float64, device=grad.device)  # one backward wrote it
        row = torch.cat([graph_moments(grad), done])
        return grad, row.to(torch.float64), None


_through_tap = GradTap.apply  # (an autograd.Function's apply, not a pass's)


@has_side_effect
def tap_grads(bank: TapBank, value, key: str, node: int, clone: bool = False):
    """``value`` with each tensor that requires grad passed through :class:`GradTap` (part ``j``
    into ``bank.slots[node][j]``); the graph uses what this returns instead of ``value``."""
    if not torch.is_grad_enabled():
        return value
    slot = bank.slots[node]
    if isinstance(value, torch.Tensor):
        if not _tappable(value):
            return value
        bank.pending = bank.pending + (("grad", key, (node, 0)),)
        return _through_tap(value, slot[0], clone)
    named = flatten_tensors(value, key)
    tapped: list[torch.Tensor] = []
    entries: list[tuple] = []
    part = 0
    for name, tensor in named:
        if _tappable(tensor) and part < PARTS:
            entries.append(("grad", name, (node, part)))
            tensor = _through_tap(tensor, slot[part], clone)
            part += 1
        elif _tappable(tensor):
            entries.append(("skipped", name, None))
        tapped.append(tensor)
    if entries:
        bank.pending = bank.pending + tuple(entries)
    order = iter(tapped)
    return map_tensors(lambda _: next(order), value)


def _summarizable(tensor: torch.Tensor) -> bool:
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.layout == torch.strided
            and not tensor.is_quantized and tensor.device.type != "meta" and tensor.numel() > 0)


def _tappable(tensor: torch.Tensor) -> bool:
    return _summarizable(tensor) and tensor.requires_grad and tensor.is_floating_point()
