"""Random ops and no_grad blocks stay faithful. Plain torch.fx freezes `torch.rand(4)` into a
constant (every run then adds the same "noise") and drops `with torch.no_grad():` (gradients
then flow where eager had none). fxdebug traces both as graph nodes, so outputs, captures
and parameter gradients equal eager. Run: python examples/random_and_no_grad.py
"""
import warnings

import torch
import torch.nn as nn

import fxdebug


class NoisyStudent(nn.Module):
    def __init__(self):
        super().__init__()
        self.teacher, self.student = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():                        # the teacher is not trained
            target = self.teacher(x)
        noisy = self.student(x) + 0.1 * torch.randn(4)   # fresh noise on every call
        return (noisy - target).pow(2).mean()


class Cached(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.last = x.detach()                       # state written in forward
        return self.fc(x)


torch.manual_seed(0)
model, x = NoisyStudent(), torch.randn(8, 4)

plain = torch.fx.symbolic_trace(model)
print("torch.fx froze the noise:", [n.target for n in plain.graph.nodes if n.op == "get_attr"])

gm = fxdebug.instrument(model, grads=True)
print(gm.code)
for seed in (1, 2):
    torch.manual_seed(seed)
    expected = model(x)
    model.zero_grad()
    expected.backward()
    eager_grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = gm(x)
    loss.backward()
    assert torch.equal(loss, expected), (loss, expected)
    for name, p in model.named_parameters():
        assert (p.grad is None) == (eager_grads[name] is None), name
        assert p.grad is None or torch.equal(p.grad, eager_grads[name]), name
    print(f"seed {seed}: loss {loss.item():.6f} equals eager; teacher grads:",
          model.teacher.weight.grad)

with warnings.catch_warnings(record=True) as caught:  # a Proxy would be left on the module
    warnings.simplefilter("always")
    holder = nn.Sequential(Cached(), nn.ReLU())
    gm = fxdebug.instrument(holder)
print("warning:", *[str(w.message) for w in caught])
assert any("stored on the module" in str(w.message) for w in caught)
assert torch.equal(gm(x), holder(x)) and torch.equal(holder[0].last, x)
print("ok: random ops drawn on every call, no_grad kept, attribute writes run eagerly")
