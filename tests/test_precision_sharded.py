"""The precision what-if on sharded models (FSDP2, tensor parallel, both), on gloo ranks.

Ground truth is the plain model built from the same seed in this process (never
fxdebug's unsharded copy): its report on the batch the ranks hold together, with a
loss that is a mean over the batch, is the global step's report.
"""

from __future__ import annotations

import math

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError

pytest.importorskip("torch.distributed.fsdp")


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(index: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + index))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _report(net, x, dtypes, grads=True):
    return fxdebug.precision_sensitivity(net, x, loss=_loss, dtypes=dtypes, grads=grads).to_dict()


def _plain(x, dtypes, grads=True):
    return _report(_mlp(), x, dtypes, grads)


def _mesh(world, shape=None, names=None):
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", shape or (world,), mesh_dim_names=names)


def _tp(net, mesh):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    return parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _entries(report) -> dict:
    return {(e["key"], e["dtype"]): e for e in report["entries"]}


def _fsdp_ranks(rank, world):
    from torch.distributed.fsdp import fully_shard
    net, mesh = _mlp(), _mesh(world)
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    x = _batch(rank)
    with torch.no_grad():
        out = net(x)
    # the root's parameters stay gathered after a forward: a mix of shards and full tensors
    kinds = [type(p).__name__ for p in net.parameters()]
    shards = [_local(p).clone() for p in net.parameters()]
    report = _report(net, x, ("bfloat16",))
    forward_only = _report(net, x, ("bfloat16",), grads=False)
    kept = kinds == [type(p).__name__ for p in net.parameters()] and all(
        torch.equal(_local(p), s) for p, s in zip(net.parameters(), shards))
    with torch.no_grad():
        again = net(x)
    return {"report": report, "forward_only": forward_only, "class": type(net).__name__,
            "kinds": kinds, "kept": kept,
            "grads": [p.grad for p in net.parameters()], "same_output": torch.equal(out, again)}


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def test_fsdp2_report_is_the_global_steps():
    from ranks import on_ranks
    found = on_ranks(_fsdp_ranks, 2)
    assert found[0]["report"] == found[1]["report"]  # every rank the same report
    for rank in found:
        assert rank["class"] == "FSDPSequential" and rank["kept"], rank["kinds"]
        assert "DTensor" in rank["kinds"]
        assert rank["grads"] == [None] * 4 and rank["same_output"]
    plain = _plain(torch.cat([_batch(0), _batch(1)]), ("bfloat16",))
    sharded = found[0]["report"]
    assert sharded["keys"] == plain["keys"] and len(sharded["entries"]) == 2
    # the same forward, its float32 sums over the batch taken in another order: within
    # float32's own error (which the float64 reference measures) of each other
    slack = {m: 4 * max(plain["float32"][m], sharded["float32"][m]) for m in ("loss", "grad")}
    for key, entry in _entries(plain).items():
        other = _entries(sharded)[key]
        assert other["loss_error"] == pytest.approx(entry["loss_error"], rel=1e-6,
                                                    abs=slack["loss"]), key
        assert other["out_error"] == pytest.approx(entry["out_error"], rel=1e-3)
        assert other["amax"] == entry["amax"]  # the max over both batches, and the weight's
        # the gradients: each rank's bfloat16 weight gradient, averaged (as FSDP reduces
        # them); the concatenated batch would round their sum instead
        expected = _mean_of_ranks_grad_error(key[0], [_batch(0), _batch(1)])
        assert other["grad_error"] == pytest.approx(expected, rel=1e-6, abs=slack["grad"])
    # with the gradients left alone (grads=False), the concatenated batch's step it is
    plain = _plain(torch.cat([_batch(0), _batch(1)]), ("bfloat16",), grads=False)
    for key, entry in _entries(plain).items():
        other = _entries(found[1]["forward_only"])[key]
        for metric in ("loss", "grad"):
            assert other[f"{metric}_error"] == pytest.approx(
                entry[f"{metric}_error"], rel=1e-6, abs=slack[metric]), (key, metric)
    # and not one rank's batch alone
    alone = _entries(_plain(_batch(0), ("bfloat16",)))
    assert any(abs(_entries(sharded)[k]["loss_error"] - e["loss_error"]) > 10 * slack["loss"]
               for k, e in alone.items())


def _mean_of_ranks_grad_error(key: str, batches: list) -> float:
    """||mean over batches of the bfloat16 step's gradients - float64 gradients|| / ||...||,
    by torch autograd on the pass's graph and on a float64 model."""
    fake = fxdebug.fake_precision(_mlp(), [key], "bfloat16")
    names = [name for name, _ in fake.named_parameters()]
    grads = [torch.autograd.grad(_loss(fake(x)), [fake.get_parameter(n) for n in names])
             for x in batches]
    mean = [sum(g[i].double() for g in grads) / len(grads) for i in range(len(names))]
    wide = _mlp().double()
    exact = torch.autograd.grad(_loss(wide(torch.cat(batches).double())),
                                [wide.get_parameter(n) for n in names])
    difference = sum(float((m - e).square().sum()) for m, e in zip(mean, exact))
    return (difference / sum(float(e.square().sum()) for e in exact)) ** 0.5


def _tp_ranks(rank, world):
    net = _tp(_mlp(), _mesh(world))
    return _report(net, _batch(0), ("bfloat16", "float8_e4m3fn"))


def test_tensor_parallel_report_equals_the_unsharded_models():
    from ranks import on_ranks
    found = on_ranks(_tp_ranks, 2)
    assert found[0] == found[1]
    plain = _plain(_batch(0), ("bfloat16", "float8_e4m3fn"))
    assert [(e["key"], e["dtype"]) for e in found[0]["entries"]] == \
        [(e["key"], e["dtype"]) for e in plain["entries"]]
    for ours, theirs in zip(found[0]["entries"], plain["entries"]):
        for name, value in theirs.items():
            if isinstance(value, float):  # float8: the weight's amax is the full weight's
                assert ours[name] == pytest.approx(value, rel=1e-12, abs=0), name
            else:
                assert ours[name] == value, name
    for part in ("float32", "autocast"):
        assert found[0][part] == pytest.approx(plain[part], rel=1e-12)


def _mesh2d_ranks(rank, world):
    from torch.distributed.fsdp import fully_shard
    mesh = _mesh(world, (2, 2), ("dp", "tp"))
    net = _tp(_mlp(), mesh["tp"])
    fully_shard(net, mesh=mesh["dp"])
    return _report(net, _batch(mesh.get_coordinate()[0]), ("bfloat16",))


def test_a_2d_mesh_agrees_with_the_data_parallel_batches_together():
    from ranks import on_ranks
    found = on_ranks(_mesh2d_ranks, 4)
    assert all(report == found[0] for report in found)
    batches = [_batch(0), _batch(1)]
    plain = _entries(_plain(torch.cat(batches), ("bfloat16",)))
    slack = 4 * max(found[0]["float32"]["loss"], found[0]["float32"]["grad"])
    for key, entry in _entries(found[0]).items():
        assert entry["loss_error"] == pytest.approx(plain[key]["loss_error"], rel=1e-6, abs=slack)
        assert entry["grad_error"] == pytest.approx(_mean_of_ranks_grad_error(key[0], batches),
                                                    rel=1e-6, abs=slack)


def _llama_loss(out) -> torch.Tensor:
    return out.logits.square().mean()


def _llama_batches():
    from sharded_families import VOCAB, make
    _, (ids,) = make("llama")
    return ids, (ids * 7 + 3) % VOCAB


def _llama_ranks(rank, world):
    from sharded_families import configure, make
    model, _ = make("llama")
    configure(model, "llama", "fsdp")
    report = fxdebug.precision_sensitivity(model, _llama_batches()[rank], loss=_llama_loss,
                                           dtypes=("bfloat16",))
    return [e.key for e in report.entries], [e.impact for e in report.entries]


def test_a_tiny_llama_with_fsdp2_on_its_layers():
    pytest.importorskip("transformers")
    from ranks import on_ranks
    from sharded_families import make
    found = on_ranks(_llama_ranks, 2, timeout=240)
    assert found[0] == found[1]
    plain = fxdebug.precision_sensitivity(make("llama")[0], torch.cat(_llama_batches()),
                                          loss=_llama_loss, dtypes=("bfloat16",))
    keys, impacts = found[0]
    assert len(keys) == len(plain.keys) >= 15  # 7 linears a layer, the head
    assert keys[0] == plain.entries[0].key, (keys[:3], impacts[:3], plain.entries[:3])


def _failing_ranks(rank, world, where):
    net = _tp(_mlp(), _mesh(world))
    x = _batch(0) if rank == 0 else (torch.randn(4, 5) if where == "input" else _batch(0))
    select = ["0"] if rank == 0 or where != "select" else ["nowhere"]
    try:
        fxdebug.precision_sensitivity(net, x, loss=_loss, dtypes=("bfloat16",), select=select)
    except FxdebugError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("where", ["input", "select"])
def test_an_error_on_one_rank_is_raised_on_every_rank(where):
    from ranks import on_ranks
    messages = on_ranks(_failing_ranks, 2, where, timeout=60)
    assert messages[0] == messages[1], messages
    assert "failed on rank 1 of 2" in messages[0]
    assert ("mat1 and mat2" in messages[0]) if where == "input" else ("nowhere" in messages[0])


def _copy_ranks(rank, world):
    from torch.distributed.fsdp import fully_shard
    from fxdebug.distributed.unsharded_copy import unsharded_copy
    net = _mlp()
    calls = []
    net[1].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    head = torch.nn.Linear(4, 4)
    net.append(head)
    net.add_module("again", head)  # shared: one module under two names
    mesh = _mesh(world)
    fully_shard(net[0], mesh=mesh)
    fully_shard(net, mesh=mesh)
    plain = unsharded_copy(net)
    x = _batch(rank)
    out = plain(x)
    return {"classes": [type(m).__name__ for m in plain.modules()],
            "hooks": len(calls), "shared": plain.again is plain[3],
            "plain": all(type(p) is torch.nn.Parameter for p in plain.parameters()),
            "state": {k: v.clone() for k, v in plain.state_dict().items()}, "out": out.detach()}


def test_unsharded_copy_is_the_plain_model_with_the_users_hooks():
    from ranks import on_ranks
    found = on_ranks(_copy_ranks, 2)
    net = _mlp()
    net.append(torch.nn.Linear(4, 4))
    net.add_module("again", net[3])
    for rank, copy in enumerate(found):
        assert copy["classes"] == ["Sequential", "Linear", "Tanh", "Linear", "Linear"]
        assert copy["hooks"] == 1 and copy["shared"] and copy["plain"]
        reference = net.state_dict()
        assert list(copy["state"]) == list(reference)
        assert all(torch.equal(copy["state"][k], v) for k, v in reference.items())
        assert torch.equal(copy["out"], net(_batch(rank)))


def _meta_ranks(rank, world):
    from torch.distributed.fsdp import fully_shard
    net = _mlp()
    if rank == 1:
        net = net.to("meta")
    fully_shard(net, mesh=_mesh(world))
    try:
        fxdebug.precision_sensitivity(net, _batch(0))
    except FxdebugError as error:
        return str(error)
    return ""


def test_a_meta_parameter_is_named_on_every_rank():
    from ranks import on_ranks
    messages = on_ranks(_meta_ranks, 2, timeout=60)
    assert messages[0] == messages[1] and "rank 1" in messages[0]
    assert "'0.weight'" in messages[0] and "meta device" in messages[0]


def _refused(rank, world):
    net = _tp(_mlp(), _mesh(world))
    try:
        fxdebug.fake_precision(net, ["0"], "float8_e4m3fn")
    except FxdebugError as error:
        return str(error)
    return ""


def test_fake_precision_is_refused_and_points_at_the_sensitivity():
    from ranks import on_ranks
    for message in on_ranks(_refused, 2):
        assert "sharded" in message and "precision_sensitivity" in message
        assert "full_state_dict" in message


def test_a_sharded_report_chooses_on_every_rank():
    from ranks import on_ranks
    found = on_ranks(_choose_ranks, 2)
    assert found[0] == found[1]
    plain = fxdebug.precision_sensitivity(_mlp(), _batch(0), loss=_loss,
                                          dtypes=("float8_e4m3fn",))
    choice = plain.choose(budget=2, relative_to="autocast")
    assert found[0][0] == list(choice.keys)
    assert math.isclose(found[0][1], choice.measured["loss"], rel_tol=1e-12)


def _choose_ranks(rank, world):
    net = _tp(_mlp(), _mesh(world))
    rep = fxdebug.precision_sensitivity(net, _batch(0), loss=_loss, dtypes=("float8_e4m3fn",))
    choice = rep.choose(budget=2, relative_to="autocast")
    return list(choice.keys), choice.measured["loss"]


class _Heads(torch.nn.Module):
    """Two heads of 8 from ``q``; a tensor-parallel plan that splits ``q`` by columns must
    set ``heads`` to this rank's count, so the module computes another function when whole."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q, self.out, self.heads = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8), 2

    def forward(self, x):
        h = self.q(x)
        return self.out(h.unflatten(-1, (self.heads, -1)).softmax(-1).flatten(-2))


def _attribute_plan_ranks(rank, world):
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    net = _Heads()
    plain_out = net(_batch(0))
    parallelize_module(net, _mesh(world), {"q": ColwiseParallel(), "out": RowwiseParallel()})
    net.heads = 2 // world  # the plan's attribute change: this rank's heads
    same = torch.allclose(net(_batch(0)), plain_out, atol=1e-6)  # the sharded model is right
    try:
        fxdebug.precision_sensitivity(net, _batch(0), loss=_loss, dtypes=("bfloat16",))
    except FxdebugError as error:
        return same, str(error)
    return same, ""


def test_a_plan_that_changes_module_attributes_is_refused_not_measured():
    from ranks import on_ranks
    found = on_ranks(_attribute_plan_ranks, 2)
    assert all(same for same, _ in found)
    assert found[0][1] == found[1][1] and "does not compute what the sharded model" in found[0][1]
    assert "full_state_dict" in found[0][1]


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) + torch.randn_like(x)  # random in eval mode too


def test_eval_outputs_leave_the_rng_and_modes_as_they_were():
    from fxdebug.distributed.unsharded_copy import eval_outputs
    net, x = _Noisy(), torch.ones(2, 4)
    state = torch.get_rng_state()
    first, second = eval_outputs(net, (x,)), eval_outputs(net, (x,))
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random state untouched
    assert torch.equal(first[0], second[0])  # both from the caller's state
    torch.set_rng_state(state)
    with torch.no_grad():  # ... which is the state a plain call starts from
        assert torch.equal(net.lin(x) + torch.randn_like(x), first[0])
    assert net.training and net.lin.training
