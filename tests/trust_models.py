"""Small models torch.fx gets silently wrong: random ops, tensor constructors, context
managers, static forwards, attribute writes, branches on values (tests/test_trust_tracing.py).

Each one is a class of model, not a special case: the test checks it against eager.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
from torch import randn  # imported by name: fxdebug must see this call too


class RandomOps(nn.Module):
    """Random ops and constructors whose arguments are all constants."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.keep = torch.full((2, 4), 0.7)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        h = self.fc(x) + torch.rand(4) + randn(2, 4) * 0.1
        h = h[:, torch.randperm(4)] + torch.randint(0, 3, (4,))
        h = h * torch.bernoulli(self.keep) + torch.empty(4).uniform_() + torch.normal(0.0, 1.0, (4,))
        return h


class ConstructedTensors(nn.Module):
    """Tensors built from Python values in forward, then written in place."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        total = torch.zeros(2, 4)
        total += self.fc(x)  # in place into a constructor's result: it must be fresh each call
        offsets = torch.tensor([1.0, 2.0, 3.0, 4.0]) + torch.from_numpy(np.arange(4.0, dtype=np.float32))
        return total * torch.ones(4) + offsets + torch.arange(4)


class Noisy(nn.Module):
    def forward(self, x):
        return x + torch.randn(4)


class RandomInside(nn.Module):
    """Random ops inside a submodule: captures must hold this run's values."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.noise = Noisy()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.noise(self.fc(x)))


class GradModes(nn.Module):
    """Blocks under no_grad / enable_grad / set_grad_enabled: gradients must equal eager."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        with torch.no_grad():
            frozen = self.a(x)
            with torch.enable_grad():
                inner = self.b(x)
        with torch.set_grad_enabled(False):
            fixed = self.c(inner)
        return self.d(frozen) + inner + fixed


class NoGradDecorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.stats = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 4)

    @torch.no_grad()
    def statistics(self, x):
        return self.stats(x).mean(0)

    def forward(self, x):
        return self.fc(x) * self.statistics(x)


class Autocast(nn.Module):
    """A block under torch.autocast: its matmul runs in bfloat16, as in eager."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc(x)
        return self.head(h.float())


class InferenceBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.inference_mode():  # INFERENCE LINE
            h = self.fc(x)
        return h.clone()


class HoldsInference(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.block = InferenceBlock()

    def forward(self, x):
        return self.block(self.pre(x)) + 1


class StaticForward(nn.Module):
    @staticmethod
    def forward(x):
        return x * 2 + torch.tanh(x)


class StarArgs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, *args):
        return self.fc(args[0]) - args[1]


class HoldsOddForwards(nn.Module):
    """A root fx cannot trace (a branch on values) around a static and a *args forward."""

    def __init__(self):
        super().__init__()
        self.static = StaticForward()
        self.star = StarArgs()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            x = x + 1
        return self.fc(self.static(x)) + self.star(x, x)


class CachesSquare(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.cache = x ** 2  # CACHE LINE
        return self.fc(x)


class HoldsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.cached = CachesSquare()

    def forward(self, x):
        return self.cached(self.pre(x)) * 2


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h
        return -h


class ShapeBranch(nn.Module):
    def forward(self, x):
        if x.shape[0] > 1:
            return x.mean(0)
        return x[0]


class FlagBranch(nn.Module):
    def forward(self, x, normalize=True):
        if not normalize:
            return x
        return x / x.norm()


class KeepsHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.history = []

    def forward(self, x):
        h = self.fc(x)
        self.history.append(h * 2)  # HISTORY LINE
        return h


class HoldsHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.keeps = KeepsHistory()
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.keeps(x))


class ConstantBranches(nn.Module):
    """Python needs the value of a constructor's result: computed once, as plain fx did."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        scale = torch.tensor(4.0).sqrt()
        if scale > 1:
            x = x * 2
        for step in torch.arange(2):
            x = x + step
        for _ in range(int(torch.tensor(2))):
            x = x + 1
        return self.fc(x) * len(torch.ones(3)) / float(scale)


class RandomBranch(nn.Module):
    def forward(self, x):
        if torch.rand(1) > 0.5:  # RANDOM BRANCH LINE
            return x
        return -x


class ReverseGrad(torch.autograd.Function):
    """Gradient reversal (domain adaptation): identity forward, negated gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class ReversesGradient(nn.Module):
    def forward(self, x):
        return ReverseGrad.apply(x)  # FUNCTION LINE


class HoldsCustomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.reverse = ReversesGradient()
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(torch.tanh(self.reverse(self.pre(x))))


class CustomFunctionAtRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.post = nn.Linear(4, 2)

    def forward(self, x):
        return self.post(ReverseGrad.apply(self.pre(x)))  # ROOT FUNCTION LINE
