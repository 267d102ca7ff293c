"""The precision what-if on a model trained with FSDP2: which layers can run in float8?

A model sharded with ``fully_shard`` holds a piece of each weight per rank, and each rank
trains on its own batch: a float8 amax taken on one rank's shard, or an error measured on
one rank's batch, would not be the model's. ``fxdebug.precision_sensitivity`` called on
every rank with the sharded model and the rank's own batch builds the model unsharded on
each rank (after checking that the copy computes what the sharded model computes), runs
each candidate layer alone in float8 against a float64 run, and combines every step over
the ranks: the loss and gradients of the global batch, node errors over every rank's
values. Every rank gets the same report; ``choose()`` is a collective too.

The model reads an outlier channel (1e6 next to activations below 1) in its ``big``
layer: with one amax scale for the whole tensor, float8 cannot hold both. The report
ranks ``big`` first, for range, and the choice keeps it in high precision.

Run it with torchrun (2 processes, gloo, on the CPU)::

    torchrun --nproc_per_node 2 examples/precision_sharded.py

or as a plain script, which starts the 2 processes itself.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fxdebug


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.big = torch.nn.Linear(33, 32)
        self.c = torch.nn.Linear(32, 4)
        with torch.no_grad():
            self.big.weight[:, -1] = 0  # the outlier channel only widens the range

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.cat([h, torch.full_like(h[:, :1], 1e6)], dim=1)
        return self.c(torch.tanh(self.big(h)))


def main(rank: int) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model.a, model.big, model.c):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    g = torch.Generator().manual_seed(100 + rank)  # each rank its own batch
    x, labels = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
    report = fxdebug.precision_sensitivity(model, x, dtypes=("float8_e4m3fn",),
                                           loss=lambda out: F.cross_entropy(out, labels))
    choice = report.choose(budget=20, relative_to="autocast")  # a collective too

    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, report.to_dict())
    if rank == 0:
        print(report.table())
        print(f"\nchosen for float8: {', '.join(choice.keys)}; kept: {', '.join(choice.kept)}")
        print(f"measured loss error of the set: {choice.measured['loss']:.3g} "
              f"(budget {choice.budget:.3g})")
        print(choice.first_beyond.text() if choice.first_beyond else "")

    # ground truth, known by construction: big reads the outlier channel
    top = report.entries[0]
    assert top.key == "big" and top.cause == "range", top
    assert "big" not in choice.keys and choice.ok
    assert all(other == everyone[0] for other in everyone)  # every rank the same report
    if rank == 0:
        print(f"\nok: {top.key} ranked first ({top.cause}) on every rank; "
              f"{len(choice.keys)} of {len(report.keys)} layers can run in float8")


def spawned(rank: int, world: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(folder, "store"), world),
                            rank=rank, world_size=world)
    try:
        main(rank)
        dist.barrier()  # no rank tears gloo down while another still reads its last message
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        dist.init_process_group("gloo")
        try:
            main(dist.get_rank())
            dist.barrier()
        finally:
            dist.destroy_process_group()
    else:  # a plain script: start 2 ranks here
        with tempfile.TemporaryDirectory() as store_folder:
            mp.spawn(spawned, args=(2, store_folder), nprocs=2)
