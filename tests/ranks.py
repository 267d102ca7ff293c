"""Run functions on N ranks of a gloo process group on the CPU: processes started once, reused.

    results = on_ranks(worker, 2, *args)    worker(rank, world, *args) on every rank of a
                                            world of 2; each rank's return value, by rank

Starting a rank costs a fresh interpreter (torch, and DDP imports torch._dynamo), so
the ranks of each world size are started once and serve every test of the session;
``close_all()`` ends them. The group is joined through a FileStore in a temporary
folder (no TCP port to pick: tests of several checkouts run side by side), with a
60 s timeout on collectives; each process uses one thread. A worker's exception
fails the test with its traceback; a rank that does not answer within ``timeout``
fails it too. Either way every process of that world is ended, and the next call
starts fresh ones.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import tempfile
import time
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["on_ranks", "close_all"]


def _serve(rank: int, world: int, folder: str, tasks, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, fn(rank, world, *args)))
            except BaseException:  # noqa: BLE001 - the test reads the traceback
                results.put((rank, False, traceback.format_exc()))
        dist.barrier()  # every rank got its last task: none tears gloo down under another
    finally:
        dist.destroy_process_group()


class _World:
    def __init__(self, world: int) -> None:
        context = mp.get_context("spawn")
        self.world = world
        self.folder = tempfile.mkdtemp(prefix="fxdebug-ranks-")
        self.tasks = [context.Queue() for _ in range(world)]
        self.results = context.Queue()
        self.processes = [context.Process(target=_serve, daemon=True,
                                          args=(rank, world, self.folder, self.tasks[rank],
                                                self.results))
                          for rank in range(world)]
        for process in self.processes:
            process.start()

    def run(self, fn, args, timeout: float) -> list:
        for tasks in self.tasks:
            tasks.put((fn, args))
        found: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(found) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                waiting = [r for r in range(self.world) if r not in found]
                raise TimeoutError(f"{fn.__name__}: rank(s) {waiting} did not answer within "
                                   f"{timeout} s (a collective that not every rank called?)"
                                   ) from None
            found[rank] = (ok, value)
            if not ok:
                raise AssertionError(f"{fn.__name__} failed on rank {rank}:\n{value}")
        return [found[rank][1] for rank in range(self.world)]

    def close(self) -> None:
        for tasks in self.tasks:
            tasks.put(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        shutil.rmtree(self.folder, ignore_errors=True)


_WORLDS: dict[int, _World] = {}


def on_ranks(fn, world: int, *args, timeout: float = 120) -> list:
    """``[fn(0, world, *args), ..., fn(world - 1, world, *args)]``, each on its own rank."""
    ranks = _WORLDS.get(world)
    if ranks is None:
        ranks = _WORLDS[world] = _World(world)
    try:
        return ranks.run(fn, args, timeout)
    except BaseException:
        del _WORLDS[world]
        ranks.close()
        raise


def close_all() -> None:
    """End every rank started by :func:`on_ranks`."""
    while _WORLDS:
        _WORLDS.popitem()[1].close()
