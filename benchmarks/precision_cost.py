"""Cost of the precision what-if: seconds per candidate node, against one plain training step.

For each model (random weights) this times, with interleaved repeats (medians):

1. a plain training step: forward, the loss, ``torch.autograd.grad`` for every parameter
   (after warm-up steps; the median of three per repeat);
2. ``fxdebug.precision_sensitivity(model, x, dtypes=(one dtype,))`` divided by the number of
   candidate nodes: what each (node, dtype) pair costs, the float64 reference step, the
   float32 and autocast steps and the "every node" step shared out among them;
3. ``report.choose(budget=2, relative_to="autocast")``: its measured sets (a bisection)
   and the first node beyond the budget.

Ratios are to the plain step. Each candidate costs a training step through an
``fx.Interpreter`` plus a copy and recompile of the graph; the float64 reference step is
paid once.

Run (from the repository root)::

    python benchmarks/precision_cost.py            # resnet18 (2x3x64x64), tiny GPT-2
    python benchmarks/precision_cost.py --quick    # resnet18's last stage only, 1 repeat
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F
import torchvision
from _common import header, median, parse_args, table

import fxdebug


def resnet18(shape):
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(*shape)
    labels = torch.arange(shape[0]) % 10
    return model, (x,), lambda out: F.cross_entropy(out, labels)


def gpt2(shape):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=16, use_cache=False, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="eager")
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 100, (2, 8))
    return model, (ids,), lambda out: F.cross_entropy(out.logits.flatten(0, 1), ids.flatten())


def plain_step(model, inputs, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    started = time.perf_counter()
    torch.autograd.grad(loss(model(*inputs)), params)
    return time.perf_counter() - started


def main():
    args = parse_args(__doc__, input="2,3,64,64", repeats=3, models="resnet18,gpt2",
                      quick=("2,3,64,64", 1))
    print(header(args, "one dtype (float8_e4m3fn), tensorwise"))
    for name in args.models:
        rows = []
        factory = {"resnet18": resnet18, "gpt2": gpt2}[name]
        model, inputs, loss = factory(args.shape)
        select = ["layer4", "fc"] if (args.quick and name == "resnet18") else None
        plain, per_node, choosing, nodes = [], [], [], 0
        for _ in range(args.warmup):
            plain_step(model, inputs, loss)
        for _ in range(args.repeats):
            plain.append(median([plain_step(model, inputs, loss) for _ in range(3)]))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                started = time.perf_counter()
                report = fxdebug.precision_sensitivity(model, *inputs, loss=loss,
                                                       dtypes=("float8_e4m3fn",), select=select)
                nodes = len(report.keys)
                per_node.append((time.perf_counter() - started) / nodes)
                started = time.perf_counter()
                report.choose(budget=2, relative_to="autocast")
                choosing.append(time.perf_counter() - started)
        base = median(plain)
        for variant, times in (("plain training step", plain),
                               (f"sensitivity, per candidate node ({nodes} nodes)", per_node),
                               ("choose(budget=2x autocast)", choosing)):
            rows.append([variant, f"{1000 * median(times):.0f}", f"{1000 * min(times):.0f}",
                         f"{median(times) / base:.1f}x"])
        print(f"\n### {name}\n")
        print(table(rows, ["variant", "median ms", "min ms", "vs plain step"]))


if __name__ == "__main__":
    main()
