"""A Conv+BN fusion pass written for plain torch.fx (symbolic_trace, batch norms folded into
the convs by hand, no fxdebug keys): check_equivalence compares each fused conv with the batch
norm whose value it now computes, not with the unfused conv of the same name. A correct pass
is EQUIVALENT and names no divergence; the same pass without the `sqrt` is named after the
first batch norm it broke, with the error forward hooks measure there.
Run: python examples/fusion_pass.py
"""
import copy

import torch
import torch.fx as fx
import torchvision

import fxdebug


def fuse_conv_bn(model, sqrt=True):
    """Fold every BatchNorm2d into the Conv2d before it; ``sqrt=False`` is the classic bug."""
    gm = fx.symbolic_trace(copy.deepcopy(model))
    modules = dict(gm.named_modules())
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not isinstance(modules[node.target], torch.nn.BatchNorm2d):
            continue
        conv_node = node.args[0]
        if conv_node.op != "call_module" or len(conv_node.users) > 1:
            continue
        conv, bn = modules[conv_node.target], modules[node.target]
        var = bn.running_var + bn.eps
        scale = bn.weight / (var.sqrt() if sqrt else var)
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        conv.weight = torch.nn.Parameter(conv.weight * scale[:, None, None, None])
        conv.bias = torch.nn.Parameter((bias - bn.running_mean) * scale + bn.bias)
        node.replace_all_uses_with(conv_node)  # fxdebug.passes.inherit_key(conv_node, node) would
        gm.graph.erase_node(node)              # say outright that the conv now computes the bn
    gm.recompile()
    return gm


torch.manual_seed(0)
model = torchvision.models.resnet18().eval()
with torch.no_grad():  # batch norms with statistics, as after training
    for module in model.modules():
        if isinstance(module, torch.nn.BatchNorm2d):
            module.running_mean.uniform_(-1, 1)
            module.running_var.uniform_(0.5, 2)
x = torch.randn(2, 3, 32, 32)

fused = fuse_conv_bn(model)
with torch.no_grad():
    assert torch.allclose(fused(x), model(x), rtol=1e-4, atol=1e-4)  # the pass is right
report = fxdebug.check_equivalence(model, fused, x, localize=True)
print("\n".join(line for line in report.table().splitlines()
                if line.startswith(("verdict", "nodes out of tolerance"))), "\n")
assert report.ok and report.first_divergence is None
assert "first divergence" not in report.table()

broken = fuse_conv_bn(model, sqrt=False)
report = fxdebug.check_equivalence(model, broken, x)
print(report.table())
first = report.first_divergence
assert (first.key, first.candidate_key) == ("bn1", "conv1")  # the fused conv, in bn1's place

seen = {}  # ground truth by hand: forward hooks on bn1 (unfused) and on conv1 (fused)


def keep(name):
    def hook(module, inputs, output):
        seen[name] = output.detach().clone()  # before the in-place ReLU after it
    return hook


model.bn1.register_forward_hook(keep("bn1"))
broken.conv1.register_forward_hook(keep("conv1"))
with torch.no_grad():
    model(x), broken(x)
error = (seen["conv1"] - seen["bn1"]).abs().max().item()
assert abs(first.max_abs - error) <= 1e-6 * error
print(f"\nok: the correct fusion is EQUIVALENT; the one without sqrt diverges at {first.key} "
      f"({first.location}), max abs {first.max_abs:.3g} as hooks measure it")
