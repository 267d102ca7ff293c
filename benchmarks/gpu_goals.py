"""The GPU goals in one table per model: every fxdebug tool against the simple tool beside it.

On a GPU a forward at training batch sizes waits for the Python that launches
its ops, so these ratios are set by host time per capture. For each model
(random weights, ``eval()`` so dropout and batch statistics do not move between
variants, autograd on where a row needs it) every variant below runs in one
process, timed in pairs with its baseline (the two alternate, and which goes
first alternates too), built just before its pairs and dropped after them (no
other variant's memory is held meanwhile); the table gives both medians, their
ratio and the goal:

==========================================  ==========================  ==========================
variant                                     baseline                    goal
==========================================  ==========================  ==========================
hooks: output.detach() (forward hooks)      eager forward               (the simple tool)
tensor mode: ``instrument(m)``              eager forward               <= 1.05x
stats mode: ``instrument(m, mode="stats")`` eager forward               <= 1.10x
stats mode, CUDA graph (GPU only)           eager forward, CUDA graph   <= 1.03x
register_hook on every module output        forward + backward          (the simple tool)
``grads=True`` (``capture=[]``)             forward + backward          <= register_hook's ratio
detect_anomaly                              forward + backward          (the simple tool)
``find_nonfinite(model, x)``                forward + backward          <= detect_anomaly's ratio
``find_nonfinite`` on a traced GraphModule  forward + backward          (no goal: the loop's way)
``watch_nonfinite`` step + ``check()``      forward + backward          <= 1.05x
==========================================  ==========================  ==========================

The models: ``resnet50`` (torchvision, input ``--input``, default 4x3x224x224)
and ``gpt2``, a GPT-2-small-sized decoder written here (12 layers, width 768,
12 heads, vocabulary 50257, causal ``scaled_dot_product_attention``; tokens
``--tokens``, default 8x512). The goals are for a GPU; on the CPU the table
shows the same rows (``--quick``: small inputs and a 2-layer, width-128 gpt2).
A row that cannot run (a CUDA graph capture that fails, say) prints why and
the others still run.

Run (from the repository root)::

    python benchmarks/gpu_goals.py --device cuda             # resnet50 and gpt2, full size
    python benchmarks/gpu_goals.py --quick                   # smoke test on the CPU
    python benchmarks/gpu_goals.py --models gpt2 --tokens 4,1024 --device cuda
"""

from __future__ import annotations

import gc
import math
import warnings
from copy import deepcopy
from functools import partial

import torch
import torch.nn.functional as F
import torchvision
from _common import (forward_only, header, leaf_hooks, leaf_modules, paired_medians, parse_args,
                     table, training_step, watched_step)
from torch import nn

import fxdebug


class _Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.c_attn(x).split(width, dim=2)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(batch, tokens, width))


class _Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = _Attention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: token and position embeddings, pre-norm blocks, a tied-size head."""

    def __init__(self, layers=12, width=768, heads=12, vocabulary=50257, context=1024):
        super().__init__()
        self.wte = nn.Embedding(vocabulary, width)
        self.wpe = nn.Embedding(context, width)
        self.h = nn.ModuleList(_Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocabulary, bias=False)

    def forward(self, idx):
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build(name: str, args) -> tuple[nn.Module, torch.Tensor]:
    """The model (eval mode, on the device) and its input."""
    torch.manual_seed(0)
    if name == "gpt2":
        config = dict(layers=2, width=128, heads=4, vocabulary=1000) if args.quick else {}
        model = GPT(**config)
        batch, tokens = (2, 64) if args.quick else args.token_shape
        x = torch.randint(0, model.wte.num_embeddings, (batch, tokens))
    else:
        model = torchvision.models.get_model(name, weights=None)
        x = torch.randn(args.shape)
    return model.eval().to(args.device), x.to(args.device)


def forward_hooks(model, store):
    """A copy of ``model`` whose leaf modules store ``output.detach()`` (a forward hook each)."""
    copy = deepcopy(model)
    leaf_hooks(copy, store)
    return copy


def gradient_hooks(model, store):
    """A copy of ``model`` whose leaf modules hook their output's gradient (register_hook)."""
    copy = deepcopy(model)

    def hook(module, args, out, name):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: store.__setitem__(name, grad))
    for name, module in leaf_modules(copy):
        module.register_forward_hook(partial(hook, name=name))
    return copy


def loss_of(out):
    return out.float().sum()


def anomaly(model):
    def run(x):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled"
            with torch.autograd.detect_anomaly(check_nan=True):
                training_step(model, loss_of)(x)
    return run


def cuda_graph(fn, x):
    """``fn(x)`` captured as a CUDA graph on a static copy of ``x`` (warmed up on a side stream,
    as any module before a capture); the returned callable replays it."""
    static = x.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            fn(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        fn(static)
    return lambda _x: graph.replay()


# label: (baseline, goal): a number (the ratio's ceiling) or the label of the simple tool
# whose ratio is the ceiling; None: no goal
ROWS = {
    "eager forward": ("eager forward", None),
    "hooks: output.detach()": ("eager forward", None),
    "tensor mode": ("eager forward", 1.05),
    "stats mode": ("eager forward", 1.10),
    "eager forward, CUDA graph": ("eager forward, CUDA graph", None),
    "stats mode, CUDA graph": ("eager forward, CUDA graph", 1.03),
    "forward + backward": ("forward + backward", None),
    "register_hook on every module output": ("forward + backward", None),
    "grads=True (capture=[])": ("forward + backward", "register_hook on every module output"),
    "detect_anomaly": ("forward + backward", None),
    "find_nonfinite(model, x)": ("forward + backward", "detect_anomaly"),
    "find_nonfinite on a traced GraphModule": ("forward + backward", None),
    "watch_nonfinite step + check()": ("forward + backward", 1.05),
}


def bench(name: str, args) -> None:
    """Each row timed in pairs with its baseline; each variant built just before its pairs and
    dropped after them, so no other variant's memory (a tensor-mode run's captures, say) is
    held meanwhile."""
    model, x = build(name, args)
    store: dict = {}
    traced = fxdebug.trace(model)
    factories = {
        "eager forward": lambda: forward_only(model),
        "hooks: output.detach()": lambda: forward_only(forward_hooks(model, store)),
        "tensor mode": lambda: forward_only(fxdebug.instrument(deepcopy(model))),
        "stats mode": lambda: forward_only(fxdebug.instrument(deepcopy(model), mode="stats")),
        "eager forward, CUDA graph": lambda: cuda_graph(model, x),
        "stats mode, CUDA graph": lambda: cuda_graph(
            fxdebug.instrument(deepcopy(model), mode="stats"), x),
        "forward + backward": lambda: training_step(model, loss_of),
        "register_hook on every module output":
            lambda: training_step(gradient_hooks(model, store), loss_of),
        "grads=True (capture=[])": lambda: training_step(
            fxdebug.instrument(deepcopy(model), capture=[], grads=True), loss_of),
        "detect_anomaly": lambda: anomaly(model),
        "find_nonfinite(model, x)": lambda: lambda x: fxdebug.find_nonfinite(model, x,
                                                                             loss=loss_of),
        "find_nonfinite on a traced GraphModule":
            lambda: lambda x: fxdebug.find_nonfinite(traced, x, loss=loss_of),
        "watch_nonfinite step + check()": lambda: watched_step(model, loss_of),
    }
    ratios: dict[str, float] = {}
    rows = []
    for label, (baseline, goal) in ROWS.items():
        if "CUDA graph" in label and not x.is_cuda:
            continue
        try:
            base_fn = factories[baseline]()
            fn = base_fn if label == baseline else factories[label]()
            base, took = paired_medians(partial(base_fn, x), partial(fn, x),
                                        repeats=args.repeats, warmup=args.warmup)
        except Exception as error:  # noqa: BLE001 - the row says why; the others still run
            rows.append([label, "-", "-", baseline, "",
                         f"not measured: {type(error).__name__}: {str(error).splitlines()[0][:150]}"])
            continue
        finally:
            store.clear()
            base_fn = fn = None
            gc.collect()
        ratios[label] = took / base
        ceiling = ratios.get(goal) if isinstance(goal, str) else goal
        verdict = "" if ceiling is None or not math.isfinite(ceiling) else (
            f"{'met' if ratios[label] <= ceiling else 'MISSED'} (<= {ceiling:.2f}x)")
        rows.append([label, f"{took * 1e3:.2f}", f"{base * 1e3:.2f}", f"{ratios[label]:.3f}x",
                     baseline, goal if isinstance(goal, str) else "", verdict])
    size = tuple(x.shape)
    print(f"\n### {name}, input {size} ({x.dtype}), {len(leaf_modules(model))} leaf modules\n")
    print(table(rows, ["variant", "median ms", "baseline ms", "ratio", "ratio to", "goal from",
                       "goal"]))


def main():
    def extra(parser):
        parser.add_argument("--tokens", default="8,512",
                            help="gpt2's input, batch,tokens (default 8,512)")
    args = parse_args(__doc__, models="resnet50,gpt2", input="4,3,224,224", repeats=10,
                      warmup=2, quick=("1,3,64,64", 3), extra=extra)
    args.token_shape = tuple(int(s) for s in args.tokens.split(","))
    line = header(args, *(["goals are for a GPU"] if args.device == "cpu" else []))
    print(line.replace("(interleaved, median)", "(each row paired with its baseline, median)"))
    for name in args.models:
        bench(name, args)


if __name__ == "__main__":
    main()
