"""Cost of finding NaN/Inf: fxdebug.find_nonfinite versus torch.autograd.detect_anomaly.

For each torchvision model (random weights, eval mode) this times, in one
process with interleaved repeats (each repeat runs every variant once,
round-robin; the table reports medians):

1. plain forward + backward: ``torch.autograd.grad(model(x).sum(), params)``;
2. the same under ``torch.autograd.detect_anomaly()`` (checks every backward
   function's output for NaN; records a traceback for every forward op);
3. ``fxdebug.find_nonfinite(model, x)``: one forward and one backward node by
   node, every output and every activation gradient checked, the whole call
   (tracing included); and the same on a GraphModule traced once beforehand
   (what a training loop would pass);
4. ``fxdebug.find_nonfinite(model, x, grads=False)`` against a plain
   forward (``torch.no_grad``);
5. ``fxdebug.trace(model)`` alone: the fixed cost both find_nonfinite rows
   include (it does not grow with the input size);
6. a training step (forward + ``loss.backward()``) plain and through
   ``fxdebug.watch_nonfinite`` with ``check()`` after the backward (the watch
   meant to stay on: one finiteness flag per step).

Ratios are to plain forward + backward (4: to plain forward). A last line per
model says what each tool reports when ``log`` of a batch-norm output (NaN
wherever it is negative) is inserted into ``layer2`` / ``features.4``.

Run (from the repository root)::

    python benchmarks/nonfinite_cost.py            # resnet18, mobilenet_v3_small at 2x3x128x128
    python benchmarks/nonfinite_cost.py --quick    # smoke test: 1x3x64x64, 3 repeats
    python benchmarks/nonfinite_cost.py --models resnet50 --input 8,3,224,224 --repeats 20
"""

from __future__ import annotations

import warnings
from functools import partial

import torch
import torchvision
from _common import (forward_only, header, interleaved, median, parse_args, table, training_step,
                     watched_step)

import fxdebug

_INJECT_AFTER = {"resnet18": "layer2.0.bn1", "resnet50": "layer2.0.bn1",
                 "mobilenet_v3_small": "features.4.block.0.1"}


def plain(model, params):
    def run(x):
        torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    return run


def anomaly(model, params):
    def run(x):
        with torch.autograd.detect_anomaly():
            torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    return run


def with_log(model, key):
    """``model`` traced, with ``torch.log`` applied to node ``key``'s output."""
    gm = fxdebug.trace(model)
    node = [n for n in gm.graph.nodes if n.meta.get("fxdebug_key") == key][0]
    with gm.graph.inserting_after(node):
        log = gm.graph.call_function(torch.log, (node,))
    node.replace_all_uses_with(log, delete_user_cb=lambda user: user is not log)
    gm.recompile()
    return gm


def what_each_finds(model, x, key) -> str:
    gm = with_log(model, key)
    report = fxdebug.find_nonfinite(gm, x)
    hit = report.forward
    found = f"find_nonfinite: {hit.key} ({hit.op}), created={hit.created}"
    params = [p for p in gm.parameters() if p.requires_grad]
    try:
        anomaly(gm, params)(x)
        said = "no error"
    except RuntimeError as error:
        said = str(error).splitlines()[0]
    return f"log inserted after {key}: {found}; detect_anomaly: {said}"


def bench_model(name, shape, repeats, warmup, device="cpu"):
    model = torchvision.models.get_model(name, weights=None).eval().to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(shape, device=device)
    traced = fxdebug.trace(model)
    variants = {
        "forward + backward": plain(model, params),
        "detect_anomaly forward + backward": anomaly(model, params),
        "find_nonfinite (forward + backward)": lambda x: fxdebug.find_nonfinite(model, x),
        "find_nonfinite on a traced GraphModule": lambda x: fxdebug.find_nonfinite(traced, x),
        "fxdebug.trace alone (part of both find_nonfinite rows)": lambda x: fxdebug.trace(model),
        "forward (no_grad)": forward_only(model),
        "find_nonfinite(grads=False)": lambda x: fxdebug.find_nonfinite(model, x,
                                                                        grads=False),
        "training step (loss.backward())": training_step(model),
        "watch_nonfinite step (+ check())": watched_step(model),
    }
    baseline = {"forward (no_grad)": "forward (no_grad)",
                "find_nonfinite(grads=False)": "forward (no_grad)",
                "training step (loss.backward())": "training step (loss.backward())",
                "watch_nonfinite step (+ check())": "training step (loss.backward())"}
    times = interleaved({v: partial(fn, x) for v, fn in variants.items()},
                        repeats=repeats, warmup=warmup)
    medians = {label: median(t) for label, t in times.items()}
    rows = []
    for label, seconds in medians.items():
        base = baseline.get(label, "forward + backward")
        rows.append([label, f"{seconds * 1e3:.1f}", f"{seconds / medians[base]:.2f}x", base])
    print(f"\n### {name}\n")
    print(table(rows, ["variant", "median ms", "ratio", "ratio to"]))
    print()
    print(what_each_finds(model, x, _INJECT_AFTER.get(name, "layer2.0.bn1")))


def main():
    args = parse_args(__doc__, models="resnet18,mobilenet_v3_small", input="2,3,128,128",
                      repeats=10, warmup=2, quick=("1,3,64,64", 3))
    warnings.filterwarnings("ignore", message=".*([Aa]nomaly|Error detected in).*")
    print(header(args))
    for name in args.models:
        bench_model(name, args.shape, args.repeats, args.warmup, args.device)


if __name__ == "__main__":
    main()
