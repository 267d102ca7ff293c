"""Seed 004: after an FX transform, `assert torch.allclose(resnet18(x), transformed(x))` says
*that* the transformed module is wrong, never *where*. fxdebug.check_equivalence names the
first node whose value differs, with its source line and error, and
fxdebug.testing.assert_equivalent puts that table in a pytest failure.
Run: python examples/first_divergent_node.py
"""
import operator

import torch
import torchvision

import fxdebug


def transform(model):
    """The seed's `transform`, with a bug: meant to reorder `out += identity` as
    `identity + out` in layer3.0, it builds `identity - out`."""
    gm = fxdebug.trace(model)  # like torch.fx.symbolic_trace, with stable keys
    for node in list(gm.graph.nodes):
        if node.meta["fxdebug_key"] == "layer3.0.iadd":
            out, identity = node.args
            with gm.graph.inserting_after(node):
                new = gm.graph.call_function(operator.sub, (identity, out))  # the bug
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
            fxdebug.passes.inherit_key(new, node)  # the new node computes what `iadd` did
    gm.recompile()
    return gm


torch.manual_seed(0)
resnet18 = torchvision.models.resnet18().eval()
transformed = transform(resnet18)
x = torch.randn(2, 3, 64, 64)

with torch.no_grad():  # the seed's check: a bare False, no location
    assert not torch.allclose(resnet18(x), transformed(x))

report = fxdebug.check_equivalence(resnet18, transformed, x)
print(report.table())
first = report.first_divergence
assert not report.ok and first.key == "layer3.0.iadd" and first.candidate_op == "operator.sub"
assert first.location.endswith("torchvision/models/resnet.py:102")  # `out += identity`
assert all(row.ok for row in report.nodes[:report.nodes.index(first)])  # everything before agrees

try:  # in a test suite
    fxdebug.testing.assert_equivalent(resnet18, transformed, x)
except AssertionError as error:
    assert "first divergence: layer3.0.iadd" in str(error)

# the same transform done right is equivalent, and an empty error table says so
fixed = fxdebug.trace(resnet18)
assert fxdebug.check_equivalence(resnet18, fixed, x).divergences == []
print(f"\nok: allclose said False; check_equivalence named {first.key} ({first.location}) "
      f"with max abs error {first.max_abs:.3g}")
