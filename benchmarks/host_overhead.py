"""Host time per capture: what each capture adds on a deep, narrow model, against plain hooks.

On a GPU a forward at training batch sizes waits for the Python that launches its
ops, so what a capture costs is host time. This benchmark measures it on the CPU,
where it shows the same way: a model of ``--layers`` modules (``Linear(16, 16)``
and ``ReLU`` alternating), batch 1, one thread, so each op's arithmetic is
negligible and every microsecond added is Python and dispatch.

Each variant is timed in pairs with the plain call it adds to (an eager forward,
or an eager forward and backward, or a training step), the two interleaved, and
the median of the differences taken: absolute times move between runs on a shared
machine, the differences and their ratios much less. ``µs per capture`` is that
median over the number of captures one call makes (records, or hooked modules),
and ``vs`` compares it with the simple tool beside it, in the same run:

=========================  ===============================================  ======================
variant                    one call                                         compared with
=========================  ===============================================  ======================
hook: output.detach()      forward hook on every module storing a view      (the yardstick)
hook: 4 stats as torch ops forward hook storing mean, std, min, max         hook: output.detach()
tensor mode                ``instrument(m)`` forward                        hook: output.detach()
stats mode                 ``instrument(m, mode="stats")`` forward          hook: output.detach()
capture="all"              ``instrument(m, capture="all")`` forward         hook: output.detach()
register_hook              forward + backward, a hook on every output's     (the yardstick)
                           gradient
grads=True                 ``instrument(m, grads=True)`` forward + backward register_hook
grads=True, stats mode     the same with ``mode="stats"``                   register_hook
detect_anomaly             forward + backward under ``detect_anomaly``      (per module)
find_nonfinite             ``find_nonfinite(m, x)`` forward + backward      detect_anomaly
watch_nonfinite            a training step through the watch + ``check()``  the training step
watch_nonfinite, SGD       the same, then ``torch.optim.SGD(lr=0).step()``  the step with SGD too
torch.compile, stats mode  ``--compiled N``: a model of N modules, its     hook: output.detach()
                           stats-mode copy compiled, against
                           ``torch.compile(model)``
=========================  ===============================================  ======================

Run (from the repository root)::

    python benchmarks/host_overhead.py              # 400 modules, 200 pairs per variant
    python benchmarks/host_overhead.py --quick      # smoke test
    python benchmarks/host_overhead.py --device cuda   # the same on a GPU (each call synchronized)
    python benchmarks/host_overhead.py --compiled 100  # and stats mode under torch.compile
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings
import statistics
import time
from typing import Callable

import torch
from _common import table

import fxdebug


def deep_narrow(layers: int) -> torch.nn.Sequential:
    """``layers`` modules: ``Linear(16, 16)`` and ``ReLU`` alternating."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) if i % 2 == 0 else torch.nn.ReLU()
                                 for i in range(layers)])


def paired(plain: Callable[[], object], variant: Callable[[], object], pairs: int,
           warmup: int, sync: Callable[[], object] = lambda: None
           ) -> tuple[float, float, float]:
    """``(median plain s, median variant s, median of the per-pair differences s)``; ``sync``
    waits for the device after each call (a GPU runs what the host launched meanwhile)."""
    for _ in range(warmup):
        plain()
        variant()
    sync()
    plains, variants, diffs = [], [], []
    for i in range(pairs):
        order = (plain, variant) if i % 2 == 0 else (variant, plain)
        took = {}
        for fn in order:
            start = time.perf_counter()
            fn()
            sync()
            took[fn] = time.perf_counter() - start
        plains.append(took[plain])
        variants.append(took[variant])
        diffs.append(took[variant] - took[plain])
    return statistics.median(plains), statistics.median(variants), statistics.median(diffs)


def _forward_hooks(model, hook):
    return [m.register_forward_hook(hook(name)) for name, m in model.named_modules() if name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke test: 40 modules, 10 pairs")
    parser.add_argument("--device", default="cpu",
                        help="cuda: the same model on the GPU, each call synchronized")
    parser.add_argument("--compiled", type=int, default=0, metavar="LAYERS",
                        help="also stats mode under torch.compile (inductor) against "
                             "torch.compile(model), on a model of LAYERS modules (its first "
                             "compile takes about a minute per 100 modules on a small CPU)")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.pairs, args.warmup = 40, 10, 2
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = deep_narrow(args.layers).to(device)
    x = torch.randn(1, 16, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    modules = args.layers
    store: dict = {}

    def forward():
        return model(x)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    # forward hooks, the yardsticks
    def detach_hook(name):
        def hook(module, inputs, output):
            store[name] = output.detach()
        return hook

    def stats_hook(name):
        def hook(module, inputs, output):
            v = output.detach()
            store[name] = (v.mean(), v.std(), v.min(), v.max())
        return hook

    def grad_hook(name):
        def hook(module, inputs, output):
            if output.requires_grad:
                output.register_hook(lambda g: store.__setitem__(name, g))
        return hook

    rows = []

    def row(label, plain, variant, captures, yardstick=None, ratio_to=""):
        base, took, added = paired(plain, variant, args.pairs, args.warmup, sync)
        per = added / captures * 1e6 if captures else float("nan")
        rows.append([label, captures, f"{took * 1e3:.3f}", f"{base * 1e3:.3f}",
                     f"{added * 1e6:.0f}", f"{per:.2f}",
                     f"{per / yardstick:.2f}x" if yardstick else f"{took / base:.3f}x",
                     f"{ratio_to} (per capture)" if yardstick else (ratio_to or "plain call")])
        return per

    def with_hooks(hook, backward=False):
        hooked = copy.deepcopy(model)  # the plain call keeps a model without hooks
        _forward_hooks(hooked, hook)

        def run():
            store.clear()
            if backward:
                hooked.zero_grad(set_to_none=True)
                hooked(x).sum().backward()
            else:
                hooked(x)
        return run

    detach = row("hook: output.detach()", forward, with_hooks(detach_hook), modules)
    row("hook: 4 stats as torch ops", forward, with_hooks(stats_hook), modules, detach,
        "hook: output.detach()")

    for label, kwargs in (("tensor mode", {}), ("stats mode", {"mode": "stats"}),
                          ('capture="all"', {"capture": "all"})):
        gm = fxdebug.instrument(model, **kwargs)
        gm(x)
        count = len(fxdebug.records(gm))
        row(label, forward, lambda gm=gm: gm(x), count, detach, "hook: output.detach()")

    registered = row("register_hook (fwd + bwd)", forward_backward,
                     with_hooks(grad_hook, backward=True), modules)
    for label, mode in (("grads=True (fwd + bwd)", "tensor"),
                        ('grads=True, mode="stats" (fwd + bwd)', "stats")):
        gm = fxdebug.instrument(model, grads=True, mode=mode)

        def grads_step(gm=gm):
            gm.zero_grad(set_to_none=True)
            gm(x).sum().backward()
        grads_step()
        count = len(fxdebug.records(gm).grads)
        row(label, forward_backward, grads_step, count, registered, "register_hook")

    def anomaly():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
            with torch.autograd.detect_anomaly(check_nan=True):
                forward_backward()
    anomaly_per = row("detect_anomaly (fwd + bwd)", forward_backward, anomaly, modules)
    row("find_nonfinite (fwd + bwd)", forward_backward,
        lambda: fxdebug.find_nonfinite(model, x), modules, anomaly_per, "detect_anomaly")

    watch = fxdebug.watch_nonfinite(model)

    def watched_step():
        model.zero_grad(set_to_none=True)
        watch(x).sum().backward()
        if watch.check() is not None:
            raise AssertionError("watch_nonfinite reported a finite step")
    row("watch_nonfinite step", forward_backward, watched_step, modules, None, "training step")

    # the same with the optimizer's step in both (lr 0: the same work, the model unchanged): the
    # watch's first read of each fresh .grad makes the Python tensor the optimizer then reuses
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)

    def sgd_step():
        forward_backward()
        optimizer.step()

    def watched_sgd_step():
        watched_step()
        optimizer.step()
    row("watch_nonfinite step, SGD step()", sgd_step, watched_sgd_step, modules, None,
        "training step with SGD step()")

    if args.compiled:  # each capture's statistics inside the compiled graph
        small = deep_narrow(args.compiled).to(device)
        with torch.no_grad():
            compiled_model = torch.compile(copy.deepcopy(small))
            compiled_stats = torch.compile(fxdebug.instrument(copy.deepcopy(small), mode="stats"))
            compiled_model(x)
            compiled_stats(x)
            count = len(fxdebug.records(compiled_stats))
            row("torch.compile, stats mode", lambda: compiled_model(x), lambda: compiled_stats(x),
                count, detach, "hook: output.detach()")

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"torch {torch.__version__}, {where}, threads {torch.get_num_threads()}, "
          f"{args.layers} modules (Linear(16, 16) / ReLU), batch 1, {args.pairs} pairs "
          f"(interleaved, median of differences), load avg {os.getloadavg()[0]:.2f}")
    print()
    print(table(rows, ["variant", "captures", "median ms", "plain ms", "added µs",
                       "µs per capture", "ratio", "ratio to"]))


if __name__ == "__main__":
    main()
