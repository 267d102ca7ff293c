"""Seed 002: three hand-written ways to read the gradient of an intermediate tensor --
`y.retain_grad()`, `torch.autograd.grad(t, y)`, `y.register_hook(save)` -- each
needing the tensor in hand inside forward, plus `param.grad` for the weights.
Shows `fxdebug.instrument(model, grads=True)` + `records(gm).grads[key]` giving
every intermediate gradient by key, on a small model and on resnet18 (64x64),
equal to retain_grad. Run: python examples/intermediate_gradients.py
"""
import copy

import torch
import torch.nn as nn
import torchvision

import fxdebug


class Small(nn.Module):  # seed 002's y = x * 2; z = y ** 2, after a layer
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x) * 2
        return y ** 2


def by_hand(model, x):
    """The seed's three ways, which need forward rewritten to get hold of y. One forward
    each: y.retain_grad() would also add up the gradient that autograd.grad sends through y."""
    def forward():
        y = model.lin(x) * 2
        return y, (y ** 2).mean()

    y, t = forward()
    y.retain_grad()                                         # 1. retain_grad
    t.backward()
    retained, (y, t), saved = y.grad, forward(), {}
    (autograd,) = torch.autograd.grad(t, y)                 # 2. autograd.grad
    y, t = forward()
    y.register_hook(lambda grad: saved.update(hook=grad))   # 3. register_hook (the seed lost
    t.backward()                                            #    it to a `global global_feat` typo)
    model.zero_grad()
    return retained, autograd, saved["hook"]


def retain_grad_truth(model, x):
    """retain_grad() on every module output through forward hooks; n-th call of a module: _n."""
    outputs, calls = {}, {}

    def hook(module, args, output, name):
        count = calls[name] = calls.get(name, -1) + 1
        output.retain_grad()
        outputs[name if count == 0 else f"{name}_{count}"] = output

    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(lambda m, a, o, name=name: hook(m, a, o, name))
    model(x).sum().backward()
    return {key: tensor.grad for key, tensor in outputs.items()}


torch.manual_seed(0)  # ---- the small model: the seed's three ways against fxdebug
small, x = Small(), torch.randn(3, 4)
retained, autograd, hooked = by_hand(small, x)
gm = fxdebug.instrument(small, capture="all", grads=True)
gm(x).mean().backward()
rec = fxdebug.records(gm)
print("== Small, capture='all', grads=True\n" + rec.table())
for name, value in [("retain_grad", retained), ("autograd.grad", autograd), ("hook", hooked)]:
    assert torch.equal(rec.grads["mul"], value), name

model, x = torchvision.models.resnet18().eval(), torch.randn(2, 3, 64, 64)  # ---- resnet18
# ReLU(inplace=True) overwrites bn outputs, so retain_grad there would report the ReLU output's grad
reference = copy.deepcopy(model)
for module in reference.modules():
    if hasattr(module, "inplace"):
        module.inplace = False
truth = retain_grad_truth(reference, x)
gm = fxdebug.instrument(model, grads=True)  # the original model, in-place ReLUs and all
gm(x).sum().backward()
rec = fxdebug.records(gm)
assert sorted(rec.grads.keys()) == sorted(truth), "one gradient per module call"
for key, expected in truth.items():
    torch.testing.assert_close(rec.grads[key], expected, rtol=1e-5, atol=1e-6, msg=key)
table = rec.table().splitlines()  # its first rows, and the parameter rows of fc:
print("\n== resnet18", *table[:6], *[r for r in table if r.startswith(("param", "fc."))], sep="\n")
fc_row = next(line for line in table if line.startswith("fc.weight")).split()
assert fc_row[2] == format(model.fc.weight.grad.norm().item(), ".4g")  # seed 002: param.grad
print(f"ok: {len(truth)} resnet18 activation gradients (and Small's) equal retain_grad")
