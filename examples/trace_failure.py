"""Untraceable models (seed 004: debugging FX). Data-dependent control flow inside a
submodule: fxdebug.trace makes that submodule a leaf (auto_leaf) and says which.
Control flow in the root forward: fxdebug.TraceFailure names the file:line, the
statement and the fix. Run: python examples/trace_failure.py
"""
import inspect
import warnings

import torch
import torch.nn as nn

import fxdebug


class Gate(nn.Module):
    def forward(self, x):
        # data-dependent: which branch runs depends on the values in x
        if x.sum() > 0:
            return torch.relu(x)
        return -x


class GatedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.fc = Gate(), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.gate(x))


class Normalizer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, normalize=True):
        h = self.fc(x)
        # control flow in the root forward, on an argument that tracing makes a Proxy
        if normalize:
            h = h / h.norm()
        return h


torch.manual_seed(0)
net = GatedNet()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gm = fxdebug.instrument(net)
print("== GatedNet: control flow in submodule 'gate'")
leaf_warnings = [str(w.message) for w in caught if "as leaves" in str(w.message)]
print("warning:", *leaf_warnings)
assert len(leaf_warnings) == 1 and "gate (" in leaf_warnings[0]
print("auto leaves:", gm.meta["fxdebug_auto_leaves"])
assert [path for path, _ in gm.meta["fxdebug_auto_leaves"]] == ["gate"]
for x in (torch.ones(1, 4), -torch.ones(1, 4)):  # both branches of Gate, run eagerly
    assert torch.equal(gm(x), net(x))
    assert torch.equal(fxdebug.records(gm)["gate"], net.gate(x))
print("captured:", fxdebug.records(gm).keys(), "\n")

model = Normalizer()
try:
    fxdebug.trace(model)
    raise AssertionError("tracing Normalizer should fail")
except fxdebug.TraceFailure as failure:
    print("== Normalizer: control flow in the root forward\nTraceFailure:", failure)
    src, start = inspect.getsourcelines(Normalizer.forward)
    line = start + next(i for i, text in enumerate(src) if "if normalize:" in text)
    assert failure.location.endswith(f"trace_failure.py:{line}"), failure.location
    assert failure.module_path == "" and "concrete_args" in failure.fix
gm = fxdebug.trace(model, concrete_args={"normalize": True})  # the fix it names
x = torch.randn(2, 4)
assert torch.equal(gm(x), model(x))
print("with concrete_args={'normalize': True}: traced, equals eager")
print("ok: submodule became a leaf, root failure named file:line and a fix that works")
