"""Models that exercise what fxdebug.dump must write: fx.wrap'd functions, tied and frozen
parameters, non-persistent buffers, a leaf whose constructor cannot be recovered."""

from __future__ import annotations

import torch
from torch import nn


def scaled_softplus(x, beta: float):
    """Kept as one call by torch.fx.wrap: Python control flow on a float argument."""
    if beta <= 0:
        raise ValueError("beta must be positive")
    return torch.nn.functional.softplus(x * beta) / beta


torch.fx.wrap("scaled_softplus")


class Opaque(nn.Module):
    """A leaf whose constructor argument is not stored anywhere: dump must pickle it."""

    def __init__(self, width):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.register_buffer("shift", torch.linspace(-1, 1, width), persistent=False)

    def forward(self, x):
        return self.inner(x) + self.shift


class Gadgets(nn.Module):
    """Root parameter and non-persistent buffer, tied weights, a frozen layer, a wrapped call."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.b.weight = self.a.weight                      # tied
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 6))
        self.register_buffer("offset", torch.arange(6.0) / 10, persistent=False)
        self.norm = nn.LayerNorm(6)
        self.opaque = Opaque(6)

    def forward(self, x):
        h = scaled_softplus(self.a(x), 2.0) * self.gain + self.offset
        h = self.norm(self.b(h)) + self.frozen(h)
        return self.opaque(h)


class DictInput(nn.Module):
    """Traced with concrete_args={"d": {"a": PH, "b": PH}}: torch.fx flattens the dict in forward."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, d):
        return {"y": self.lin(d["a"]) + d["b"]}
