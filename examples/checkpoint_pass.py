"""Seed 002: gradient checkpointing with dropout, as a graph pass checked for equal gradients.

By hand, each block gets wrapped in torch.utils.checkpoint.checkpoint through a
closure, and dropout is only reproduced in backward with preserve_rng_state=True.
`passes.Checkpoint(include=[...])` wraps the selected module calls in the graph;
this script checks that outputs and gradients equal the plain model's, and that
without the preserved RNG state the dropout masks (so the gradients) differ.
Run: python examples/checkpoint_pass.py
"""
import copy

import torch
import torch.nn as nn

import fxdebug


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.2)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.drop(self.fc2(torch.relu(self.fc1(x)))))


class Net(nn.Module):
    def __init__(self, width=64, depth=4):
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.blocks(x))


def forward_backward(model, run):
    """Output, parameter gradients and the bytes autograd saved (outside checkpoints)."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(x)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()], saved[0]


torch.manual_seed(0)
model = Net().train()
x = torch.randn(256, 64)
reference = copy.deepcopy(model)
want_out, want_grads, want_saved = forward_backward(reference, reference)

for preserve in (True, False):
    gm = fxdebug.trace(model)
    step = fxdebug.passes.Checkpoint(include=["blocks.*"], preserve_rng_state=preserve)
    step(gm)
    out, grads, saved = forward_backward(model, gm)
    same = all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    print(f"preserve_rng_state={preserve}: segments {step.segments}, output equal "
          f"{torch.equal(out, want_out)}, gradients equal {same}, saved for backward "
          f"{saved / 2**20:.2f} MiB (plain model {want_saved / 2**20:.2f} MiB)")
    assert torch.equal(out, want_out)
    assert same == preserve, "only a preserved RNG state redraws the same dropout masks"
    assert saved < want_saved / 3

print(next(line for line in gm.code.splitlines() if "checkpointed(" in line).strip())
print("ok: checkpointed blocks give the plain model's outputs and gradients (with "
      "preserve_rng_state) while autograd keeps a fraction of the activations")
