"""Forward+backward overhead of recording activation gradients, fxdebug versus hand-written hooks.

For each torchvision model (random weights, ``model.eval()`` but autograd on,
CPU) this times one ``out = f(x); out.sum().backward()`` of:

1. ``plain``: the eager model;
2. ``fxdebug grads (capture=[])``: ``instrument(model, capture=[], grads=True)``,
   the gradient of every module output recorded (each call of a reused
   module separately), no activations captured;
3. ``fxdebug captures+grads``: ``instrument(model, grads=True)``;
4. ``fxdebug captures+grads stats``: the same with ``mode="stats"``;
5. ``hooks register_hook``: what hand-written code does, a forward hook on
   every leaf module calling ``output.register_hook`` to store the gradient
   in a dict (per call, so reused ReLUs are not overwritten).

Everything is built once, before timing. All variants run in one process with
interleaved repeats (each repeat runs every variant once, round-robin), and the
table reports the median per variant and its ratio to ``plain``. Parameter
gradients are set to None before every call, outside the timed region. Goal:
variant 2 within 1.15x of plain. A correctness line per model
checks that fxdebug's gradients equal the hooks' for every leaf-module call.
Timings on a shared machine are noisy: the header prints the load average;
compare ratios within one run only.

Run (from the repository root)::

    python benchmarks/grad_overhead.py                  # resnet18,resnet50 at 1x3x224x224
    python benchmarks/grad_overhead.py --quick          # smoke test: 1x3x64x64, 5 repeats
    python benchmarks/grad_overhead.py --models resnet18 --input 8,3,224,224 --repeats 50
    python benchmarks/grad_overhead.py --threads 1      # steadier on a busy shared machine
"""

from __future__ import annotations

import os
from copy import deepcopy

import torch
import torchvision
from _common import header, interleaved, median, parse_args, table

import fxdebug


def hooked(model, store):
    """A deep copy of ``model`` whose leaf modules register a gradient hook on their output.

    A copy, because the fxdebug variants call the original's submodules and
    forward hooks there would fire in them too."""
    copy = deepcopy(model)
    calls: dict[str, int] = {}

    def make(name):
        def save(grad, key):
            store[key] = grad

        def hook(module, args, output):
            count = calls[name] = calls.get(name, -1) + 1
            key = name if count == 0 else f"{name}_{count}"
            if output.requires_grad:
                output.register_hook(lambda grad: save(grad, key))
        return hook

    for n, m in copy.named_modules():
        if n and not any(True for _ in m.children()):
            m.register_forward_hook(make(n))

    def run(x):
        store.clear()
        calls.clear()
        return copy(x)
    run.module = copy
    return run


def fwd_bwd(fn, x):
    fn(x).sum().backward()


def bench_model(name, shape, repeats, warmup, device="cpu"):
    model = torchvision.models.get_model(name, weights=None).eval().to(device)
    x = torch.randn(shape, device=device)
    store: dict[str, torch.Tensor] = {}
    gms = {
        "fxdebug grads (capture=[])": fxdebug.instrument(model, capture=[], grads=True),
        "fxdebug captures+grads": fxdebug.instrument(model, grads=True),
        "fxdebug captures+grads stats": fxdebug.instrument(model, grads=True, mode="stats"),
    }
    hooks = hooked(model, store)
    variants = {"plain": model, **gms, "hooks register_hook": hooks}
    modules = [model, hooks.module]

    def clear_grads():
        for module in modules:
            module.zero_grad(set_to_none=True)

    times = interleaved({v: (lambda fn=fn: fwd_bwd(fn, x)) for v, fn in variants.items()},
                        repeats=repeats, warmup=warmup, before=clear_grads)
    counts = {label: len(fxdebug.records(gm).grads) for label, gm in gms.items()}
    counts["hooks register_hook"] = len(store)

    # Correctness: every gradient the hooks saw equals fxdebug's for the same call.
    gm = gms["fxdebug grads (capture=[])"]
    clear_grads()
    fwd_bwd(gm, x)
    clear_grads()
    fwd_bwd(hooks, x)
    grads = fxdebug.records(gm).grads
    same = sum(torch.equal(grads[key], grad) for key, grad in store.items() if key in grads)

    plain = median(times["plain"])
    rows = [[v, f"{median(t) * 1e3:.2f}", f"{median(t) / plain:.2f}x",
             counts.get(v, 0)] for v, t in times.items()]
    print(f"\n### {name}\n")
    print(table(rows, ["variant", "median ms", "vs plain", "grads recorded"]))
    print(f"\ncorrectness: {same} of {len(store)} leaf-module gradients from the hooks equal "
          f"fxdebug's (fxdebug also records the non-leaf module outputs)")


def main():
    args = parse_args(__doc__, models="resnet18,resnet50", input="1,3,224,224", repeats=20,
                      warmup=3)
    print(header(args, "eval mode with autograd on"))
    for name in args.models:
        bench_model(name, args.shape, args.repeats, args.warmup, args.device)
    print(f"\nload avg at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
