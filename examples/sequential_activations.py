"""Seed 001: forward hooks on every child (recursing into nn.Sequential, whose own
hook only sees its last output) to save activations for plotting. Shows
fxdebug.instrument capturing every child's activation, per-layer mean/std in
rec.table(), checked against the seed's hooks. Run: python examples/sequential_activations.py
"""
import copy

import torch
import torch.nn as nn

import fxdebug


class myNet(nn.Module):  # seed 001, In [7]; its forward forgot `return x`
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 10, 2, stride=2)
        self.relu = nn.ReLU()
        self.flatten = lambda x: x.view(-1)
        self.fc1 = nn.Linear(160, 5)
        self.seq = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))

    def forward(self, x):
        x = self.relu(self.conv(x))
        x = self.fc1(self.flatten(x))
        x = self.seq(x)
        return x


def get_all_layers(net, hook_fn):  # seed 001: hook the children of a Sequential, not it
    for name, layer in net._modules.items():
        if isinstance(layer, nn.Sequential):
            get_all_layers(layer, hook_fn)
        else:
            layer.register_forward_hook(hook_fn)


def by_hand(net, inp):
    """The seed's visualisation dict, keyed by module name instead of module object."""
    net = copy.deepcopy(net)  # hooks on a copy: gm shares net's submodules
    names = {module: name for name, module in net.named_modules()}
    visualisation = {}
    get_all_layers(net, lambda m, i, o: visualisation.__setitem__(names[m], o.detach().clone()))
    net(inp)
    return visualisation


def compare(title, net, inp):
    gm = fxdebug.instrument(net)  # capture="modules": every module call, containers too
    gm(inp)
    rec = fxdebug.records(gm)
    print(f"== {title}\n{rec.table()}\n")
    hooked = by_hand(net, inp)
    children = [k for k in rec.keys() if not isinstance(net.get_submodule(k), nn.Sequential)]
    assert children == list(hooked), (children, list(hooked))
    for key, value in hooked.items():
        assert torch.equal(rec[key], value), key
    for key in [k for k in rec.keys() if k not in children]:  # Sequential = its last child
        assert torch.equal(rec[key], rec[f"{key}.{len(net.get_submodule(key)) - 1}"])
    stats = fxdebug.instrument(net, mode="stats")  # summary numbers only, no tensors kept
    stats(inp)
    for key, value in hooked.items():
        std, mean = torch.std_mean(value)  # std as tensor.std() means it (n - 1)
        assert abs(fxdebug.records(stats)[key].mean - mean) < 1e-6, key
        assert abs(fxdebug.records(stats)[key].std - std) < 1e-6, key


torch.manual_seed(0)
inp = torch.randn(1, 3, 8, 8)
compare("seed 001 myNet (lambda flatten, nested Sequential)", myNet(), inp)
seq = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(),
                    nn.Sequential(nn.Linear(144, 8), nn.Tanh()), nn.Linear(8, 2))
compare("nn.Sequential with a nested Sequential", seq, inp)
print("ok: every child's activation and its mean/std equal what the seed's forward hooks see")
