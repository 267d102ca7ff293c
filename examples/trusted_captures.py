"""Captures you can trust: writes torch.fx cannot see, and keys that match forward hooks.

A leaf module (its body is not in the graph) and a torch.fx.wrap'd function both write
their input in place. fxdebug treats such opaque calls as writers, so the capture of
what they receive is a copy and equals what a forward hook saw. A write after the
forward makes a capture stale, and fxdebug refuses to show it. Module calls are keyed
as forward hooks count them. Run: python examples/trusted_captures.py
"""
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

import fxdebug
from fxdebug.errors import StaleCaptureError


def halve_(x):
    x.mul_(0.5)  # in place, inside a function fx does not trace into
    return x


torch.fx.wrap("halve_")


class Doubler(nn.Module):
    def forward(self, x):
        return x.mul_(2)  # in place on its input


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.doubler = Doubler()
        self.relu = nn.ReLU()

    def forward(self, x):
        h = self.relu(self.lin(x))
        h = F.relu(self.doubler(h) - 1)
        return self.relu(halve_(h) + 1)


torch.manual_seed(0)
model, x = Net(), torch.randn(2, 4)

# ground truth: forward hooks storing output.clone(), the n-th call of a module keyed name_n
hooked, calls, handles = {}, {}, []
for name, module in model.named_modules():
    if name:
        def hook(_, __, out, name=name):
            count = calls[name] = calls.get(name, -1) + 1
            hooked[name if count == 0 else f"{name}_{count}"] = out.detach().clone()
        handles.append(module.register_forward_hook(hook))
expected = model(x.clone())
for handle in handles:
    handle.remove()

gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[Doubler]))
out = gm(x)
rec = fxdebug.records(gm)
print("keys:", rec.keys())
print("F.relu's key:", [n.meta["fxdebug_key"] for n in gm.graph.nodes if n.target is F.relu])
assert torch.equal(out, expected)
assert rec.keys() == list(hooked) == ["lin", "relu", "doubler", "relu_1"]
for key, value in hooked.items():
    assert torch.equal(rec[key], value), key
    print(f"{key:8s} equals the hook's clone (copied: {rec.record(key).copied})")

# halve_ writes F.relu's output in place: its capture is a copy taken before the write
gm_all = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[Doubler]), capture="all")
gm_all(x)
assert torch.equal(fxdebug.records(gm_all)["relu_fn"], F.relu(hooked["relu"] * 2 - 1))
print("relu_fn  equals F.relu's output before halve_ wrote it (copied: "
      f"{fxdebug.records(gm_all).record('relu_fn').copied})")

out.detach().zero_()  # your code writes the output after the forward
try:
    rec["relu_1"]
except StaleCaptureError as error:
    print("stale:", str(error).split(":")[0])
else:
    raise AssertionError("a stale capture was shown")
print("ok: captures equal forward hooks under writes fx cannot see; a stale capture raises")
