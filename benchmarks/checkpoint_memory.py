"""Activation memory and time of forward+backward, with and without ``passes.Checkpoint``.

Model: torchvision resnet50 (random weights, train mode, CPU); variants:

1. the eager model;
2. ``passes.Checkpoint()`` (layer1 ... layer4 checkpointed), ``preserve_rng_state=True``;
3. the same with ``preserve_rng_state=False``.

How memory is measured (CPU has no allocator statistics like
``torch.cuda.max_memory_allocated``, and the profiler's CPU memory events miss
most allocations here): a ``TorchDispatchMode`` sees the output of every ATen op
of the forward, the backward and the recomputation; it keeps a weak reference
(``StorageWeakRef``) to each new storage with its size, and after every op sums
the sizes of the storages still alive. The maximum of that sum is the peak
tensor memory of the step. Storages that existed before (parameters, buffers,
the input) are not counted, and every ``param.grad`` is allocated (zeros)
before the step so gradients accumulate in place: the figures are activations,
activation gradients and temporaries only. Memory inside a kernel that never
becomes a tensor (e.g. convolution workspaces) is not seen. "held after forward"
is the same sum right after the forward: what autograd keeps for backward.

Time: forward+backward without the dispatch mode, all variants in one process,
interleaved repeats (each repeat runs every variant once), median per variant.
Outputs and parameter gradients of each variant are checked equal to eager's.

Run (from the repository root)::

    python benchmarks/checkpoint_memory.py                  # 8x3x224x224, 5 repeats
    python benchmarks/checkpoint_memory.py --quick          # 2x3x64x64, 2 repeats
"""

from __future__ import annotations

import gc
from copy import deepcopy
from functools import partial

import torch
import torchvision
from _common import header, interleaved, median, parse_args, table
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import fxdebug


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of tensor storages created while active and still alive (see the docstring)."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
                if pointer and pointer not in self.existing and (
                        pointer not in self.live or self.live[pointer][0].expired()):
                    self.live[pointer] = (StorageWeakRef(storage), storage.nbytes())
        self.update()
        return out

    def update(self) -> int:
        for pointer in [p for p, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[pointer]
        self.current = sum(size for _, size in self.live.values())
        self.peak = max(self.peak, self.current)
        return self.current


def zero_grads(model):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)


def step(run, x):
    out = run(x)
    out.sum().backward()
    return out.detach()


def memory(model, run, x):
    """(held after forward, peak during forward+backward) in bytes."""
    zero_grads(model)
    gc.collect()
    before = [x, *model.parameters(), *model.buffers(), *(p.grad for p in model.parameters())]
    existing = {t.untyped_storage().data_ptr() for t in before}
    mode = LiveTensorBytes(existing)
    with mode:
        out = run(x)
        held = mode.update()
        out.sum().backward()
        del out
        mode.update()
    return held, mode.peak


def main():
    args = parse_args(__doc__, input="8,3,224,224", repeats=5, warmup=1, quick=("2,3,64,64", 2),
                      extra=lambda parser: parser.add_argument("--model", default="resnet50"))
    shape = args.shape
    model = torchvision.models.get_model(args.model, weights=None).train()
    x = torch.randn(shape)
    variants = {"eager": model}
    for preserve in (True, False):
        gm = fxdebug.trace(model)
        checkpoint = fxdebug.passes.Checkpoint(preserve_rng_state=preserve)
        checkpoint(gm)
        variants[f"Checkpoint(preserve_rng_state={preserve})"] = gm
    segments = ", ".join(checkpoint.segments)

    # correctness first: outputs and gradients equal eager's (BatchNorm batch statistics
    # do not depend on the RNG; running statistics are restored after recomputation)
    results = {}
    for label, run in variants.items():
        state = deepcopy(model.state_dict())
        zero_grads(model)
        torch.manual_seed(1)
        out = step(run, x)
        results[label] = (out, [p.grad.clone() for p in model.parameters()])
        model.load_state_dict(state)
    eager_out, eager_grads = results["eager"]
    equal = {label: torch.equal(out, eager_out) and all(
        torch.equal(a, b) for a, b in zip(grads, eager_grads))
        for label, (out, grads) in results.items()}

    mem = {label: memory(model, run, x) for label, run in variants.items()}

    times = interleaved({label: partial(step, run, x) for label, run in variants.items()},
                        repeats=args.repeats, warmup=args.warmup,
                        before=partial(zero_grads, model))

    eager_time = median(times["eager"])
    eager_held, eager_peak = mem["eager"]
    rows = []
    for label in variants:
        held, peak = mem[label]
        seconds = median(times[label])
        rows.append([label, f"{held / 2**20:.1f}", f"{peak / 2**20:.1f}",
                     f"{peak / eager_peak:.2f}x", f"{seconds:.2f}", f"{seconds / eager_time:.2f}x",
                     "yes" if equal[label] else "NO"])
    print(header(args, f"{args.model}, train mode", f"checkpointed: {segments}") + "\n")
    print(table(rows, ["variant", "held after forward MiB", "peak fwd+bwd MiB", "peak vs eager",
                       "median s", "time vs eager", "outputs+grads equal"]))


if __name__ == "__main__":
    main()
