"""compare_ranks on 2 and 3 gloo ranks: a perturbation planted on one rank is found at its key.

Ground truth is computed another way: every rank all-gathers the tensors themselves
(``dist.all_gather``) and compares them with ``torch.equal``; the keys where some rank
differs must be exactly those the report marks, and the first of them its first divergence.
"""

from __future__ import annotations

import json

import pytest
import torch

import fxdebug
from ranks import on_ranks


def make_net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                               torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def same_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def differing(named: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Keys whose tensor is not bitwise equal on every rank: the tensors themselves gathered."""
    import torch.distributed as dist
    world = dist.get_world_size()
    found = []
    for key, tensor in named:
        tensor = tensor.detach().contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(gathered, tensor)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            found.append(key)
    return found


def summary(report) -> dict:
    first = report.first_divergence
    return {"ok": report.ok,
            "first": None if first is None else (first.key, first.kind, first.ranks),
            "bad": [(e.key, e.kind, e.ranks) for e in report.divergences],
            "keys": [(e.key, e.kind) for e in report.entries], "table": report.table(wide=True),
            "status": {e.key: (e.status, e.ranks) for e in report.entries if e.status != "equal"},
            "dict": json.dumps(report.to_dict(), sort_keys=True), "repr": repr(report)}


def _ddp_desync(rank, world):
    import torch.distributed as dist
    model = make_net()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    gm = fxdebug.instrument(ddp, grads=True)
    gm(same_input()).sum().backward()
    before = (summary(fxdebug.compare_ranks(fxdebug.records(gm))),
              summary(fxdebug.compare_ranks(ddp)))
    with torch.no_grad():  # after DDP's broadcast at construction: rank 1 out of sync
        if rank == 1:
            model[3].weight[2, 5] += 1e-3
    model.zero_grad()
    gm(same_input()).sum().backward()
    rec = fxdebug.records(gm)
    truth_activations = differing([(k, rec[k]) for k in rec.keys()])
    truth_grads = differing([(k, rec.grads[k]) for k in rec.grads.keys()])
    truth_params = differing(list(model.named_parameters()) + list(model.named_buffers())
                             + [(f"{n}.grad", p.grad) for n, p in model.named_parameters()])
    after = (summary(fxdebug.compare_ranks(rec)), summary(fxdebug.compare_ranks(ddp)))
    assert dist.get_world_size() == world
    return before, after, truth_activations, truth_grads, truth_params, rec.keys()


def test_ddp_weight_out_of_sync_on_rank_1_found_at_its_key():
    results = on_ranks(_ddp_desync, 2)
    for before, after, truth_activations, truth_grads, truth_params, keys in results:
        # identical ranks: ok, every key equal
        assert before[0]["ok"] and before[1]["ok"]
        assert before[0]["first"] is None and before[0]["bad"] == []
        records, module = after
        # activations: the first key the gathered tensors differ at, and only rank 1
        assert truth_activations[0] == "module.3"
        assert records["first"] == ("module.3", "activation", (1,))
        bad_activations = [k for k, kind, _ in records["bad"] if kind == "activation"]
        assert bad_activations == truth_activations
        assert [k for k, kind, _ in records["bad"] if kind == "grad"] == truth_grads
        assert all(ranks == (1,) for _, _, ranks in records["bad"])
        # nowhere earlier: every key before module.3 is equal on both ranks
        order = [k for k, kind in records["keys"] if kind == "activation"]
        assert order == keys  # execution order
        assert set(order[:order.index("module.3")]).isdisjoint(truth_activations)
        # parameters: only the planted weight differs (DDP averages the gradients)
        assert truth_params == ["3.weight"]
        assert module["first"] == ("3.weight", "parameter", (1,))
        assert [k for k, _, _ in module["bad"]] == ["3.weight"]
        assert "DistributedDataParallel(Sequential)" in module["table"]
    # every rank gets the same report
    assert results[0][1] == results[1][1]
    as_data = json.loads(results[0][1][1]["dict"])
    assert as_data["first_divergence"]["key"] == "3.weight" and as_data["ranks"] == [1]
    assert results[0][1][1]["repr"].count("\n") == 0


def _own_batches(rank, world):
    model = torch.nn.parallel.DistributedDataParallel(make_net())
    model(torch.randn(5, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
    return summary(fxdebug.compare_ranks(model))


def test_ddp_buffers_of_each_ranks_own_batch_are_resynced_not_out_of_sync():
    first, second = on_ranks(_own_batches, 2)
    assert first == second and first["ok"]
    assert "2 resynced" in first["table"] and "broadcast_buffers=True" in first["table"]
    assert "1.running_mean" in first["table"]


def _tolerance_and_stale(rank, world):
    model = make_net()
    with torch.no_grad():
        if rank == 1:  # one ulp-sized change, as a non-deterministic kernel makes
            model[0].weight[0, 0] = torch.nextafter(model[0].weight[0, 0], torch.tensor(2.0))
    exact, close = fxdebug.compare_ranks(model), fxdebug.compare_ranks(model, rtol=1e-6)
    gm = fxdebug.instrument(model)
    out = gm(same_input())
    if rank == 1:
        with torch.no_grad():
            out.mul_(2)  # written after its capture: that record is stale on rank 1
    near_zero = torch.nn.Linear(2, 2, bias=False)
    with torch.no_grad():  # zeros on rank 0, 1e-9 on rank 1: no rtol accepts it, an atol does
        near_zero.weight.zero_()[0, 0] = 1e-9 * rank
    relative = fxdebug.compare_ranks(near_zero, rtol=1e-6)
    absolute = fxdebug.compare_ranks(near_zero, rtol=1e-6, atol=1e-8)
    return summary(exact), summary(close), [(e.key, e.status) for e in close.entries][:1], \
        summary(fxdebug.compare_ranks(fxdebug.records(gm))), summary(relative), summary(absolute)


def test_rtol_and_atol_accept_bits_that_differ_and_a_stale_capture_is_not_compared():
    first, second = on_ranks(_tolerance_and_stale, 2)
    assert first == second
    exact, close, statuses, records, relative, absolute = first
    assert relative["first"] == ("weight", "parameter", (1,)) and not relative["ok"]
    assert absolute["ok"] and "within rtol=1e-06, atol=1e-08" in absolute["table"]
    assert exact["first"] == ("0.weight", "parameter", (1,))
    assert close["ok"] and statuses == [("0.weight", "close")]
    assert "within rtol=1e-06" in close["table"]
    # the last module's capture is a view of the output rank 1 wrote to
    assert records["status"] == {"5": ("stale", (1,))} and not records["ok"]
    assert "verdict: INCOMPLETE" in records["table"]
    assert "1 stale capture(s) not compared (5)" in records["table"]


def _running_stat(rank, world):
    model = make_net().eval()
    with torch.no_grad():
        if rank == 0:
            model[1].running_mean[3] += 0.25
    gm = fxdebug.instrument(model)
    gm(same_input())
    rec = fxdebug.records(gm)
    truth = differing([(k, rec[k]) for k in rec.keys()])
    truth_module = differing(list(model.named_parameters()) + list(model.named_buffers()))
    return (summary(fxdebug.compare_ranks(rec)), summary(fxdebug.compare_ranks(model)), truth,
            truth_module)


def test_running_statistic_planted_on_rank_0_of_3_the_majority_names_rank_0():
    results = on_ranks(_running_stat, 3)
    for records, module, truth, truth_module in results:
        assert truth[0] == "1" and truth_module == ["1.running_mean"]
        assert records["first"] == ("1", "activation", (0,))
        assert [k for k, _, _ in records["bad"]] == truth
        assert module["first"] == ("1.running_mean", "buffer", (0,))
        assert [k for k, _, _ in module["bad"]] == ["1.running_mean"]
        assert "no majority" not in module["table"]
    assert results[0][:2] == results[1][:2] == results[2][:2]


class Branchy(torch.nn.Module):
    def __init__(self, extra: bool):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.extra = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)
        self.use_extra = extra

    def forward(self, x):
        h = self.fc(x)
        if self.use_extra:  # a Python flag: one rank traces another graph
            h = self.extra(h)
        return self.head(h)


def _branchy(rank, world):
    torch.manual_seed(0)
    gm = fxdebug.instrument(Branchy(extra=rank == 1))
    gm(same_input())
    return summary(fxdebug.compare_ranks(fxdebug.records(gm)))


def test_a_key_on_one_rank_only_is_missing_in_merged_order():
    first, second = on_ranks(_branchy, 2)
    assert first == second
    assert first["keys"] == [("fc", "activation"), ("extra", "activation"), ("head", "activation")]
    assert first["first"] == ("extra", "activation", (1,))
    assert "only on rank 1" in first["table"]
    assert ("head", "activation", (1,)) in first["bad"]


def _fsdp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    found = {}
    for layout in ("fsdp", "hsdp"):
        model = make_net()
        mesh = (init_device_mesh("cpu", (world,)) if layout == "fsdp" else
                init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")))
        for layer in (model[0], model[3], model[5], model):
            fully_shard(layer, mesh=mesh)
        model(same_input()).sum().backward()
        clean = summary(fxdebug.compare_ranks(model))
        with torch.no_grad():
            if rank == 1:
                model[1].running_var[0] += 0.5
                if layout == "hsdp":  # a replica of a shard, out of sync
                    model[3].weight.to_local()[0, 0] += 1e-3
        found[layout] = (clean, summary(fxdebug.compare_ranks(model)),
                         [(e.key, e.status) for e in fxdebug.compare_ranks(model).entries])
    return found


def test_fsdp2_buffers_and_hsdp_replicas_compared_sharded_parameters_have_one_copy():
    results = on_ranks(_fsdp2, 2)
    assert results[0] == results[1]
    clean, planted, statuses = results[0]["fsdp"]
    assert not clean["ok"] and "verdict: INCOMPLETE" in clean["table"]  # buffers compared only
    assert ("0.weight", "one copy") in statuses and ("3.weight", "one copy") in statuses
    assert ("1.running_var", "differs") in statuses
    assert planted["first"] == ("1.running_var", "buffer", (1,))
    assert "no second copy to compare" in planted["table"]
    clean, planted, statuses = results[0]["hsdp"]
    assert clean["ok"] and ("0.weight", "equal") in statuses
    assert planted["first"] == ("1.running_var", "buffer", (1,))
    assert [(k, kind) for k, kind, _ in planted["bad"]] == [("1.running_var", "buffer"),
                                                            ("3.weight", "parameter")]


def test_compare_ranks_without_torch_distributed_says_how_to_start_it():
    with pytest.raises(fxdebug.FxdebugError, match="init_process_group") as failure:
        fxdebug.compare_ranks(make_net())
    assert "test_ranks.py:" in str(failure.value)
    with pytest.raises(TypeError, match="Records .* or an nn.Module"):
        fxdebug.compare_ranks({"w": torch.ones(1)})
