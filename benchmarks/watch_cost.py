"""Cost of ``fxdebug.watch_nonfinite`` per training step: its fixed cost, and on 2 gloo ranks.

Two measurements, each with interleaved repeats (every repeat runs each variant once,
round-robin; one call is a block of ``--steps`` training steps, the table gives ms
per step, by the wall clock and in CPU time of the process):

1. **tiny CNN, one process**: a training step (forward, cross-entropy,
   ``loss.backward()``) of a small CNN, plain and through the watch with ``check()``
   after the backward. On a step of a millisecond or two, the watch's fixed cost
   (saving the inputs, random-number state and buffers, one sum of the outputs, one
   fused norm of the gradients, one read) is what the ratio shows; the
   ``fixed cost`` row gives it in microseconds per step (median and min difference).
2. **DDP, 2 gloo ranks**: the same model in ``DistributedDataParallel`` on 2 processes
   (gloo, CPU, FileStore), plain and watched; the watch adds one all-reduce of a
   world-sized vector per step, started after the forward so that it runs during
   the backward. One row adds only that collective to a DDP step; another times a
   synchronous all-reduce of that size alone.

Run (from the repository root)::

    python benchmarks/watch_cost.py              # batch 8 at 3x32x32, 20 repeats of 20 steps
    python benchmarks/watch_cost.py --quick      # smoke test
"""

from __future__ import annotations

import datetime
import os
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
from _common import header, median, parse_args, table

import fxdebug


def tiny_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 10))


def steps(model, call, x, y, count, check=None):
    criterion = torch.nn.CrossEntropyLoss()

    def run():
        for _ in range(count):
            model.zero_grad(set_to_none=True)
            criterion(call(x), y).backward()
            if check is not None and check() is not None:
                raise AssertionError("watch_nonfinite reported a finite step")
    return run


def variants(model, shape, count):
    x = torch.randn(shape)
    y = torch.randint(0, 10, (shape[0],), generator=torch.Generator().manual_seed(0))
    watch = fxdebug.watch_nonfinite(model)
    return {"training step (loss.backward())": steps(model, model, x, y, count),
            "watch_nonfinite step (+ check())": steps(model, watch, x, y, count, watch.check)}


def timed(variants, repeats: int, warmup: int) -> dict[str, tuple[list[float], list[float]]]:
    """``{label: (wall seconds, CPU seconds)}`` per call, interleaved as ``_common.interleaved``
    does. The process's CPU time does not count the time this process waited for a core
    (other jobs on a shared machine) or for another rank, so it is the steadier of the two."""
    names = list(variants)
    for _ in range(warmup):
        for name in names:
            variants[name]()
    found: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    for r in range(repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            found[name][1].append(time.process_time() - cpu)
            found[name][0].append(time.perf_counter() - wall)
    return found


def rows_of(times, count, base, watched, extra_rows=()):
    """Rows per variant (ms per step), then the watch's fixed cost in microseconds."""
    wall = {label: median(t[0]) / count for label, t in times.items()}
    least = {label: min(t[0]) / count for label, t in times.items()}
    cpu = {label: median(t[1]) / count for label, t in times.items()}
    rows = [[label, f"{wall[label] * 1e3:.3f}", f"{least[label] * 1e3:.3f}",
             f"{cpu[label] * 1e3:.3f}", f"{wall[label] / wall[base]:.3f}x",
             f"{cpu[label] / cpu[base]:.3f}x", base] for label in times]
    fixed = {name: (clock[watched] - clock[base]) * 1e6
             for name, clock in (("wall", wall), ("min", least), ("cpu", cpu))}
    rows.append([f"watch fixed cost per step: {fixed['wall']:.0f} us (min {fixed['min']:.0f}, "
                 f"CPU {fixed['cpu']:.0f})", f"{fixed['wall'] / 1e3:.3f}",
                 f"{fixed['min'] / 1e3:.3f}", f"{fixed['cpu'] / 1e3:.3f}", "", "", ""])
    rows.extend(extra_rows)
    return rows


HEADERS = ["variant", "median ms", "min ms", "CPU ms", "ratio", "CPU ratio", "ratio to"]


def _rank(rank, world, folder, shape, count, repeats, warmup, threads):
    import torch.distributed as dist
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), world),
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    model = torch.nn.parallel.DistributedDataParallel(tiny_cnn())
    found = variants(model, shape, count)
    x = torch.randn(shape)
    y = torch.randint(0, 10, (shape[0],), generator=torch.Generator().manual_seed(0))
    vector, pending = torch.zeros(world), []

    def with_collective(x):  # what the watch adds to the collectives, and nothing else
        out = model(x)
        pending.append(dist.all_reduce(vector, async_op=True))
        return out

    def wait():
        pending.pop().wait()

    found = {"DDP step": found["training step (loss.backward())"],
             "DDP step + watch_nonfinite (flag all-reduced)": found["watch_nonfinite step (+ check())"],
             "DDP step + one async all_reduce (the collective alone)":
                 steps(model, with_collective, x, y, count, wait)}
    times = timed(found, repeats, warmup)  # the same order on every rank
    reduce_times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(count):
            dist.all_reduce(vector)
        reduce_times.append((time.perf_counter() - start) / count)
    if rank == 0:
        extra = [[f"gloo all_reduce of {world} floats (alone, synchronous)",
                  f"{statistics.median(reduce_times) * 1e3:.3f}", f"{min(reduce_times) * 1e3:.3f}",
                  "", "", "", ""]]
        with open(os.path.join(folder, "table.md"), "w") as out:
            out.write(table(rows_of(times, count, "DDP step",
                                    "DDP step + watch_nonfinite (flag all-reduced)", extra),
                            HEADERS))
    dist.destroy_process_group()


def main():
    args = parse_args(__doc__, input="8,3,32,32", repeats=20, warmup=3, quick=("8,3,32,32", 3),
                      extra=lambda p: p.add_argument("--steps", type=int, default=20,
                                                     help="training steps per timed call"))
    count = 5 if args.quick else args.steps
    print(header(args, f"{count} steps per timed call"))
    times = timed(variants(tiny_cnn(), args.shape, count), args.repeats, args.warmup)
    print("\n### tiny CNN (1 process)\n")
    print(table(rows_of(times, count, "training step (loss.backward())",
                        "watch_nonfinite step (+ check())"), HEADERS))
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as folder:
        mp.start_processes(_rank, args=(2, folder, args.shape, count, args.repeats, args.warmup,
                                        max(1, threads // 2)), nprocs=2, start_method="spawn")
        print(f"\n### DDP tiny CNN (2 gloo ranks, {max(1, threads // 2)} thread(s) each)\n")
        with open(os.path.join(folder, "table.md")) as handle:
            print(handle.read())


if __name__ == "__main__":
    main()
