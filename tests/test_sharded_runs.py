"""Sharded runs on disk: saved on 2 gloo ranks, loaded and compared in the test process.

Ground truth is computed another way: forward hooks on the unsharded model (same weights,
same input) in the test process; the planted bug's rank is the rank whose piece of the
weight was changed (ColwiseParallel: rank r holds output features r*half .. (r+1)*half).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import fxdebug
from ranks import on_ranks
from tp_models import D, Net


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def full_input() -> torch.Tensor:
    return torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))


def _run(rank, world, folder, kind, bug_rank):
    from torch.distributed.device_mesh import init_device_mesh
    model = make_model()
    if kind in ("tp", "tp-dtensor"):
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        local = kind == "tp"
        plan = {}
        for i in range(2):
            plan[f"blocks.{i}.fc1"] = ColwiseParallel(use_local_output=local)
            plan[f"blocks.{i}.fc2"] = RowwiseParallel()
        parallelize_module(model, mesh, plan)
        if rank == bug_rank:  # the planted bug: this rank's piece of blocks.1.fc1.weight
            with torch.no_grad():
                model.blocks[1].fc1.weight.to_local()[0, 0] += 1.0
    elif kind == "fsdp":
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    if kind in ("save_records", "ddp"):  # DDP: its root is instrumented part by part
        gm = fxdebug.instrument(model)
        gm(full_input())
        fxdebug.save_records(fxdebug.records(gm), folder)
    else:
        gm = fxdebug.instrument(model, folder=folder)
        gm(full_input())  # every rank the same batch
        fxdebug.records(gm)
    torch.distributed.barrier()
    return sorted(os.listdir(folder))


def unsharded_folder(tmp_path) -> tuple[str, dict]:
    model = make_model()
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, torch.nn.ModuleList):
            module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))
    gm = fxdebug.instrument(copy.deepcopy(model))
    gm(full_input())
    folder = fxdebug.save_records(fxdebug.records(gm), str(tmp_path / "unsharded"))
    with torch.no_grad():
        seen["output"] = model(full_input())
    return folder, seen


@pytest.mark.parametrize("kind", ["tp", "tp-dtensor"])
def test_tensor_parallel_run_saved_by_ranks_loads_whole_without_a_process_group(tmp_path, kind):
    folder = str(tmp_path / kind)
    assert on_ranks(_run, 2, folder, kind, -1) == [["rank-0", "rank-1"]] * 2
    _, truth = unsharded_folder(tmp_path)
    rec = fxdebug.load_records(folder)
    assert not torch.distributed.is_initialized()
    assert rec.keys() == [k for k in truth if k != "output"]
    for key in rec.keys():  # every key assembled, equal to the unsharded model's hooks
        torch.testing.assert_close(rec[key], truth[key], msg=key)
    placement = rec.record("blocks.0.fc1").placement
    assert placement is not None and placement.text == "S(2)@tp"
    assert placement.global_shape == (2, 4, 4 * D)
    shards = rec.shards("blocks.0.fc1")
    assert sorted(shards) == [0, 1]
    for rank, piece in shards.items():
        torch.testing.assert_close(piece, truth["blocks.0.fc1"].chunk(2, dim=2)[rank])
    assert "S(2)@tp" in rec.table(wide=True)


def test_planted_bug_on_one_rank_is_named_by_compare_runs(tmp_path):
    folder = str(tmp_path / "tp")
    on_ranks(_run, 2, folder, "tp", 1)
    unsharded, _ = unsharded_folder(tmp_path)
    report = fxdebug.compare_runs(unsharded, folder)
    first = report.first_divergence
    assert not report.ok and first is not None
    assert first.key == "blocks.1.fc1" and first.ranks == (1,)
    assert "on rank(s) 1" in report.table(wide=True)
    keys = [entry.key for entry in report.entries]
    for entry in report.entries[:keys.index("blocks.1.fc1")]:
        assert entry.ok, entry


@pytest.mark.parametrize("kind", ["fsdp", "ddp", "save_records"])
def test_data_parallel_runs_equal_the_unsharded_run(tmp_path, kind):
    folder = str(tmp_path / kind)
    assert on_ranks(_run, 2, folder, kind, -1)[0] == ["rank-0", "rank-1"]
    unsharded, _ = unsharded_folder(tmp_path)
    report = fxdebug.compare_runs(unsharded, folder)
    entries = report.entries
    if kind == "ddp":  # the wrapper's own output: a key the unwrapped model has not
        assert [(e.key, e.status) for e in entries if not e.ok] == [("module", "only b")]
        entries = [e for e in entries if e.key != "module"]
    else:
        assert report.ok, report.table(wide=True)
    assert all(e.ok for e in entries) and len(entries) == 9
    assert [e.key for e in entries] == fxdebug.load_records(unsharded).keys()


def _differing_batches(rank, world, folder):
    gm = fxdebug.instrument(make_model(), folder=folder)
    gm(full_input() + rank)  # data parallel: each rank its own batch
    fxdebug.records(gm)
    torch.distributed.barrier()


def test_pieces_that_cannot_be_assembled_say_so_naming_key_and_ranks(tmp_path):
    folder = str(tmp_path / "dp")
    on_ranks(_differing_batches, 2, folder)
    rec = fxdebug.load_records(folder)
    with pytest.raises(fxdebug.FxdebugError, match=r"'blocks.0.norm'.*2 different values: "
                                                   r"rank 0 \| rank 1.*rec.shards"):
        rec["blocks.0.norm"]
    torch.testing.assert_close(rec.shards("blocks.0.norm")[1][0, 0],
                               torch.nn.functional.layer_norm(torch.ones(D) * 0 + (
                                   full_input()[0, 0] + 1), (D,)), atol=1e-5, rtol=1e-5)
    report = fxdebug.compare_runs(folder, folder)  # nothing to resolve them against
    assert report.entries[0].status == "unassembled"
    assert not report.ok and report.verdict_text == "INCOMPLETE" and not report.complete
