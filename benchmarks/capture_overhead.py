"""Forward-pass overhead of capturing activations, fxdebug versus the usual alternatives.

For each torchvision model (random weights, eval mode, ``torch.no_grad``, CPU)
this times one forward of:

1. the eager model;
2-5. ``fxdebug.instrument(capture="modules"|"all", mode="tensor"|"stats")``;
6. forward hooks on every leaf module storing ``output.detach()`` (what
   hand-written seed code does; WRONG when a later in-place op, e.g.
   ``ReLU(inplace=True)`` after BatchNorm, overwrites the stored output);
7. the same hooks storing ``output.detach().clone()`` (correct, copies everything);
8. ``torchvision.models.feature_extraction.create_feature_extractor`` returning
   every eval node of ``get_graph_node_names``.

Everything is built once, before timing. All variants run in one process with
interleaved repeats (each repeat runs every variant once, round-robin, the
starting variant rotating so no variant always follows the same one), and the
table reports the median per variant (and the minimum, which other load on the
machine disturbs least). The hook dicts are cleared at the start of each timed
call, as fxdebug drops the previous run's Records at the start of each forward,
so memory does not grow. A correctness line per model compares the ``bn1`` value
kept by the detach-only hooks, create_feature_extractor and fxdebug with the
true ``bn1`` output. Timings on a shared machine are noisy: the header prints
the load average; compare ratios within one run only.

Run (from the repository root)::

    python benchmarks/capture_overhead.py                    # resnet18,resnet50 at 1x3x224x224
    python benchmarks/capture_overhead.py --quick            # smoke test: 1x3x64x64, 5 repeats
    python benchmarks/capture_overhead.py --models resnet50 --input 8,3,224,224 --repeats 50
    python benchmarks/capture_overhead.py --compiled --models resnet50 --input 4,3,224,224 --repeats 5

``--compiled`` times ``torch.compile(fxdebug.instrument(model, mode="stats"))`` against
``torch.compile(model)`` instead (inductor, all compiled before timing; the first compile of
resnet50 takes a minute or more on a small CPU), and counts the graphs dynamo made of each.
Beside them, a floor that no in-graph statistics can go below: ``torch.compile(model)`` with a
forward hook on every leaf module that keeps only ``output.sum()`` (dynamo compiles the hooks
into the graph): one more read of each activation, the least a summary of it costs.
"""

from __future__ import annotations

from copy import deepcopy
from functools import partial

import torch
import torchvision
from _common import (header, host_syncs, interleaved, leaf_hooks, leaf_modules, median,
                     parse_args, table)
from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

import fxdebug


def hooked(model, store, clone):
    """``model`` (a private copy) with leaf hooks, as a timed callable that resets ``store``."""
    leaf_hooks(model, store, clone)

    def run(x):
        store.clear()
        return model(x)
    return run


def bench_model(name, shape, repeats, warmup, device="cpu"):
    model = torchvision.models.get_model(name, weights=None).eval().to(device)
    x = torch.randn(shape, device=device)
    detach_store, clone_store = {}, {}
    # Every variant gets its own deep copy: hooks must not fire inside the others (which
    # would share submodules), and all variants' weights are allocated the same way.
    gms = {f"fxdebug {c}/{m}": fxdebug.instrument(deepcopy(model), capture=c, mode=m).eval()
           for c in ("modules", "all") for m in ("tensor", "stats")}
    variants = {"eager": deepcopy(model), **gms}
    variants["hooks detach (seed code)"] = hooked(deepcopy(model), detach_store, clone=False)
    variants["hooks detach+clone"] = hooked(deepcopy(model), clone_store, clone=True)
    variants["create_feature_extractor"] = create_feature_extractor(
        deepcopy(model), return_nodes=get_graph_node_names(model)[1]).eval()

    with torch.no_grad():
        times = interleaved({v: partial(fn, x) for v, fn in variants.items()},
                            repeats=repeats, warmup=warmup)
        counts = {label: len(fxdebug.records(gm)) for label, gm in gms.items()}

        # Correctness: bn1 is followed by ReLU(inplace=True), which overwrites its storage.
        truth = {}
        handle = model.bn1.register_forward_hook(lambda m, a, o: truth.update(bn1=o.clone()))
        model(x)
        handle.remove()
        variants["hooks detach (seed code)"](x)
        gm = gms["fxdebug modules/tensor"]
        gm(x)
        ok_hooks = torch.equal(detach_store["bn1"], truth["bn1"])
        ok_fx = torch.equal(fxdebug.records(gm)["bn1"], truth["bn1"])
        ok_tv = torch.equal(variants["create_feature_extractor"](x)["bn1"], truth["bn1"])

        syncs = ({v: host_syncs(partial(fn, x)) for v, fn in variants.items()}
                 if x.is_cuda else {})

    eager = median(times["eager"])
    rows = [[v, f"{median(t) * 1e3:.2f}", f"{min(t) * 1e3:.2f}",
             f"{median(t) / eager:.2f}x", counts.get(v, "")] for v, t in times.items()]
    print(f"\n### {name}\n")
    if syncs:
        print("host syncs per forward: " + ", ".join(f"{v} {n}" for v, n in syncs.items()) + "\n")
    print(table(rows, ["variant", "median ms", "min ms", "vs eager (median)",
                       "captured tensors"]))
    print(f"\nbn1 correctness: hooks output.detach() == true bn1: {ok_hooks}; "
          f"fxdebug records(gm)['bn1'] == true bn1: {ok_fx}; create_feature_extractor: {ok_tv} "
          f"(the in-place ReLU after bn1 overwrites a detached view; fxdebug copies there)")


FLOOR = "floor: leaf hooks keeping output.sum()"


def _keep_sum(sums: list, module, args, output) -> None:
    """A forward hook: keep the sum of the module's output (the floor's one read of it)."""
    sums.append(output.sum())


def bench_compiled(name, shape, repeats, warmup, device="cpu"):
    """``torch.compile`` of the model against ``torch.compile`` of its stats-mode instrumented copy,
    and the floor (leaf hooks keeping ``output.sum()``, compiled into the graph)."""
    model = torchvision.models.get_model(name, weights=None).eval().to(device)
    x = torch.randn(shape, device=device)
    gm = fxdebug.instrument(deepcopy(model), mode="stats").eval()
    graphs = {"torch.compile(model)": [], "torch.compile(fxdebug stats)": [], FLOOR: []}

    def counting(label):
        def backend(graph, example_inputs):
            graphs[label].append(graph)
            return torch._inductor.compile(graph, example_inputs)
        return backend
    floor, sums = deepcopy(model), []
    for _, module in leaf_modules(floor):  # (a module called twice keeps two sums)
        module.register_forward_hook(partial(_keep_sum, sums))
    compiled_floor = torch.compile(floor, backend=counting(FLOOR))

    def floor_run(x):
        sums.clear()
        return compiled_floor(x)
    variants = {"torch.compile(model)": torch.compile(deepcopy(model),
                                                      backend=counting("torch.compile(model)")),
                "torch.compile(fxdebug stats)": torch.compile(
                    gm, backend=counting("torch.compile(fxdebug stats)")),
                FLOOR: floor_run}
    with torch.no_grad():
        times = interleaved({v: partial(fn, x) for v, fn in variants.items()},
                            repeats=repeats, warmup=warmup)
        count = len(fxdebug.records(gm))
    base = median(times["torch.compile(model)"])
    rows = [[v, f"{median(t) * 1e3:.2f}", f"{min(t) * 1e3:.2f}", f"{median(t) / base:.2f}x",
             len(graphs[v]), count if "fxdebug" in v else len(sums) if v == FLOOR else ""]
            for v, t in times.items()]
    print(f"\n### {name}, compiled (inductor)\n")
    print(table(rows, ["variant", "median ms", "min ms", "vs torch.compile(model) (median)",
                       "dynamo graphs", "captured tensors"]))


def main():
    args = parse_args(__doc__, models="resnet18,resnet50", input="1,3,224,224", repeats=30,
                      warmup=3, extra=lambda parser: parser.add_argument(
                          "--compiled", action="store_true",
                          help="torch.compile(instrument(model, mode='stats')) against "
                               "torch.compile(model)"))
    print(header(args))
    if args.compiled:
        for name in args.models:
            bench_compiled(name, args.shape, args.repeats, args.warmup, args.device)
        return
    print("'hooks detach (seed code)' is what hand-written seed code does; it is wrong where a "
          "later in-place op overwrites the stored output (see the bn1 line).")
    for name in args.models:
        bench_model(name, args.shape, args.repeats, args.warmup, args.device)


if __name__ == "__main__":
    main()
