"""Where does the tensor-parallel run stop matching the unsharded one, and on which rank?

"The loss differs between TP=1 and TP=2": the usual answer is to dump activations per
rank and match them by hand, shard by shard. fxdebug's keys are module paths, and
``parallelize_module`` keeps them: every rank saves its run with
``instrument(model, folder=...)`` (``runs/tp/rank-R``, each capture with its placement),
and ``compare_runs`` assembles the shards and compares key by key with the unsharded run.

Here rank 1's shard of ``blocks.1.fc1.weight`` is off by 0.5 in one element (a checkpoint
loaded wrongly on one rank). ``compare_runs`` names ``blocks.1.fc1`` and rank 1, from the
saved folders (one process, no process group) and from the live records (every rank).
A correct plan in bfloat16 differs from the unsharded bfloat16 run in its last bits; a
float64 reference run tells that rounding from a bug.

Run it with torchrun (2 processes, gloo, on the CPU)::

    torchrun --nproc_per_node 2 examples/tp_divergence.py

or as a plain script, which starts the 2 processes itself. It writes ``runs/`` in the
current folder (a second run adds a run to each folder; the latest is compared).
"""

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fxdebug

D = 16


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 4 * D)
        self.fc2 = torch.nn.Linear(4 * D, D)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(D, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def tensor_parallel(model, mesh):
    """Megatron-style: fc1 split by output features, fc2 by input features."""
    plan = {}
    for i in range(len(model.blocks)):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return parallelize_module(copy.deepcopy(model), mesh, plan)


def run(model, x, folder=None):
    gm = fxdebug.instrument(model, folder=folder)
    with torch.no_grad():
        gm(x)
    return fxdebug.records(gm)  # with folder=: every capture on disk, read back


def main(rank: int) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, 8, D, generator=torch.Generator().manual_seed(1))  # same on every rank

    # every rank runs and saves both: runs/unsharded/rank-R and runs/tp/rank-R
    unsharded = run(model, x, folder="runs/unsharded")
    buggy = tensor_parallel(model, mesh)
    if rank == 1:  # the bug: one element of rank 1's shard of one weight
        with torch.no_grad():
            buggy.blocks[1].fc1.weight.to_local()[0, 0] += 0.5
    tp = run(buggy, x, folder="runs/tp")

    # live records: a collective every rank calls; each rank's pieces assembled on the mesh
    live = fxdebug.compare_runs(unsharded, tp)

    # a correct plan in bfloat16, judged against a float64 run of the unsharded model
    bf16 = model.to(torch.bfloat16)
    a = run(bf16, x.to(torch.bfloat16))
    b = run(tensor_parallel(bf16, mesh), x.to(torch.bfloat16))
    reference = run(copy.deepcopy(model).double(), x.double())
    bf16_plain = fxdebug.compare_runs(a, b)
    bf16_judged = fxdebug.compare_runs(a, b, reference=reference)
    dist.barrier()  # both runs saved by every rank

    if rank == 0:
        saved = fxdebug.compare_runs("runs/unsharded", "runs/tp")  # one process, no group
        print(saved.table())
        first = saved.first_divergence
        print(f"\nfirst divergence: {first.key} on rank(s) {', '.join(map(str, first.ranks))}")
        pieces = fxdebug.load_records("runs/tp").shards(first.key)
        print("its pieces: " + ", ".join(f"rank {r} {tuple(p.shape)}" for r, p in pieces.items()))
        print(f"live records, every rank: {live.first_divergence.key} on rank(s) "
              f"{', '.join(map(str, live.first_divergence.ranks))}")
        differing = [e.key for e in bf16_plain.entries if not e.ok]
        print(f"\ncorrect plan in bfloat16, no reference: ok={bf16_plain.ok}")
        print(f"{len(differing)} keys differ, the first {differing[0]}")
        print(bf16_plain.last_bits.describe())
        print(f"with a float64 reference: ok={bf16_judged.ok}")
        print(bf16_judged.reference.describe()[-1])

    # ground truth, known by construction: rank 1 changed blocks.1.fc1's weight
    assert (live.first_divergence.key, live.first_divergence.ranks) == ("blocks.1.fc1", (1,))
    if rank == 0:
        assert (first.key, first.ranks) == ("blocks.1.fc1", (1,))
        keys = [e.key for e in saved.entries]
        assert all(e.ok for e in saved.entries[:keys.index(first.key)])
        assert bf16_judged.ok
        print(f"\nok: compare_runs names {first.key} on rank {first.ranks[0]}; "
              f"the correct bfloat16 plan is rounding")


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
