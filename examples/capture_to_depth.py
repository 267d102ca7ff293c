"""Seed 000: forward hooks on every module up to CONFIG_EXPAND_LEVEL, with
`recur_detach` flattening tuple/dict outputs into an OrderedDict of '/' keys.
Shows `fxdebug.instrument(model, depth=...)` capturing the same values, checked
against that hand-written hook code.  Run: python examples/capture_to_depth.py
"""
from collections import OrderedDict

import torch
import torch.nn as nn
import torchvision

import fxdebug


class Pair(nn.Module):  # returns a tuple
    def __init__(self):
        super().__init__()
        self.proj, self.act = nn.Linear(8, 8), nn.ReLU()

    def forward(self, x):
        h = self.proj(x)
        return h, self.act(h)


class Heads(nn.ModuleDict):  # returns a dict
    def forward(self, x):
        return {name: head(x) for name, head in self.items()}


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Pair()
        self.heads = Heads({"mean": nn.Linear(8, 2), "logvar": nn.Linear(8, 2)})

    def forward(self, x):
        h, r = self.enc(x)
        out = self.heads(h + r)
        return out["mean"] + out["logvar"].exp()


def recur_detach(xdict, name, output, sep="/"):  # seed 000, but cloning, not only detaching
    if isinstance(output, (tuple, dict)):
        items = output.items() if isinstance(output, dict) else enumerate(output)
        for k, v in items:
            recur_detach(xdict, name + sep + str(k), v, sep)
    else:  # clone: resnet's in-place ReLU would otherwise overwrite the stored bn1 output
        xdict[name] = output.detach().clone()


def by_hand(model, x, level):
    """The seed's hooks: every named module with k.count('.') <= level (the root excluded)."""
    xdict = OrderedDict()
    handles = [v.register_forward_hook(lambda mod, inp, out, k=k: recur_detach(xdict, k, out))
               for k, v in model.named_modules() if k and k.count(".") <= level]
    model(x)
    for handle in handles:
        handle.remove()
    return xdict


def compare(name, model, x, depth):
    gm = fxdebug.instrument(model, depth=depth)
    gm(x)
    rec = fxdebug.records(gm)
    print(f"== {name}, depth={depth}: {len(rec)} captures\n{rec.keys()}\n{rec.table()}\n")
    expected = by_hand(model, x, depth)
    assert rec.keys() == list(expected), (rec.keys(), list(expected))
    for key, value in expected.items():
        assert torch.equal(rec[key], value), key


torch.manual_seed(0)
net, x = Net(), torch.randn(2, 8)
for depth in (0, 1):
    compare("Net (tuple and dict outputs)", net, x, depth)
compare("resnet18 at 64x64", torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64), 1)
print("ok: every capture equals the seed's forward hook + recur_detach value")
