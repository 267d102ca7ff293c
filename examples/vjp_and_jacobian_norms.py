"""Seed 000: forward hooks that keep live (undetached) tensors, then
`torch.autograd.grad(y, x, grad_outputs=ones)` from 'encoder.layer.N.output' back to
'embeddings.word_embeddings'; and the Frobenius norm of the Jacobian, which the seed's
author found plain backprop cannot give. Shows fxdebug.vjp between two nodes by key
(no hooks) and fxdebug.jacobian_norms, one norm per layer, checked against
torch.autograd.functional.jacobian. Run: python examples/vjp_and_jacobian_norms.py
"""
import math

import torch
import torch.nn as nn
from tabulate import tabulate

import fxdebug


class Output(nn.Module):  # a BERT-like "layer.N.output": dense, residual, LayerNorm
    def __init__(self):
        super().__init__()
        self.dense, self.norm = nn.Linear(32, 16), nn.LayerNorm(16)

    def forward(self, h, residual):
        return self.norm(self.dense(h) + residual)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.intermediate, self.output = nn.Sequential(nn.Linear(16, 32), nn.GELU()), Output()

    def forward(self, h):
        return self.output(self.intermediate(h), h)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = nn.ModuleDict({"word_embeddings": nn.Embedding(100, 16)})
        self.encoder = nn.ModuleDict({"layer": nn.ModuleList(Layer() for _ in range(4))})

    def forward(self, ids):
        h = self.embeddings["word_embeddings"](ids)
        for layer in self.encoder["layer"]:
            h = layer(h)
        return h


torch.manual_seed(0)
model, ids = Tiny().eval(), torch.randint(0, 100, (2, 7))
of, wrt = "encoder.layer.2.output", "embeddings.word_embeddings"

live = {}  # the seed's way: hooks keep live tensors, then autograd.grad between them
hooks = [model.get_submodule(k).register_forward_hook(lambda m, a, o, k=k: live.update({k: o}))
         for k in (of, wrt)]
model(ids)
for hook in hooks:
    hook.remove()
ones, v = torch.ones_like(live[of]), torch.randn_like(live[of])
for name, vector in [("ones", ones), ("random v", v)]:
    (by_hand,) = torch.autograd.grad(live[of], live[wrt], grad_outputs=vector, retain_graph=True)
    got = fxdebug.vjp(model, ids, output=of, wrt=wrt, grad_outputs=vector)  # no hooks, no live tensors
    torch.testing.assert_close(got, by_hand, rtol=1e-5, atol=1e-6)
    print(f"vjp({of} <- {wrt}, {name}): shape {tuple(got.shape)}, norm {got.norm():.3g} "
          f"(autograd.grad: {by_hand.norm():.3g})")
# ones gives ~0 here: a LayerNorm output sums to a constant, so ones^T J = 0; try a random v
assert got.norm() > 1 > 1e3 * fxdebug.vjp(model, ids, output=of, wrt=wrt).norm()

# Jacobian norms: ||d(out)/d(h_i)||_F for the output h_i of every layer of a small MLP
mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
x = torch.randn(3, 6)
samples = 256
estimate = fxdebug.jacobian_norms(mlp, x, samples=samples)
print("\n" + estimate.table())
bound = math.sqrt(1 / (2 * samples))  # stated relative standard error of the norm
rows, h = [], x
for i, layer in enumerate(mlp):
    h = layer(h).detach()
    rest = nn.Sequential(*list(mlp)[i + 1:])  # empty for the last layer: the identity
    exact = torch.autograd.functional.jacobian(rest, h).norm().item()
    relative = abs(estimate.norms[str(i)] - exact) / exact
    rows.append([str(i), f"{estimate.norms[str(i)]:.4f}", f"{exact:.4f}", f"{100 * relative:.2f}"])
    assert relative < 4 * bound, (i, relative, bound)
print("\n" + tabulate(rows, headers=["key", "fxdebug estimate", "functional.jacobian", "rel err %"],
                      disable_numparse=True, colalign=("left", "right", "right", "right")))
print(f"bound: 4 x sqrt(1/(2*{samples})) = {400 * bound:.1f}%")
assert estimate.norms["4"] == math.sqrt(12)  # d(out)/d(out) = I on 3x4: Rademacher probes are exact
print(f"ok: vjp equals autograd.grad; {len(rows)} Jacobian norms within {400 * bound:.1f}% "
      f"of functional.jacobian")
