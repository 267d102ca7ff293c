"""Cost of ``fxdebug.monitor`` per training step, eager and under ``torch.compile``.

A training step (forward, ``out.sum().backward()`` or the LM loss, ``mon.step()``, SGD
``step()``) timed step by step, per model, in one process. Each round runs, once each, a
plain step on a copy of the model and a step of fxdebug's stats mode
(``instrument(mode="stats", grads=True)``: what a logged step is compared with), a plain step
followed by what a logged step's parameter statistics must read at least, done by torch (each
parameter and gradient summed, each parameter copied into a kept buffer: the floor of that
memory traffic, no statistics), then
``--every`` monitored steps (the first logged, the second measuring its update, the others
off-steps); under ``torch.compile`` (inductor; ``--backend`` to change) a compiled plain step,
the floor (the compiled model with a forward hook on every leaf module keeping only
``output.sum()``, as ``capture_overhead.py --compiled`` measures, trained the same way) and
``--every`` steps of the monitor on the compiled model. The table gives the median of each kind
of step over the rounds (ms, wall clock) and its ratio to the plain step (compiled rows: to the
compiled plain step; the logged step also to the floor). Goals: off-step <= 1.01x plain, a
logged step <= stats mode's step, and compiled, a logged step <= 1.05x the floor, with one
graph per cadence (``dynamo graphs`` counts every graph compiled; it must not grow after the
first round). ``...only`` rows time a part inside its step: the forward and backward, or
``mon.step()``, of a logged step; torch reading the parameters, of the reading row. Below the
table, each logged step against what it must do at least: stats mode's step (compiled: the
floor) plus torch reading the parameters, a bound computed from the medians, not a step of its
own.

Models: a torchvision model (resnet50, input 2x3x64x64) and a GPT-2-small-shaped Hugging Face
``GPT2LMHeadModel`` (12 layers, 768 wide, 12 heads, random weights, a 1x64 sequence). torch.fx
cannot trace GPT-2 as a whole: fxdebug instruments it part by part, which the compiled monitor
refuses (it needs one graph), so its compiled rows say so.

Run (from the repository root)::

    python benchmarks/monitor_cost.py                  # resnet50 and GPT-2 small, 5 rounds of 5
    python benchmarks/monitor_cost.py --quick          # smoke test: resnet18 and a 2-layer GPT-2,
                                                       # eager rows only (no compile)
    python benchmarks/monitor_cost.py --models resnet50 --repeats 10
"""

from __future__ import annotations

import copy
import time
from functools import partial

import torch
import torchvision
from _common import header, leaf_modules, median, parse_args, table

import fxdebug


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _keep_sum(sums: list, module, args, output) -> None:
    """A forward hook: keep the sum of the module's output (the floor's one read of it)."""
    sums.append((output[0] if isinstance(output, tuple) else output).sum())


def _cleared(sums: list | None, step) -> None:
    """The floor's step: its sums of the step before dropped first."""
    if sums is not None:
        sums.clear()
    step()


def resnet(name: str, shape):
    model = getattr(torchvision.models, name)()
    x = torch.randn(*shape)
    return model, (x,), lambda out: out.sum()


def gpt2(layers: int, width: int, heads: int, tokens: int):
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=layers, n_embd=width, n_head=heads, vocab_size=50257,
                        n_positions=max(tokens, 64), use_cache=False)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    return model, (ids,), lambda out: out.logits.float().pow(2).mean()


def parameter_reads(model):
    """After the backward: what a logged step's parameter statistics must read at least,
    done by torch (each parameter and gradient summed once, each parameter copied into a
    buffer kept between steps): the memory traffic's floor, without any statistics."""
    kept = [torch.empty_like(p) for p in model.parameters()]

    def read():
        for p, buffer in zip(model.parameters(), kept):
            p.detach().sum()
            if p.grad is not None:
                p.grad.sum()
            buffer.copy_(p.detach())
    return read


def stepper(model, loss, inputs, mon=None, parts=None, after_backward=None):
    """One SGD training step of ``model`` (``mon.step()`` after the backward when given,
    else ``after_backward()`` when given; ``parts["pass"]``: the seconds of the forward and
    backward alone, ``parts["after"]``: of ``mon.step()`` or ``after_backward()`` alone)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-5)
    call = mon.model if mon is not None else model

    def step():
        start = time.perf_counter()
        loss(call(*inputs)).backward()
        middle = time.perf_counter()
        if mon is not None:
            mon.step()
        elif after_backward is not None:
            after_backward()
        if parts is not None:
            parts["pass"], parts["after"] = middle - start, time.perf_counter() - middle
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def counting(backend: str, graphs: list):
    """``backend`` that counts the graphs dynamo hands it."""
    from torch._dynamo.backends.registry import lookup_backend

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)
    return compile_graph


def bench(label, model, inputs, loss, args):
    every, compiled = args.every, not args.quick and args.backend != "none"
    model.train()
    plain = copy.deepcopy(model)
    stats_gm = fxdebug.instrument(copy.deepcopy(model), mode="stats", grads=True)
    monitored = copy.deepcopy(model)
    mon = fxdebug.monitor(monitored, every=every)
    reads = copy.deepcopy(model)
    parts: dict[str, dict] = {"": {}, "compiled ": {}, "reads": {}}
    singles = {"plain step": stepper(plain, loss, inputs),
               "fxdebug stats mode step": stepper(stats_gm, loss, inputs),
               "plain step + torch reading the parameters": stepper(
                   reads, loss, inputs, parts=parts["reads"],
                   after_backward=parameter_reads(reads))}
    kinds = ["logged step", "logged step: forward + backward only", "logged step: mon.step() only",
             "step after a logged one", "off-step"]
    groups = [("", mon, stepper(monitored, loss, inputs, mon, parts[""]))]
    graphs: dict[str, list] = {}
    notes = []
    if compiled:
        graphs["compiled monitor"] = []
        inner = copy.deepcopy(model)
        try:
            cmon = fxdebug.monitor(torch.compile(inner, backend=counting(
                args.backend, graphs["compiled monitor"])), every=every)
        except fxdebug.FxdebugError as exc:  # no compiled rows: nothing to compare them with
            notes.append(f"Compiled rows: none, the compiled monitor refuses this model: "
                         f"{str(exc).split(': ', 1)[1].split('. ')[0]}.")
            compiled = False
            del graphs["compiled monitor"]
    if compiled:
        for name in ("compiled plain step", "floor: leaf hooks keeping output.sum()"):
            graphs[name] = []
            copied = copy.deepcopy(model)
            sums: list | None = None
            if name.startswith("floor"):
                sums = []
                for _, module in leaf_modules(copied):
                    module.register_forward_hook(partial(_keep_sum, sums))
            step = stepper(torch.compile(copied, backend=counting(args.backend, graphs[name])),
                           loss, inputs)
            singles[name] = partial(_cleared, sums, step)
        groups.append(("compiled ", cmon, stepper(inner, loss, inputs, cmon, parts["compiled "])))
    times: dict[str, list[float]] = {name: [] for name in singles}
    times["torch reading the parameters only"] = []
    for prefix, _, _ in groups:
        times.update({prefix + kind: [] for kind in kinds})
    after_first: dict[str, int] = {}
    for round_ in range(args.warmup + args.repeats):
        order = list(singles.items())
        order = order[round_ % len(order):] + order[:round_ % len(order)]
        took = {name: timed(fn) for name, fn in order}
        took["torch reading the parameters only"] = parts["reads"]["after"]
        for prefix, mon_, step in groups:
            steps = [timed(step)]
            took[prefix + "logged step: forward + backward only"] = parts[prefix]["pass"]
            took[prefix + "logged step: mon.step() only"] = parts[prefix]["after"]
            steps += [timed(step) for _ in range(every - 1)]
            took[prefix + "logged step"] = steps[0]
            took[prefix + "step after a logged one"] = steps[1]
            took[prefix + "off-step"] = steps[2:]
        if round_ == 0:
            after_first = {name: len(found) for name, found in graphs.items()}
        if round_ < args.warmup:
            continue
        for name, value in took.items():
            times[name].extend(value if isinstance(value, list) else [value])
    for prefix, mon_, _ in groups:
        mon_.remove()
    base = median(times["plain step"])
    cbase = median(times["compiled plain step"]) if "compiled plain step" in times else None
    floor = median(times.get("floor: leaf hooks keeping output.sum()", [float("nan")]))
    rows = []
    for name, found in times.items():
        if not found:
            continue
        compiled_row = name.startswith(("compiled", "floor"))
        ref = cbase if compiled_row else base
        monitored = name.startswith("compiled ") and name != "compiled plain step"
        graph_key = "compiled monitor" if monitored else name
        made = graphs.get(graph_key)
        rows.append([name, f"{1e3 * median(found):.2f}", f"{1e3 * min(found):.2f}",
                     f"{median(found) / ref:.3f}x",
                     f"{median(found) / floor:.3f}x" if name.startswith("compiled logged") else "",
                     "" if made is None else f"{after_first[graph_key]} -> {len(made)}"])
    print(f"\n### {label}\n")
    for note in notes:
        print(note + "\n")
    print(table(rows, ["variant", "median ms", "min ms", "vs plain (compiled: vs compiled plain)",
                       "vs floor", "dynamo graphs (round 1 -> end)"]))
    # what a logged step must do at least: stats mode's work on the activations, plus the
    # parameters' floor (torch reading them, timed alone inside its step)
    parameters = median(times["torch reading the parameters only"])
    bounds = [("logged step", median(times["fxdebug stats mode step"]) + parameters,
               "stats mode step + torch reading the parameters")]
    if cbase is not None:
        bounds.append(("compiled logged step", floor + parameters,
                       "floor + torch reading the parameters"))
    for name, bound, what in bounds:
        if times.get(name):
            print(f"\n{name} / ({what}: {1e3 * bound:.2f} ms) = "
                  f"{median(times[name]) / bound:.3f}x")


def main() -> None:
    args = parse_args(__doc__, models="resnet50,gpt2", input="2,3,64,64", repeats=5, warmup=1,
                      quick=("2,3,32,32", 3),
                      extra=lambda p: (p.add_argument("--every", type=int, default=5),
                                       p.add_argument("--backend", default="inductor",
                                                      help="torch.compile backend of the "
                                                           "compiled rows; none: no compiled rows"),
                                       p.add_argument("--tokens", type=int, default=64)))
    compiled = "eager only" if args.quick or args.backend == "none" else f"compiled: {args.backend}"
    print(header(args, f"every {args.every}", compiled))
    for name in args.models:
        torch.manual_seed(0)
        if name == "gpt2":
            size = (2, 64, 4) if args.quick else (12, 768, 12)
            tokens = 16 if args.quick else args.tokens
            model, inputs, loss = gpt2(*size, tokens)
            label = f"GPT-2 {size[0]} layers x {size[1]}, {size[2]} heads, 1x{tokens} tokens"
        else:
            name = "resnet18" if args.quick else name
            model, inputs, loss = resnet(name, args.shape)
            label = f"{name}, input {'x'.join(map(str, args.shape))}"
        bench(label, model, inputs, loss, args)


if __name__ == "__main__":
    main()
