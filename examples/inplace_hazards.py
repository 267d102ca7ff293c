"""Seed 003: in-place ops that break autograd, found before backward, then removed by a pass.

By hand, "one of the variables needed for gradient computation has been modified
by an inplace operation" appears only at backward and names no line; a write
through `.data` is not reported at all and the gradients are silently wrong.
`fxdebug.lint_inplace` names the node and line of each such write before any
backward, and `passes.Functionalize` rewrites them out of place.
Run: python examples/inplace_hazards.py
"""
import copy
import inspect
import warnings

import torch
import torch.nn as nn

import fxdebug


class Seed003(nn.Module):
    """The seed's cases in one model: d[:] = 0 after a matmul, an Embedding(max_norm=1)
    whose weight is also used directly, and a sigmoid output zeroed through .data."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.tensor([[2.0], [1.0]]))
        self.w2 = nn.Parameter(torch.tensor([3.0]))
        self.embedding = nn.Embedding(3, 5, max_norm=1)
        self.W = nn.Parameter(torch.randn(7, 5))

    def forward(self, x, idx):
        d = torch.matmul(x, self.w1)
        f = torch.matmul(d, self.w2)
        d[:] = 0                                          # MmBackward of f needs d
        a = self.embedding.weight @ self.W.t()
        b = self.embedding(idx) @ self.W.t()              # renormalises the weight a used
        out = (a.unsqueeze(0) + b.unsqueeze(1)).sigmoid()
        out.data.zero_()                                  # SigmoidBackward needs out
        return f.sum() + out.sum()


def line_of(text):
    lines, first = inspect.getsourcelines(Seed003.forward)
    return first + next(i for i, line in enumerate(lines) if text in line)


torch.manual_seed(0)
model = Seed003()
x, idx = torch.tensor([1.0, 2.0]), torch.tensor([1, 2])

hazards = fxdebug.lint_inplace(model, x, idx)          # no backward runs here
print(hazards.table(), end="\n\n")
for hazard in hazards.errors:
    print(hazard)
found = {h.key: (h.source[1], h.destroys, h.saved_by) for h in hazards.errors}
assert found == {"setitem": (line_of("d[:] = 0"), "matmul", "matmul_1"),
                 "embedding": (line_of("self.embedding(idx)"), "embedding.weight", "matmul_2"),
                 "zero_": (line_of("out.data.zero_()"), "sigmoid", "sigmoid")}, found
assert all(p.grad is None for p in model.parameters())

try:  # what PyTorch says, at backward, about the first of them
    copy.deepcopy(model)(x, idx).backward()
    raise AssertionError("expected PyTorch to fail at backward")
except RuntimeError as error:
    print("\nPyTorch at backward:", str(error).split(":")[0])



class HandFixed(Seed003):
    """What a person writes for the first two (the .data write is left as it is)."""

    def forward(self, x, idx):
        d = torch.matmul(x, self.w1)
        f = torch.matmul(d, self.w2)
        d = d.clone()
        d[:] = 0
        a = self.embedding.weight.clone() @ self.W.t()
        b = self.embedding(idx) @ self.W.t()
        out = (a.unsqueeze(0) + b.unsqueeze(1)).sigmoid()
        out.data.zero_()
        return f.sum() + out.sum()


fixed = HandFixed()
fixed.load_state_dict(model.state_dict())
gm = fxdebug.trace(copy.deepcopy(model))
step = fxdebug.passes.Functionalize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    step(gm)
print("\nFunctionalize rewrote:", [key for key, _, _ in step.rewritten])
print("and left:", *step.not_rewritten)
assert [u.key for u in step.not_rewritten] == ["zero_"] and caught

gm(x, idx).backward()                                   # runs now
fixed(x, idx).backward()
for (name, p), (_, q) in zip(gm.named_parameters(), fixed.named_parameters()):
    assert torch.allclose(p.grad, q.grad), name
remaining = fxdebug.lint_inplace(gm, x, idx)
assert [h.key for h in remaining.errors] == ["zero_"], remaining.table()
print("ok: 3 hazards named with their lines before backward; after Functionalize backward runs "
      "and gradients equal the hand-fixed model; the .data write is still reported")
