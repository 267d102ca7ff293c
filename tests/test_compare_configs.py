"""compare_runs across parallelism configurations on 4 gloo ranks: unsharded, TP=2, FSDP2, DDP
and FSDP x TP on a 2-D mesh, as saved folders and as live Records on every rank.

Every configuration runs the same weights on the same input on every rank, so each must
equal the unsharded run within float32 tolerance. Ground truth for the planted bug is
computed another way: the perturbed weight itself, gathered (``DTensor.full_tensor()``)
and compared with the unsharded model's, says which output features of ``blocks.1.fc1``
change and so which ranks' tensor-parallel pieces hold them.
"""

from __future__ import annotations

import copy

import torch

import fxdebug
from ranks import on_ranks
from tp_models import D, Net

CONFIGS = ("tp", "fsdp", "ddp", "fsdp_tp", "fsdp_tp_bug")
BUG_RANK = 3


def full_input() -> torch.Tensor:
    return torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))


def _tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.fc2"] = RowwiseParallel()
    return plan


def _configured(kind: str, model: Net, mesh_2d, mesh_1d):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    if kind in ("tp", "fsdp_tp", "fsdp_tp_bug"):
        parallelize_module(model, mesh_2d["tp"], _tp_plan())
    if kind in ("fsdp_tp", "fsdp_tp_bug"):
        for block in model.blocks:
            fully_shard(block, mesh=mesh_2d["dp"])
        fully_shard(model, mesh=mesh_2d["dp"])
    if kind == "fsdp":
        for block in model.blocks:
            fully_shard(block, mesh=mesh_1d)
        fully_shard(model, mesh=mesh_1d)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    return model


def _summary(report) -> tuple:
    first = report.first_divergence
    return (report.ok, [(e.key, e.status) for e in report.entries],
            None if first is None else (first.key, first.ranks))


def _all_configs(rank, world, folder):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh_1d = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    x = full_input()  # every rank the same batch: every configuration computes the same values
    torch.manual_seed(0)
    original = Net()
    gm = fxdebug.instrument(copy.deepcopy(original), folder=f"{folder}/unsharded")
    gm(x)
    fxdebug.records(gm)
    unsharded = fxdebug.records(gm)
    live, truth = {}, None
    for kind in CONFIGS:
        model = _configured(kind, copy.deepcopy(original), mesh_2d, mesh_1d)
        if kind == "fsdp_tp_bug":
            weight = model.blocks[1].fc1.weight
            with torch.no_grad():
                if rank == BUG_RANK:  # this rank's FSDP shard of its TP shard
                    weight.to_local()[0, 0] += 0.5
            changed = weight.full_tensor() != original.blocks[1].fc1.weight  # a collective
            tp_piece = changed.chunk(2, dim=0)[mesh_2d.get_coordinate()[1]]  # ColwiseParallel
            holds = [None] * world
            dist.all_gather_object(holds, bool(tp_piece.any()))
            truth = ([rank for rank, held in enumerate(holds) if held],
                     int(changed.any(dim=1).sum()))
        if kind == "ddp":  # instrumented part by part: saved after the run
            gm = fxdebug.instrument(model)
            gm(x)
            fxdebug.save_records(fxdebug.records(gm), f"{folder}/{kind}")
        else:
            gm = fxdebug.instrument(model, folder=f"{folder}/{kind}")
            gm(x)
            fxdebug.records(gm)
        live[kind] = _summary(fxdebug.compare_runs(unsharded, fxdebug.records(gm)))  # collective
    dist.barrier()
    return live, truth


def test_every_configuration_equals_unsharded_and_the_planted_bug_names_key_and_ranks(tmp_path):
    folder = str(tmp_path)
    results = on_ranks(_all_configs, 4, folder)
    truth_ranks, changed_rows = results[0][1]
    assert changed_rows == 1 and BUG_RANK in truth_ranks and len(truth_ranks) < 4
    keys = fxdebug.load_records(f"{folder}/unsharded").keys()
    assert len(keys) == 9 and "blocks.1.fc1" in keys
    for rank, (live, _) in enumerate(results):
        saved = {kind: _summary(fxdebug.compare_runs(f"{folder}/unsharded", f"{folder}/{kind}"))
                 for kind in CONFIGS} if rank == 0 else {}
        for how, found in (("live", live), ("saved", saved)):
            for kind, (ok, entries, first) in found.items():
                where = f"{how} {kind} on rank {rank}"
                if kind == "ddp":  # the wrapper's own output: a key the unwrapped model has not
                    assert [(k, s) for k, s in entries if s != "equal" and s != "close"] == [
                        ("module", "only b")], where
                    entries = [(k, s) for k, s in entries if k != "module"]
                assert [k for k, _ in entries] == keys, where
                if kind != "fsdp_tp_bug":
                    assert all(s in ("equal", "close") for _, s in entries), (where, entries)
                    assert ok == (kind != "ddp") and (first is None) == ok, where
                    continue
                assert not ok and first == ("blocks.1.fc1", tuple(truth_ranks)), (where, first)
                before = entries[:keys.index("blocks.1.fc1")]
                assert before and all(s in ("equal", "close") for _, s in before), where
