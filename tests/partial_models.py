"""Small models whose root fx cannot trace (used by tests/test_partial.py and its subprocesses)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x, mask=None):
        y = self.act(self.fc(x))
        if mask is not None:  # symbolic tracing would take this branch for a None mask too
            y = y * mask
        return y + x


class Flow(nn.Module):
    """Root branches on values; a Sequential called per item; an optional argument."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.block = Block()
        self.head = nn.Linear(8, 2)

    def forward(self, xs):
        outs = []
        for x in xs:
            h = self.stem(x)
            if x.sum() > 0:
                h = self.block(h)
            else:
                h = self.block(h, mask=(h > 0).float())
            outs.append(self.head(h))
        return torch.stack(outs).sum(0)


class Boxes:
    """Not a tensor, not a container fxdebug can specialise on (like torchvision's ImageList)."""

    def __init__(self, tensor):
        self.tensor = tensor


class TakesBoxes(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, boxes):
        return self.fc(boxes.tensor)


class Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = TakesBoxes()
        self.out = nn.Sequential(nn.Linear(4, 3))

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return self.out(self.inner(Boxes(x)))


def flow_inputs():
    return ([torch.ones(2, 4), -torch.ones(2, 4), torch.full((2, 4), 0.5)],)
