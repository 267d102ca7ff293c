"""Seed 004 (debugging a transformed module from its results backwards) and the NaN hunt
it often ends in: the loss is NaN and hooks with prints on every layer are the usual
search. fxdebug.find_nonfinite runs one forward and one backward node by node and names
the first node that made a NaN/Inf, whether it created or received it, and the first
non-finite gradient. Run: python examples/find_nan.py
"""
import torch
import torch.nn as nn

import fxdebug


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.eps = None  # the fix, once found: clamp before the log

    def forward(self, x):
        h = self.norm(self.fc(x)).exp() - 1
        if self.eps is not None:
            h = h.clamp_min(self.eps)
        return x + torch.log(h).tanh()  # softplus inverse: NaN for h < 0


class Net(nn.Module):
    def __init__(self, width=16, depth=4):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).mean()


torch.manual_seed(0)
model, x = Net(), torch.randn(8, 16)
print(f"loss: {model(x).item()}")  # nan: but made where?

report = fxdebug.find_nonfinite(model, x)
print(report.table())
hit = report.forward
assert hit.key == "blocks.0.log" and hit.created  # log of a negative, in the first block
assert all(v.finite for v in hit.inputs)  # what it received was finite
with torch.no_grad():  # ground truth by hand: the first block's input to log
    h = model.blocks[0].norm(model.blocks[0].fc(x)).exp() - 1
assert hit.nan == int((h < 0).sum()) and hit.inf == int((h == 0).sum())
assert "blocks.1.fc" in report.later_forward  # later blocks only received it

for block in model.blocks:  # the fix; then a NaN weight is *received* by its layer
    block.eps = 1e-6
assert fxdebug.find_nonfinite(model, x).ok
with torch.no_grad():
    model.blocks[2].fc.weight[3, 5] = float("nan")
report = fxdebug.find_nonfinite(model, x, grads=False)
print(report.table())
assert report.forward.key == "blocks.2.fc" and not report.forward.created
assert [v.name for v in report.forward.parameters if not v.finite] == ["blocks.2.fc.weight"]
print(f"\nok: NaN created at {hit.key} ({hit.location}); a NaN weight is reported as received "
      f"by {report.forward.key}")
