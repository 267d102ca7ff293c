"""Seed 001: editing gradients in backward with hand-written tensor hooks --
`x.register_hook(lambda g: torch.clamp(g, min=0))` inside forward ("no negative
gradient into the conv") and `fc1.bias.register_hook(lambda g: torch.zeros(...))`
("the fc bias gets no gradient"). Shows the same edits as a graph pass,
fxdebug.passes.GradTransform.clamp / .zero, with no hook in the user's code, and the
same parameter gradients bit for bit. Run: python examples/gradient_edits.py
"""
import torch
import torch.nn as nn

import fxdebug
from fxdebug.passes import GradTransform


class myNet(nn.Module):  # seed 001, In [5], without its hooks
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.flatten = lambda x: x.view(-1)
        self.fc1 = nn.Linear(160, 5)

    def forward(self, x):
        x = self.relu(self.conv(x))
        return self.fc1(self.flatten(x))


class HookedNet(myNet):  # seed 001, In [5], as written: hooks inside forward
    def forward(self, x):
        x = self.relu(self.conv(x))
        x.register_hook(lambda grad: torch.clamp(grad, min=0))
        x.register_hook(lambda grad: print("  by hand: any gradient < 0:", bool((grad < 0).any())))
        return self.fc1(self.flatten(x))


def param_grads(net):
    return {name: p.grad.clone() for name, p in net.named_parameters()}


torch.manual_seed(0)
x = torch.randn(1, 3, 8, 8)
weights = myNet().state_dict()

print("== by hand: tensor hooks in forward, a hook on the fc1 bias")
hooked = HookedNet()
hooked.load_state_dict(weights)
handle = hooked.fc1.bias.register_hook(lambda grad: torch.zeros(grad.shape))
(1 - hooked(x)).mean().backward()
handle.remove()
by_hand = param_grads(hooked)
print("  by hand: fc1.bias.grad =", by_hand["fc1.bias"])

print("== fxdebug: the same edits as a pass; the model's code is untouched")
net = myNet()
net.load_state_dict(weights)
edits = [GradTransform.clamp(min=0, include=["relu"]), GradTransform.zero(include=["fc1.bias"])]
gm = fxdebug.instrument(net, capture=[], passes=edits)
print(gm.code.strip())
(1 - gm(x)).mean().backward()
for name, grad in param_grads(net).items():
    assert torch.equal(grad, by_hand[name]), name
assert torch.equal(net.fc1.bias.grad, torch.zeros(5))

plain = myNet()
plain.load_state_dict(weights)
(1 - plain(x)).mean().backward()
plain_grads = param_grads(plain)
assert not torch.equal(plain_grads["conv.weight"], by_hand["conv.weight"]), "clamp changed nothing"

print("\n== with grads=True as well: every module output's gradient, and the parameters'")
net.zero_grad()
gm = fxdebug.instrument(net, grads=True, passes=edits)
(1 - gm(x)).mean().backward()
rec = fxdebug.records(gm)
print(rec.table())
assert rec.grads["relu"].min() >= 0, "hooks run in node order: the record sees the clamped grad"
assert rec.grads["conv"].min() >= 0, "no negative gradient reaches the conv, as the seed wanted"
unedited = fxdebug.instrument(plain, grads=True)
(1 - unedited(x)).mean().backward()
assert fxdebug.records(unedited).grads["relu"].lt(0).any(), "without the clamp there are some"
for name, grad in param_grads(net).items():
    assert torch.equal(grad, by_hand[name]), name

net.zero_grad()
gm(x)  # a forward of gm without a backward leaves nothing armed on net's parameters
(1 - net(x)).mean().backward()  # the edits live in gm's graph only: net's own backward is plain
assert torch.equal(net.fc1.bias.grad, plain_grads["fc1.bias"])
print("ok: GradTransform.clamp/zero give the hand-written hooks' parameter gradients exactly")
