"""Which rank went out of sync, and at which layer? ``compare_ranks`` on a DDP model.

DistributedDataParallel broadcasts rank 0's weights when it wraps the model, then
only averages gradients. A write to one rank's weights after that (a checkpoint
loaded on one node only, an edit under ``if rank == ...``) is never undone: the
ranks train different models from then on, and nothing fails. Here rank 1 scales
its ``block.conv`` weight once, at step 2. ``fxdebug.compare_ranks`` (a collective)
compares small fingerprints of every parameter, buffer and gradient, then of every
activation for one probe batch fed to every rank, and names the key and the rank.

Run it with torchrun (2 processes, gloo, on the CPU)::

    torchrun --nproc_per_node 2 examples/ddp_desync.py

or as a plain script, which starts the 2 processes itself.
"""

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fxdebug


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.block = torch.nn.Sequential()
        self.block.add_module("conv", torch.nn.Conv2d(8, 8, 3, padding=1))
        self.block.add_module("bn", torch.nn.BatchNorm2d(8))
        self.block.add_module("relu", torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = self.block(torch.relu(self.stem(x)))
        return self.head(h.mean((2, 3)))


def differing(model: torch.nn.Module) -> list[str]:
    """Ground truth, computed another way: gather every parameter itself and compare."""
    found = []
    for name, param in model.named_parameters():
        gathered = [torch.empty_like(param) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, param.detach().contiguous())
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            found.append(name)
    return found


def main(rank: int) -> None:
    torch.manual_seed(0)
    net = Net()
    model = torch.nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 4):
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(10 * step + rank))
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if step == 2 and rank == 1:  # the bug: one rank edits its own weights
            with torch.no_grad():
                net.block.conv.weight.mul_(1.001)

    weights = fxdebug.compare_ranks(model)  # every rank calls it; all get the same report
    gm = fxdebug.instrument(model)  # activations: one probe batch, the same on every rank
    with torch.no_grad():
        gm(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(123)))
    activations = fxdebug.compare_ranks(fxdebug.records(gm))
    truth = differing(net)
    if rank == 0:
        print(weights.table())
        print()
        print(activations.table())
    assert truth == ["block.conv.weight"]
    assert weights.first_divergence.key == "block.conv.weight"
    assert weights.first_divergence.ranks == (1,)
    # each rank's BatchNorm statistics of its own batch: DDP copies rank 0's at every forward
    assert [e.key for e in weights.entries if e.status == "resynced"] == [
        "block.bn.running_mean", "block.bn.running_var"]
    assert activations.first_divergence.key == "module.block.conv"
    assert activations.first_divergence.ranks == (1,)
    if rank == 0:
        print(f"ok: rank {weights.first_divergence.ranks[0]} is out of sync at "
              f"{weights.first_divergence.key}; the first activation that differs is "
              f"{activations.first_divergence.key}")


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
