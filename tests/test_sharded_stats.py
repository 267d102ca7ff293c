"""Sharded runs in statistics mode, and sharded gradient statistics, on 2 and 4 gloo ranks.

Ground truth is computed another way, in the test process: the unsharded model (same weights,
same input) with forward hooks for the activations, ``retain_grad`` for the activation
gradients and a plain ``backward()`` for the parameter gradients; their statistics taken with
``tensor_stats`` of the whole tensors. A rank's own statistics (live) are checked against its
piece, taken with ``DTensor.to_local()`` / the local tensor.
"""

from __future__ import annotations

import math

import pytest
import torch

import fxdebug
from fxdebug.stats.summary import tensor_stats
from ranks import on_ranks
from tp_models import D, Net


def full_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 4, D, generator=torch.Generator().manual_seed(seed))


def make_model() -> Net:
    torch.manual_seed(0)
    return Net()


def truth(x: torch.Tensor | None = None):
    """Activations, activation gradients and parameter gradients of the unsharded model."""
    model = make_model()
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, torch.nn.ModuleList):
            def hook(module, args, out, name=name):
                out.retain_grad()
                seen[name] = out
            module.register_forward_hook(hook)
    out = model(full_input() if x is None else x)
    out.square().sum().backward()
    return (seen, {k: v.grad for k, v in seen.items()},
            {n: p.grad for n, p in model.named_parameters()})


def assert_stats(found, tensor: torch.Tensor, what: str) -> None:
    expected = tensor_stats(tensor)
    assert found.numel == expected.numel and found.nonfinite == expected.nonfinite, what
    assert found.zeros_pct == expected.zeros_pct, what
    for name in ("mean", "std", "min", "max", "norm"):
        a, b = getattr(found, name), getattr(expected, name)
        assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6), (what, name, a, b)


def _tensor_parallel_stats(rank, world, folder, partial):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = make_model()
    plan = {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel(),
            "blocks.1.fc1": ColwiseParallel(use_local_output=False),
            "blocks.1.fc2": RowwiseParallel()}
    if partial:  # the head's output: a pending sum, handed on as a DTensor
        plan["head"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Partial(),
                                       use_local_output=False)
    parallelize_module(model, mesh, plan)
    gm = fxdebug.instrument(model, mode="stats", grads=True, folder=folder)
    out = gm(full_input())
    (out.full_tensor() if partial else out).square().sum().backward()
    fxdebug.records(gm)
    live = fxdebug.records(gm)  # this rank's run, read back: its pieces' statistics
    pieces = {}
    for key in live.keys():
        record = live.record(key)
        pieces[key] = (record.placement.text, record.shape, record.stats, repr(record))
    torch.distributed.barrier()
    return pieces


@pytest.mark.parametrize("world", [2, 4])
def test_tensor_parallel_stats_run_loads_the_full_tensors_statistics(tmp_path, world):
    folder = str(tmp_path / "tp")
    live = on_ranks(_tensor_parallel_stats, world, folder, False)
    seen, activation_grads, parameter_grads = truth()
    rec = fxdebug.load_records(folder)
    assert rec.keys() == list(seen)
    for key in rec.keys():  # the full tensor's statistics and shape, never a piece's
        record = rec.record(key)
        assert record.problem() == "" and record.shape == tuple(seen[key].shape), key
        assert_stats(record.stats, seen[key], key)
        assert_stats(rec.grads.record(key).stats, activation_grads[key], "grad " + key)
    parameters = {name: (shape, stats) for name, shape, stats in rec.parameter_grads()}
    assert list(parameters) == list(parameter_grads)
    for name, grad in parameter_grads.items():  # DTensor pieces assembled by placement
        assert parameters[name][0] == tuple(grad.shape), name
        assert_stats(parameters[name][1], grad, name)
    table = rec.table(wide=True)
    assert "not assembled" not in table and "the full tensor's" in table
    # live (each rank's own run): the piece's statistics, and the record says so
    for rank, pieces in enumerate(live):
        text, shape, stats, described = pieces["blocks.0.fc1"]  # a local Shard(-1) piece
        assert text == "S(2)@tp" and shape == (2, 4, 4 * D // world)
        assert_stats(stats, seen["blocks.0.fc1"].chunk(world, dim=2)[rank], "piece")
        assert "statistics of this rank's piece" in described
        text, shape, stats, described = pieces["blocks.1.fc1"]  # a DTensor: its global shape
        assert_stats(stats, seen["blocks.1.fc1"].chunk(world, dim=2)[rank], "dtensor piece")
        assert "statistics of this rank's piece" in described
        assert "statistics of" not in pieces["blocks.0.fc2"][3]  # replicated: the full tensor's
    # compare_runs: an unsharded stats run against the TP stats run, key by key
    gm = fxdebug.instrument(make_model(), mode="stats", grads=True)
    gm(full_input()).square().sum().backward()
    report = fxdebug.compare_runs(fxdebug.records(gm), rec)
    assert report.ok, report.table(wide=True)
    statuses = {e.status for e in report.entries + report.grad_entries}
    assert statuses <= {"equal", "close"} and len(report.entries) == len(seen)


def test_statistics_of_a_pending_sum_are_not_assembled_and_say_why(tmp_path):
    folder = str(tmp_path / "partial")
    live = on_ranks(_tensor_parallel_stats, 2, folder, True)
    seen, _, _ = truth()
    rec = fxdebug.load_records(folder)
    record = rec.record("head")
    assert record.placement.text == "P@tp"
    assert "pending sum (Partial) on mesh dim tp" in record.problem()
    assert math.isnan(record.stats.mean) and "not assembled" in repr(record)
    with pytest.raises(fxdebug.FxdebugError, match="'head'.*statistics of a sum.*mode='tensor'"):
        rec["head"]
    assert "not assembled: head: a pending sum" in rec.table(wide=True)
    for key in rec.keys():  # every other key assembled
        if key != "head":
            assert_stats(rec.record(key).stats, seen[key], key)
    assert all("term of the pending sum" in pieces["head"][3] for pieces in live)


def _differing_batches(rank, world, folder, mode):
    gm = fxdebug.instrument(make_model(), mode=mode, folder=folder)
    gm(full_input(seed=1 + rank % 2))  # ranks 0, 2 one batch, ranks 1, 3 another
    fxdebug.records(gm)
    torch.distributed.barrier()


@pytest.mark.parametrize("mode", ["tensor", "stats"])
def test_unplaced_captures_that_differ_name_which_ranks_hold_which(tmp_path, mode):
    """Data parallel, a batch per rank: tensors are not assembled (which dim is the batch's is not
    known), and say which ranks hold which value; statistics are pooled exactly (count, mean and
    M2 merge whatever the dim): the global batch's, checked against the concatenated batches."""
    folder = str(tmp_path / mode)
    on_ranks(_differing_batches, 4, folder, mode)
    seen_a, _, _ = truth(full_input(seed=1))
    seen_b, _, _ = truth(full_input(seed=2))
    rec = fxdebug.load_records(folder)
    for key in rec.keys():
        record = rec.record(key)
        shards = rec.shards(key)  # each rank's own, as it was
        for rank in range(4):
            expected = (seen_a if rank % 2 == 0 else seen_b)[key]
            if mode == "tensor":
                torch.testing.assert_close(shards[rank], expected)
            else:
                assert_stats(shards[rank], expected, key)
        if mode == "stats":
            assert record.problem() == "" and record.pooled, key
            everything = torch.cat([seen_a[key], seen_b[key], seen_a[key], seen_b[key]])
            assert_stats(rec[key], everything.detach(), key)
            continue
        assert "2 different values: ranks 0, 2 | ranks 1, 3" in record.problem(), key
        with pytest.raises(fxdebug.FxdebugError, match=f"'{key}'.*ranks 0, 2 | ranks 1, 3"):
            rec[key]
        assert math.isnan(record.stats.mean)  # no one rank's statistics shown as the run's
    count = rec.table(wide=True).count("not assembled:")
    assert count == (len(rec.keys()) if mode == "tensor" else 0)


def _fsdp_grads(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = make_model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gm = fxdebug.instrument(model, mode="stats", grads=True, folder=folder)
    gm(full_input()).square().sum().backward()  # every rank the same batch: the mean is the grad
    fxdebug.records(gm)
    placements = {n: p.grad.placements for n, p in model.named_parameters()}
    torch.distributed.barrier()
    return {n: str(p) for n, p in placements.items()}


def test_fsdp2_gradient_statistics_assemble_to_the_unsharded_models(tmp_path):
    folder = str(tmp_path / "fsdp")
    placements = on_ranks(_fsdp_grads, 2, folder)[0]
    assert placements["blocks.0.fc1.weight"] == "(Shard(dim=0),)"  # pieces, truly
    seen, activation_grads, parameter_grads = truth()
    rec = fxdebug.load_records(folder)
    for key in rec.keys():
        assert_stats(rec.record(key).stats, seen[key], key)
        assert_stats(rec.grads.record(key).stats, activation_grads[key], "grad " + key)
    found = {name: (shape, stats) for name, shape, stats in rec.parameter_grads()}
    for name, grad in parameter_grads.items():
        assert found[name][0] == tuple(grad.shape), name
        assert_stats(found[name][1], grad, name)
    one_rank = fxdebug.load_records(str(tmp_path / "fsdp" / "rank-1"))
    pieces = {name: shape for name, shape, _ in one_rank.parameter_grads()}
    assert pieces["blocks.0.fc1.weight"] == (2 * D, D)  # a piece keeps its own shape


def _dtensor_statistics(rank: int, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fxdebug.nonfinite.watch_modules import _stats
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    full[:, :2] = 0.0  # zeros only in some pieces: a count mixed with the full size shows
    found = {}
    for placement in (Shard(0), Shard(1), Replicate()):
        tensor = distribute_tensor(full, mesh, [placement])
        shown = _stats("out", tensor)
        found[str(placement)] = (tensor.to_local().clone(), tensor_stats(tensor), shown.name)
    return found


def test_statistics_of_a_dtensor_are_its_local_pieces_and_say_so():
    """torch's reductions on a sharded DTensor mix a piece's counts with the whole size (50%
    zeros where a piece holds 25%): statistics are taken of the local piece, labelled."""
    for rank, found in enumerate(on_ranks(_dtensor_statistics, 2)):
        for placement, (piece, stats, name) in found.items():
            assert_stats(stats, piece, f"rank {rank} {placement}")
            assert stats.zeros_pct == pytest.approx(100.0 * float((piece == 0).sum()) / piece.numel())
            assert name == "out" if placement.startswith("R") else name.endswith("piece)")


def _tensor_parallel_grads(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = make_model()
    parallelize_module(model, mesh, {"blocks.0.fc1": ColwiseParallel(),
                                     "blocks.0.fc2": RowwiseParallel(),
                                     "blocks.1.fc1": ColwiseParallel(use_local_output=False),
                                     "blocks.1.fc2": RowwiseParallel()})
    gm = fxdebug.instrument(model, grads=True, folder=folder)
    gm(full_input()).square().sum().backward()
    fxdebug.records(gm)


def test_tensor_parallel_activation_gradients_assemble_to_the_unsharded_models(tmp_path):
    """Tensor mode: each gradient capture of a sharded activation carries the forward's
    placement, so the saved run's gradients are the full tensors (retain_grad's)."""
    folder = str(tmp_path / "tp")
    on_ranks(_tensor_parallel_grads, 2, folder)
    _, activation_grads, _ = truth()
    rec = fxdebug.load_records(folder)
    assert rec.grads.keys() and set(rec.grads.keys()) == set(activation_grads)
    for key, grad in activation_grads.items():
        torch.testing.assert_close(rec.grads[key], grad, msg=key)
    gm = fxdebug.instrument(make_model(), grads=True)
    gm(full_input()).square().sum().backward()
    report = fxdebug.compare_runs(fxdebug.records(gm), rec)
    assert report.ok and {e.status for e in report.grad_entries} <= {"equal", "close"}
