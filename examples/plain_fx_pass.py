"""Seed 004: a pass written for torch.fx.symbolic_trace works on fxdebug's graph.

The pass turns resnet's residual `operator.add` into `torch.sub` (a deliberate change
of the numbers, easy to check). fxdebug keeps `+=` in place only where that can matter;
resnet's `out += identity` writes a fresh batch-norm output nothing else reads, so it
is traced as `operator.add`, keeping its key `layer1.0.iadd`. A `+=` on a ReLU output
(autograd saved it) stays `operator.iadd`. Run: python examples/plain_fx_pass.py
"""
import operator

import torch
import torch.fx
import torchvision

import fxdebug


def residual_add_to_sub(gm):
    """Written against torch.fx.symbolic_trace, knows nothing of fxdebug."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is operator.add:
            node.target = torch.sub
    gm.recompile()
    return gm


torch.manual_seed(0)
model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64)
plain = residual_add_to_sub(torch.fx.symbolic_trace(model))
debug = residual_add_to_sub(fxdebug.trace(model))

lowered = [n.meta["fxdebug_key"] for n in debug.graph.nodes if n.meta.get("fxdebug_lowered_from")]
print(f"{len(lowered)} `+=` traced out of place: {', '.join(lowered[:3])}, ...")
with torch.no_grad():
    assert torch.equal(plain(x), debug(x))  # the pass did the same on both graphs
    assert not torch.equal(debug(x), model(x))
print("plain torch.fx pass: the same result on symbolic_trace's graph and on fxdebug's")


class ReluThenAdd(torch.nn.Module):
    def forward(self, x):
        y = torch.relu(x * 2)
        y += 1  # relu's backward needs y: this write must stay in place, as eager runs it
        return y


kept = [n.target for n in fxdebug.trace(ReluThenAdd()).graph.nodes if n.op == "call_function"]
assert kept[-1] is operator.iadd
print("ok: a plain torch.fx pass rewrote resnet18's residual adds; a `+=` whose write "
      "autograd can see stays operator.iadd")
