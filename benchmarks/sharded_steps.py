"""Cost of capturing a sharded model's activations: FSDP2 and tensor-parallel training steps.

On 2 gloo ranks (CPU, FileStore), a 4-block MLP with LayerNorm and residuals,
one training step per call (forward, ``loss.backward()``, ``zero_grad``):

* **FSDP2**: ``fully_shard`` on every block and on the root; plain, and through
  ``fxdebug.instrument`` (tensor mode, and stats mode), whose graph runs FSDP's
  all-gather / reshard hooks as nodes around each block;
* **tensor parallel**: ``ColwiseParallel`` fc1, ``RowwiseParallel`` fc2 in every
  block; plain, and instrumented (tensor mode: every capture's Record knows its
  placement on the mesh).

Interleaved repeats (every repeat runs each variant once, round-robin, the same
order on every rank), median ms per step, and the ratio to the plain step of the
same parallelism. Rank 0 prints the table.

Run (from the repository root)::

    python benchmarks/sharded_steps.py              # batch 32, width 256, 15 repeats of 5 steps
    python benchmarks/sharded_steps.py --quick      # smoke test
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _common import header, median, parse_args, table

import fxdebug

WORLD = 2


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class MLP(torch.nn.Module):
    def __init__(self, width: int, depth: int = 4) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def fsdp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def tensor_parallel(model: torch.nn.Module, mesh) -> torch.nn.Module:
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    for block in model.blocks:
        parallelize_module(block, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    return model


def step(call, params, x, count):
    def run():
        for _ in range(count):
            call(x).square().mean().backward()
            for p in params:
                p.grad = None
    return run


def _rank(rank, folder, width, batch, count, repeats, warmup, threads):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), WORLD),
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (WORLD,))
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(rank))
    variants, bases = {}, {}
    for name, shard in (("FSDP2", fsdp), ("tensor parallel", tensor_parallel)):
        torch.manual_seed(0)
        plain = shard(MLP(width), mesh)
        torch.manual_seed(0)
        instrumented = shard(MLP(width), mesh)
        gm = fxdebug.instrument(instrumented)
        base = f"{name}: plain step"
        bases[base] = base
        variants[base] = step(plain, list(plain.parameters()), x, count)
        variants[f"{name}: instrument (tensor mode)"] = step(gm, list(gm.parameters()), x, count)
        bases[f"{name}: instrument (tensor mode)"] = base
        if name == "FSDP2":
            torch.manual_seed(0)
            stats = fxdebug.instrument(shard(MLP(width), mesh), mode="stats")
            variants[f"{name}: instrument (stats mode)"] = step(stats, list(stats.parameters()),
                                                                x, count)
            bases[f"{name}: instrument (stats mode)"] = base
    names = list(variants)
    for _ in range(warmup):
        for label in names:
            variants[label]()
    found: dict[str, list[float]] = {label: [] for label in names}
    for r in range(repeats):
        shift = r % len(names)
        for label in names[shift:] + names[:shift]:
            dist.barrier()
            start = time.perf_counter()
            variants[label]()
            found[label].append((time.perf_counter() - start) / count)
    if rank == 0:
        rows = []
        for label in names:
            base = bases[label]
            rows.append([label, f"{median(found[label]) * 1e3:.3f}",
                         f"{min(found[label]) * 1e3:.3f}",
                         f"{median(found[label]) / median(found[base]):.3f}x", base])
        with open(os.path.join(folder, "table.md"), "w") as out:
            out.write(table(rows, ["variant", "median ms", "min ms", "ratio", "ratio to"]))
    dist.destroy_process_group()


def main():
    args = parse_args(__doc__, input="32,256", repeats=15, warmup=2, quick=("8,64", 3),
                      extra=lambda p: p.add_argument("--steps", type=int, default=5,
                                                     help="training steps per timed call"))
    batch, width = args.shape
    count = 2 if args.quick else args.steps
    print(header(args, f"{count} steps per timed call, {WORLD} gloo ranks"))
    threads = max(1, torch.get_num_threads() // WORLD)
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank, args=(folder, width, batch, count, args.repeats, args.warmup,
                                        threads), nprocs=WORLD, start_method="spawn")
        print(f"\n### MLP {width} wide, 4 blocks, batch {batch} ({WORLD} gloo ranks, "
              f"{threads} thread(s) each)\n")
        with open(os.path.join(folder, "table.md")) as handle:
            print(handle.read())


if __name__ == "__main__":
    main()
