"""Seed 003's in-place autograd hazards as small models, each with a hand-fixed twin.

Every model marks the line of its (last) in-place write with ``# HAZARD``;
tests find that line with ``inspect`` instead of hard-coding numbers. The
``Fixed*`` twins compute the same forward values written out of place (what a
person fixes by hand), with the same parameter names.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn


def hazard_line(cls) -> tuple[str, int]:
    """``(file, line)`` of the statement marked ``# HAZARD`` in ``cls.forward``."""
    lines, first = inspect.getsourcelines(cls.forward)
    for offset, line in enumerate(lines):
        if "# HAZARD" in line:
            return inspect.getsourcefile(cls), first + offset
    raise LookupError(f"{cls.__name__}.forward has no '# HAZARD' line")


class SigmoidZeroed(nn.Module):
    """Seed 003: a sigmoid output zeroed in place (below 0.5); SigmoidBackward needs it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        out = torch.sigmoid(self.fc(x))
        out.masked_fill_(out < 0.5, 0.0)  # HAZARD
        return out


class FixedSigmoidZeroed(SigmoidZeroed):
    def forward(self, x):
        out = torch.sigmoid(self.fc(x))
        out = out.masked_fill(out < 0.5, 0.0)
        return out


class MatmulThenSetitem(nn.Module):
    """Seed 003: ``d = x @ w1; f = d @ w2; d[:] = 0``: MmBackward of ``f`` needs ``d``."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([[2.0], [1.0]]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))

    def forward(self, x):
        d = torch.matmul(x, self.w1)
        f = torch.matmul(d, self.w2)
        d[:] = 0  # HAZARD
        return f, d


class FixedMatmulThenSetitem(MatmulThenSetitem):
    def forward(self, x):
        d = torch.matmul(x, self.w1)
        f = torch.matmul(d, self.w2)
        d = torch.zeros_like(d)
        return f, d


class EmbeddingMaxNorm(nn.Module):
    """Seed 003: the weight used directly, then ``Embedding(max_norm=1)`` renormalises it."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(3, 5, max_norm=1)
        self.W = nn.Parameter(torch.randn(7, 5))

    def forward(self, idx):
        a = self.embedding.weight @ self.W.t()
        b = self.embedding(idx) @ self.W.t()  # HAZARD
        out = a.unsqueeze(0) + b.unsqueeze(1)
        return out.sigmoid().prod()


class FixedEmbeddingMaxNorm(EmbeddingMaxNorm):
    def forward(self, idx):
        a = self.embedding.weight.clone() @ self.W.t()
        b = self.embedding(idx) @ self.W.t()
        out = a.unsqueeze(0) + b.unsqueeze(1)
        return out.sigmoid().prod()


class EmbeddingTwice(nn.Module):
    """``Embedding(max_norm=1)`` called twice: renormalises in place, but breaks nothing."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(6, 5, max_norm=1)

    def forward(self, a, b):
        return (self.embedding(a) * self.embedding(b)).sum()


class DataZeroed(nn.Module):
    """Seed 003: ``out.data.zero_()`` on a saved output: no error, wrong gradients."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        out = self.fc(x).sigmoid()
        out.data.zero_()  # HAZARD
        return out


class DetachZeroed(nn.Module):
    """Seed 003 with ``.detach()``: the same write, which PyTorch reports at backward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        out = self.fc(x).sigmoid()
        c = out.detach()
        c.zero_()  # HAZARD
        return out


class HarmlessInplaceRelu(nn.Module):
    """Resnet's pattern: ``+=`` and ``ReLU(inplace=True)`` on a BatchNorm output, which
    BatchNorm does not save (it saves its input): in place, but harmless."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.bn(self.conv(x))
        h += x
        h = self.relu(h)  # HAZARD
        return self.fc(h.mean(dim=(2, 3)))


class FixedHarmlessInplaceRelu(HarmlessInplaceRelu):
    def forward(self, x):
        h = self.bn(self.conv(x))
        h = h + x
        h = torch.relu(h)
        return self.fc(h.mean(dim=(2, 3)))


class ReluThenInplaceAdd(nn.Module):
    """``torch.relu`` saves its result; ``y += 1`` then changes it (operator.iadd)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        y += 1  # HAZARD
        return y * 2


class FixedReluThenInplaceAdd(ReluThenInplaceAdd):
    def forward(self, x):
        y = torch.relu(self.fc(x))
        y = y + 1
        return y * 2
