"""Cost of ``fxdebug.monitor`` per training step: off-steps, the step after a logged one, logged steps.

A training step (forward, ``out.sum().backward()``, ``mon.step()``, SGD ``step()``) of
a torchvision model, plain and monitored, timed step by step. Each round runs one plain
step on a copy of the model, then ``--every`` monitored steps: the first is logged, the
second measures its update, the others are off-steps. The table gives the median of
each kind of step over the rounds (ms, wall clock) and its ratio to the plain step's
median: off-steps should cost what a plain step costs (the model's own forward, one flag
test); a logged step pays the instrumented forward, the gradient hooks and one summary
(10 numbers) per output, gradient and parameter set of every module.

Run (from the repository root)::

    python benchmarks/monitor_cost.py                 # resnet50, input 2x3x64x64, 20 rounds of 5
    python benchmarks/monitor_cost.py --quick         # smoke test: resnet18, 2x3x32x32
"""

from __future__ import annotations

import copy
import time

import torch
import torchvision
from _common import header, median, parse_args, table

import fxdebug


def step(model, mon, optimizer, x):
    model(x).sum().backward()
    if mon is not None:
        mon.step()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = parse_args(__doc__, models="resnet50", input="2,3,64,64", repeats=20, warmup=1,
                      quick=("2,3,32,32", 3),
                      extra=lambda p: p.add_argument("--every", type=int, default=5))
    name = "resnet18" if args.quick else args.models[0]
    print(header(args, f"model {name}", f"every {args.every}"))
    model = getattr(torchvision.models, name)()
    plain = copy.deepcopy(model)
    x = torch.randn(*args.shape)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    kinds: dict[str, list[float]] = {"plain": [], "logged": [], "update": [], "off": []}
    with fxdebug.monitor(model, every=args.every) as mon:
        for round_ in range(args.warmup + args.repeats):
            times = [timed(lambda: step(plain, None, plain_opt, x))]
            times += [timed(lambda: step(model, mon, opt, x)) for _ in range(args.every)]
            if round_ < args.warmup:
                continue
            kinds["plain"].append(times[0])
            kinds["logged"].append(times[1])
            kinds["update"].append(times[2])
            kinds["off"].extend(times[3:])
    base = median(kinds["plain"])
    labels = {"plain": "plain step", "off": "monitored off-step",
              "update": "step after a logged one (measures the update)",
              "logged": "logged step"}
    rows = [[labels[kind], f"{1e3 * median(found):.2f}", f"{1e3 * min(found):.2f}",
             f"{median(found) / base:.3f}x"] for kind, found in kinds.items() if found]
    print(table(rows, ["step", "median ms", "min ms", "vs plain"]))


if __name__ == "__main__":
    main()
