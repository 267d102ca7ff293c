"""instrument() on FSDP2 models (fully_shard per block and at the root), on 1 and 2 gloo ranks.

Ground truth is computed another way on every rank:
- captures: forward hooks on the unsharded model (same weights, same input), or, with a
  MixedPrecisionPolicy, forward hooks on a plain FSDP2 twin;
- gradients: ``loss.backward()`` on a plain FSDP2 twin built from the same state, its
  sharded ``.grad`` (DTensors) compared bitwise;
- activation gradients (``grads=True``): ``retain_grad`` on the twin's module outputs;
- train()/eval(): the twin run eagerly in the same mode, with the same RNG state.
Each rank feeds its own batch, as in data-parallel training.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from ranks import on_ranks

D = 8


class FunctionalDropout(torch.nn.Module):
    """Reads ``self.training`` in a traced-through forward: the graph bakes the flag."""

    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=self.training)


class Block(torch.nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 2 * D)
        self.fc2 = torch.nn.Linear(2 * D, D)
        self.extra = (torch.nn.Dropout(0.5) if extra == "dropout" else
                      FunctionalDropout() if extra == "functional" else
                      torch.nn.BatchNorm1d(2 * D) if extra == "batchnorm" else torch.nn.Identity())

    def forward(self, x):
        return x + self.fc2(self.extra(torch.relu(self.fc1(self.norm(x)))))


class MLP(torch.nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(extra) for _ in range(3))
        self.head = torch.nn.Linear(D, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(rank: int) -> torch.Tensor:
    return torch.randn(4, D, generator=torch.Generator().manual_seed(100 + rank))


def shard(model, world, mp=False, reshard=True, hsdp=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = (init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp
            else init_device_mesh("cpu", (world,)))
    options = dict(mesh=mesh, reshard_after_forward=reshard)
    if mp:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model.blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def hooked_outputs(model, retain=False):
    """Every module's output by path, from forward hooks (retain: with retain_grad)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if name and not isinstance(module, torch.nn.ModuleList):
            def hook(module, args, out, name=name):
                if retain and out.requires_grad:
                    out.retain_grad()
                seen[name] = out
            handles.append(module.register_forward_hook(hook))
    return seen, handles


def local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _fsdp_configs(rank, world):
    from torch.distributed.fsdp import FSDPModule
    results = []
    for mp, reshard, hsdp in [(False, True, False), (False, False, False), (True, True, False),
                              (True, False, False), (False, True, True)]:
        if hsdp and world < 2:
            continue
        torch.manual_seed(0)
        plain = MLP()
        unsharded = copy.deepcopy(plain)
        twin = shard(copy.deepcopy(plain), world, mp, reshard, hsdp)
        model = shard(plain, world, mp, reshard, hsdp)
        gm = fxdebug.instrument(model, grads=True)
        # tracing ran no FSDP hook: no lazy init, no state change
        assert isinstance(model, FSDPModule) and model._get_fsdp_state()._is_root is None
        assert all(b._get_fsdp_state()._is_root is None for b in model.blocks)
        x = batch(rank)
        reference, handles = hooked_outputs(unsharded)
        unsharded(x)
        twin_seen, _ = hooked_outputs(twin, retain=True)
        twin_out = twin(x)
        out = gm(x)
        rec = fxdebug.records(gm)
        keys = rec.keys()
        assert keys == [f"blocks.{i}{part}" for i in range(3)  # the unsharded model's paths
                        for part in (".norm", ".fc1", ".extra", ".fc2", "")] + ["head"]
        for key in keys:
            if mp:  # bf16 compute: the plain FSDP2 model's forward hooks are the truth
                torch.testing.assert_close(rec[key], twin_seen[key], rtol=1.6e-2, atol=1e-5)
                assert rec[key].dtype == twin_seen[key].dtype == torch.bfloat16
            else:
                torch.testing.assert_close(rec[key], reference[key])
        assert torch.equal(out, twin_out)
        out.square().sum().backward()
        twin_out.square().sum().backward()
        grads = dict(model.named_parameters())
        for name, p in twin.named_parameters():
            mine = grads[name].grad
            assert type(mine) is type(p.grad) and mine.placements == p.grad.placements, name
            assert torch.equal(local(mine), local(p.grad)), name
        for key in keys:
            assert torch.equal(rec.grads[key], twin_seen[key].grad), key
        results.append((mp, reshard, hsdp, len(keys)))
    return results


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_captures_and_gradients_equal_unsharded_and_plain_fsdp2(world):
    results = on_ranks(_fsdp_configs, world)
    expected = 5 if world == 2 else 4
    assert all(len(found) == expected for found in results)


def _modes(rank, world):
    found = {}
    for extra in ("dropout", "functional", "batchnorm"):
        torch.manual_seed(0)
        plain = MLP(extra)
        twin = shard(copy.deepcopy(plain), world)
        model = shard(plain, world)
        gm = fxdebug.instrument(model)  # in train mode
        seen, _ = hooked_outputs(twin)
        x = batch(rank)
        for mode in ("train", "eval", "train"):
            for m in (model, twin):
                m.train(mode == "train")
            torch.manual_seed(1)
            expected = twin(x)
            torch.manual_seed(1)
            out = gm(x)
            assert torch.equal(out, expected), (extra, mode)
            rec = fxdebug.records(gm)
            assert rec.keys() and all(torch.equal(rec[k], seen[k]) for k in rec.keys())
        found[extra] = True
    return found


@pytest.mark.parametrize("world", [1, 2])
def test_fsdp2_instrumented_in_train_mode_follows_eval(world):
    assert all(r == {"dropout": True, "functional": True, "batchnorm": True}
               for r in on_ranks(_modes, world))


def _hsdp_2x2(rank, world, folder):
    """HSDP on a 2x2 mesh (replicate x shard): captures, gradients, activation gradients; then
    a statistics run saved by every rank, with the truth for its parameter gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp(model):
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    torch.manual_seed(0)
    plain = MLP()
    unsharded, stats_model = copy.deepcopy(plain), copy.deepcopy(plain)
    twin = hsdp(copy.deepcopy(plain))
    gm = fxdebug.instrument(hsdp(plain), grads=True)
    x = batch(rank)
    reference, _ = hooked_outputs(unsharded)
    unsharded(x)
    twin_seen, _ = hooked_outputs(twin, retain=True)
    twin_out = twin(x)
    out = gm(x)
    rec = fxdebug.records(gm)
    for key in rec.keys():
        torch.testing.assert_close(rec[key], reference[key], msg=key)
    out.square().sum().backward()
    twin_out.square().sum().backward()
    grads = dict(plain.named_parameters())
    for name, p in twin.named_parameters():
        assert grads[name].grad.placements == p.grad.placements, name
        assert torch.equal(local(grads[name].grad), local(p.grad)), name
    for key in rec.keys():
        assert torch.equal(rec.grads[key], twin_seen[key].grad), key
    stats = fxdebug.instrument(hsdp(stats_model), mode="stats", grads=True, folder=folder)
    stats(x).square().sum().backward()
    fxdebug.records(stats)
    # truth: HSDP averages the 4 ranks' gradients: the plain model's on the mean loss
    torch.manual_seed(0)
    again = MLP()
    sum(again(batch(r)).square().sum() for r in range(world)).div(world).backward()
    torch.distributed.barrier()
    return (len(rec.keys()), str(grads["blocks.0.fc1.weight"].grad.placements),
            {n: p.grad for n, p in again.named_parameters()})


def test_hsdp_on_a_2x2_mesh_captures_gradients_and_statistics(tmp_path):
    from fxdebug.stats.summary import tensor_stats
    folder = str(tmp_path / "hsdp")
    results = on_ranks(_hsdp_2x2, 4, folder)
    assert all(r[0] == 16 for r in results)
    assert results[0][1] == "(Replicate(), Shard(dim=0))"
    rec = fxdebug.load_records(folder)  # parameter gradients: pieces assembled on the mesh
    found = {name: (shape, stats) for name, shape, stats in rec.parameter_grads()}
    for name, grad in results[0][2].items():
        expected = tensor_stats(grad)
        shape, stats = found[name]
        assert shape == tuple(grad.shape) and stats.numel == expected.numel, name
        for field in ("mean", "std", "min", "max", "norm"):
            assert abs(getattr(stats, field) - getattr(expected, field)) <= \
                1e-5 * abs(getattr(expected, field)) + 1e-6, (name, field)
    table = rec.table(wide=True)
    assert "not assembled" not in table
    # each rank its own batch: an activation's (and its gradient's) statistics are the global
    # batch's, pooled over the 4 ranks; truth: forward hooks on the plain model, batches joined
    torch.manual_seed(0)
    plain = MLP()
    seen, _ = hooked_outputs(plain, retain=True)
    per_rank = []
    for r in range(4):
        plain(batch(r)).square().sum().div(4).backward()
        per_rank.append({k: (v.detach(), v.grad) for k, v in seen.items()})
    for key in rec.keys():
        record = rec.record(key)
        assert record.pooled and not record.problem(), key
        expected = tensor_stats(torch.cat([found[key][0] for found in per_rank]))
        for field in ("mean", "std", "min", "max", "norm"):
            assert abs(getattr(record.stats, field) - getattr(expected, field)) <= \
                1e-5 * abs(getattr(expected, field)) + 1e-6, (key, field)
        assert record.stats.numel == expected.numel, key
