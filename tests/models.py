"""Small models the tests share: the seeds' models and the awkward cases."""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import nn


class SeedOneNet(nn.Module):
    """Seed 001's ``myNet``: a lambda flatten between a conv and a linear layer."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.flatten = lambda x: x.view(-1)
        self.fc1 = nn.Linear(160, 5)

    def forward(self, x):
        x = self.relu(self.conv(x))
        return self.fc1(self.flatten(x))


Pair = collections.namedtuple("Pair", ["low", "high"])


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class TupleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h)


class DictBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return {"value": y, "gate": torch.sigmoid(y), "split": Pair(y[:, :4], y[:, 4:])}


class NestedOutputs(nn.Module):
    """Seed 000's shape of model: submodules return tuples and dicts."""

    def __init__(self):
        super().__init__()
        self.enc = TupleBlock()
        self.mix = DictBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h, small = self.enc(x)
        d = self.mix(h)
        return Output(logits=self.head(d["value"] * d["gate"]), hidden=small)


class Reuse(nn.Module):
    """One Linear and one block called twice."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.block = nn.Sequential(nn.Linear(6, 6), nn.GELU())

    def forward(self, x):
        x = self.fc(x)
        x = self.block(x)
        x = self.fc(x)
        return self.block(x) + x


class ViewAugAssign(nn.Module):
    """Mutates a view with ``+=``: plain symbolic_trace turns it into ``v = v + 100``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        v = h[:, :2]
        v += 100
        v *= 2
        return h


class LaterInplace(nn.Module):
    """A conv output later overwritten by an in-place ReLU and an in-place add."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = self.conv(x)
        z = self.act(y)
        z[:, 0] = 0.0
        pooled = z.mean(dim=(2, 3))
        return self.fc(pooled)
