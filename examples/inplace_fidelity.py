"""Seeds 003/004: in-place writes (`d[:] = 0`), and checking an FX-traced model against
eager. Plain torch.fx.symbolic_trace turns `v += 100` on a view into `v = v + 100`, so
the traced model silently returns other numbers; fxdebug.trace keeps the write in place,
and a capture taken before the write keeps its value. Run: python examples/inplace_fidelity.py
"""
import torch
import torch.fx
import torch.nn as nn

import fxdebug


class Shift(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        v = h[:, :2]  # a view of h
        v += 100      # writes through the view into h
        return h


def first_row(t):
    return [round(v, 3) for v in t[0].tolist()]


torch.manual_seed(0)
model, x = Shift(), torch.randn(2, 4)
eager = model(x)
before = model.lin(x)  # h as it is before the in-place add

plain = torch.fx.symbolic_trace(model)
wrong = plain(x)
print("== torch.fx.symbolic_trace:", plain.code.strip(), sep="\n")
print(f"eager             h[0] = {first_row(eager)}\nfx.symbolic_trace h[0] = {first_row(wrong)}\n")
assert not torch.equal(wrong, eager), "plain fx should lose the in-place write"
assert torch.equal(wrong, before)  # it returns h as if `v += 100` never ran

gm = fxdebug.trace(model)
print("== fxdebug.trace:", gm.code.strip(), sep="\n")
assert torch.equal(gm(x), eager), "fxdebug.trace must match eager"
print(f"fxdebug.trace     h[0] = {first_row(gm(x))}  (equals eager)\n")

inst = fxdebug.instrument(model, capture=["lin", "getitem", "iadd"])
print("== fxdebug.instrument: clone = True where a later in-place op writes to the value",
      inst.code.strip(), sep="\n")
out = inst(x)
rec = fxdebug.records(inst)
print(rec.table())
assert torch.equal(out, eager)
assert torch.equal(rec["lin"], before) and rec.record("lin").copied  # kept from before `v += 100`
assert torch.equal(rec["getitem"], before[:, :2])
assert torch.equal(rec["iadd"], before[:, :2] + 100) and torch.equal(rec["iadd"], out[:, :2])
print("ok: plain fx differs from eager, fxdebug.trace matches, pre-in-place captures kept")
