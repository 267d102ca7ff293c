"""What every benchmark shares: its command line, its header line, interleaved timing, tables.

Each benchmark builds a dict ``{label: callable}`` once, then::

    args = parse_args(__doc__, models="resnet18", input="1,3,224,224", repeats=20, warmup=3,
                      quick=("1,3,64,64", 5))
    print(header(args))
    times = interleaved(variants, x, repeats=args.repeats, warmup=args.warmup)
    print(table(rows, headers))

Timing is interleaved: each repeat runs every variant once, round-robin, starting
one variant later each repeat, so no variant always follows the same one and
slow drifts of the machine (other jobs, thermal) spread over all variants.
Medians are reported (and the minimum where asked), and ratios are taken within
one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from typing import Callable, Sequence

import torch
import torchvision
from tabulate import tabulate

import fxdebug

__all__ = ["parse_args", "header", "interleaved", "paired_medians", "median", "table",
           "host_syncs", "training_step", "watched_step", "forward_only", "leaf_modules",
           "leaf_hooks"]


def parse_args(doc: str, *, input: str, repeats: int, warmup: int = 2,
               models: str | None = None, quick: tuple[str, int] = ("1,3,64,64", 5),
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The shared command line: ``--models`` (when given), ``--input``, ``--repeats``,
    ``--warmup``, ``--threads``, ``--quick``, ``--device``; ``args.shape`` is ``--input``
    as a tuple.

    ``--threads N`` calls ``torch.set_num_threads(N)``; ``--quick`` (a smoke test)
    sets the input and repeats to ``quick`` and the warm-up to 1. ``extra`` adds a
    benchmark's own options."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if models is not None:
        parser.add_argument("--models", default=models, help=f"comma-separated (default {models})")
    parser.add_argument("--input", default=input, help=f"input shape (default {input})")
    parser.add_argument("--repeats", type=int, default=repeats)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch.set_num_threads (default: torch's own choice); 1 is steadier "
                             "on a machine shared with other jobs")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke test: input {quick[0]}, {quick[1]} repeats, 1 warm-up")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: models and inputs live there, and every "
                             "timed call ends with torch.cuda.synchronize()")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if args.quick:
        args.input, args.repeats, args.warmup = quick[0], quick[1], 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device on this machine")
    try:
        args.shape = tuple(int(s) for s in args.input.split(","))
    except ValueError:
        parser.error(f"--input {args.input!r}: expected comma-separated integers, e.g. 1,3,224,224")
    if hasattr(args, "models"):
        args.models = [name.strip() for name in args.models.split(",") if name.strip()]
    torch.manual_seed(0)
    return args


def header(args: argparse.Namespace, *notes: str) -> str:
    """One line: versions, threads, input, repeats, warm-up, load average, and ``notes``."""
    parts = [f"torch {torch.__version__}", f"torchvision {torchvision.__version__}",
             f"threads {torch.get_num_threads()}", f"input {args.shape}",
             f"repeats {args.repeats} (interleaved, median)", f"warmup {args.warmup}",
             _device_name(getattr(args, "device", "cpu")),
             f"load avg {os.getloadavg()[0]:.2f}", *notes]
    return ", ".join(parts)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"GPU {torch.cuda.get_device_name(torch.device(device))}"
    return "CPU"


def _synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def host_syncs(fn: Callable[[], object]) -> int:
    """How many times one call of ``fn`` makes the host wait for the GPU.

    Counted with ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every
    synchronising CUDA call (``.item()``, ``.tolist()``, ``nonzero``, copies to the host).
    """
    _synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # (not the one-off "Synchronization debug mode is a prototype feature" notice)
    return sum("called a synchronizing" in str(w.message) for w in caught)


def interleaved(variants: dict[str, Callable[[], object]], *, repeats: int, warmup: int,
                before: Callable[[], object] | None = None) -> dict[str, list[float]]:
    """Seconds per call of every variant, ``repeats`` times each, round-robin.

    ``variants`` maps a label to a no-argument callable; ``before`` (untimed) runs
    before every call, e.g. to zero gradients. Each variant first runs ``warmup``
    times, untimed."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            if before is not None:
                before()
            variants[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            if before is not None:
                before()
            times[name].append(_timed(variants[name]))
    return times


def paired_medians(baseline: Callable[[], object], variant: Callable[[], object], *,
                   repeats: int, warmup: int) -> tuple[float, float]:
    """Median seconds per call of ``baseline`` and of ``variant``, called in alternating pairs
    (which goes first alternates too), after ``warmup`` untimed pairs."""
    for _ in range(warmup):
        baseline()
        variant()
    base: list[float] = []
    took: list[float] = []
    for r in range(repeats):
        order = ((baseline, base), (variant, took)) if r % 2 == 0 else \
            ((variant, took), (baseline, base))
        for fn, times in order:
            times.append(_timed(fn))
    return median(base), median(took)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes, a GPU's queued work included."""
    _synchronize()
    start = time.perf_counter()
    fn()
    _synchronize()
    return time.perf_counter() - start


def _sum(out) -> torch.Tensor:
    return out.sum()


def forward_only(model) -> Callable:
    """``model``'s forward under ``torch.no_grad()``, as a callable of the input."""
    def run(x):
        with torch.no_grad():
            model(x)
    return run


def leaf_modules(model) -> list[tuple[str, torch.nn.Module]]:
    """``(name, module)`` of every module of ``model`` with no children, the root left out."""
    return [(n, m) for n, m in model.named_modules() if n and next(m.children(), None) is None]


def leaf_hooks(model, store: dict, clone: bool = False) -> list:
    """A forward hook on each leaf module of ``model`` that stores ``output.detach()`` (and a
    ``.clone()`` of it with ``clone``) in ``store`` by the module's name; the handles."""
    def make(name):
        def hook(module, args, output):
            store[name] = output.detach().clone() if clone else output.detach()
        return hook
    return [m.register_forward_hook(make(n)) for n, m in leaf_modules(model)]


def training_step(model, loss: Callable = _sum) -> Callable:
    """A training step's forward + ``loss(output).backward()`` (parameter ``.grad`` set to None
    first), as a callable of the input."""
    def run(x):
        model.zero_grad(set_to_none=True)
        loss(model(x)).backward()
    return run


def watched_step(model, loss: Callable = _sum) -> Callable:
    """The same step through ``fxdebug.watch_nonfinite``, ``check()`` after the backward."""
    watch = fxdebug.watch_nonfinite(model)

    def run(x):
        model.zero_grad(set_to_none=True)
        loss(watch(x)).backward()
        if watch.check() is not None:
            raise AssertionError("watch_nonfinite reported a finite step")
    return run


def median(times: Sequence[float]) -> float:
    """The median of ``times``."""
    return statistics.median(times)


def table(rows: list[list], headers: list[str]) -> str:
    """A GitHub-markdown table, first column left-aligned, the others right-aligned."""
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                    colalign=("left",) + ("right",) * (len(headers) - 1))
