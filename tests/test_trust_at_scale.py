"""No verdict on what was not compared, on real model families under real parallelism plans.

timm's MlpMixer under tensor parallelism (a correct plan, and one whose RowwiseParallel is
given ``output_layouts=Partial()``: its all-reduce never runs), a tiny Hugging Face Llama with
a hand-written TP plan, and the residual MLP of ``tp_models`` on a 2x2 (dp x tp) mesh with a
batch per dp group. Ground truth is computed another way: forward hooks on the unsharded
model, the model's own outputs, ``DTensor.full_tensor()``, and the planted change itself.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import fxdebug
from fxdebug.cli import main as cli
from ranks import on_ranks
from tp_models import D, Net


def _quiet():
    warnings.simplefilter("ignore")  # transformers, timm and FSDP2 are chatty on the CPU


def hooked(model: torch.nn.Module) -> dict:
    """Every module's output by path (forward hooks: the ground truth for captures)."""
    seen: dict = {}
    for name, module in model.named_modules():
        if name:
            module.register_forward_hook(
                lambda m, args, out, name=name: seen.__setitem__(name, out))
    return seen


# -- timm MlpMixer under TP=2: a missing all-reduce --------------------------------------
def mixer() -> torch.nn.Module:
    from timm.models.mlp_mixer import MlpMixer
    torch.manual_seed(0)
    model = MlpMixer(num_classes=10, img_size=32, patch_size=8, num_blocks=2, embed_dim=64).eval()
    torch.nn.init.normal_(model.head.weight, std=0.2)  # timm starts the head at zero
    return model


def mixer_plan(missing_all_reduce: bool) -> dict:
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.mlp_channels.fc1"] = ColwiseParallel()
        plan[f"blocks.{i}.mlp_channels.fc2"] = (
            RowwiseParallel(output_layouts=Partial()) if missing_all_reduce and i == 1
            else RowwiseParallel())
    return plan


def _mixer_tp(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    _quiet()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    original = mixer()
    truth = original(x)
    gm = fxdebug.instrument(copy.deepcopy(original))
    gm(x)
    unsharded = fxdebug.records(gm)
    fxdebug.save_records(unsharded, f"{folder}/unsharded")
    found = {}
    for name, bug in (("correct", False), ("bug", True)):
        model = parallelize_module(copy.deepcopy(original), mesh, mixer_plan(bug))
        logits_error = float((model(x) - truth).abs().max())  # ground truth: is it wrong?
        gm = fxdebug.instrument(model, folder=f"{folder}/{name}")
        gm(x)
        fxdebug.records(gm)
        live = fxdebug.compare_runs(unsharded, fxdebug.records(gm))  # a collective
        found[name] = (logits_error, _summary(live))
    return found


def _summary(report) -> dict:
    first = report.first_divergence
    return {"ok": report.ok, "verdict": report.verdict_text, "complete": report.complete,
            "entries": [(e.key, e.status, e.ranks, e.layout) for e in report.entries],
            "first": None if first is None else (first.key, first.ranks, first.detail),
            "dict": report.to_dict()}


def _check_mixer(found: dict, logits_error: float) -> None:
    if logits_error < 1e-4:  # the correct plan: every key compared, and it agrees
        assert found["ok"] and found["verdict"] == "EQUAL" and found["complete"], found
        assert found["dict"]["not_compared"] == [] and found["dict"]["verdict"] == "EQUAL"
        return
    assert not found["ok"] and found["verdict"] == "DIFFERENT"
    key, ranks, detail = found["first"]
    assert key.startswith("blocks.1"), key  # inside the block whose all-reduce is missing
    assert ranks == (0, 1) and "unreduced terms of a sum" in detail, found["first"]
    keys = [k for k, *_ in found["entries"]]
    earlier = found["entries"][:keys.index(key)]
    assert earlier and all(s in ("equal", "close") for _, s, _, _ in earlier), earlier
    # the pending sum itself was resolved as one (its ranks' terms sum to the truth)
    assert any(layout == "P" for _, _, _, layout in earlier)


def test_mixer_missing_all_reduce_named_in_its_block_live_saved_and_cli(tmp_path, capsys):
    pytest.importorskip("timm")
    folder = str(tmp_path)
    results = on_ranks(_mixer_tp, 2, folder, timeout=300)
    for rank_found in results:
        correct_error, correct = rank_found["correct"]
        bug_error, bug = rank_found["bug"]
        assert correct_error < 1e-4 < 0.1 < bug_error  # the planted bug changes the logits
        _check_mixer(correct, correct_error)
        _check_mixer(bug, bug_error)
    for name, error in (("correct", 0.0), ("bug", 1.0)):
        saved = _summary(fxdebug.compare_runs(f"{folder}/unsharded", f"{folder}/{name}"))
        _check_mixer(saved, error)
        capsys.readouterr()
        code = cli(["compare", f"{folder}/unsharded", f"{folder}/{name}"])
        out = capsys.readouterr().out
        assert code == (1 if name == "bug" else 0), out
        assert ("verdict: DIFFERENT" if name == "bug" else "verdict: EQUAL: all") in out


# -- dp x tp on a 2x2 mesh: a batch per dp group -------------------------------------------
def _dp_tp(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    _quiet()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    original = Net()
    joined = torch.randn(4, 4, D, generator=torch.Generator().manual_seed(1))
    mine = joined.chunk(2)[mesh.get_coordinate()[0]]  # this dp group's batch
    gm = fxdebug.instrument(copy.deepcopy(original))
    gm(joined)
    unsharded = fxdebug.records(gm)
    model = copy.deepcopy(original)  # before the hooks: a deep copy would take them along
    truth = hooked(original)
    original(mine)
    plan = {}
    for i in range(2):
        plan[f"blocks.{i}.fc1"], plan[f"blocks.{i}.fc2"] = ColwiseParallel(), RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    gm = fxdebug.instrument(model, folder=folder)
    gm(mine)
    fxdebug.records(gm)
    rec = fxdebug.records(gm)  # read back from disk: no DeviceMesh kept
    fulls = {}
    for key in rec.keys():  # full(): a collective, every rank the same keys in order
        placement = rec.record(key).placement
        try:
            value = rec.full(key)
            fulls[key] = ("full", float((value - truth[key]).abs().max()))
        except fxdebug.FxdebugError as exc:
            fulls[key] = ("raised", placement.text, str(exc))
    return _summary(fxdebug.compare_runs(unsharded, fxdebug.records(gm))), fulls


def test_dp_x_tp_with_a_batch_per_dp_group_is_compared_key_by_key_and_full_works(tmp_path):
    results = on_ranks(_dp_tp, 4, str(tmp_path / "dp_tp"), timeout=300)
    for found, fulls in results:
        # every key compared: the dp groups' batches joined along dim 0 equal the unsharded run
        assert found["ok"] and found["verdict"] == "EQUAL" and found["complete"], found
        layouts = {key: layout for key, _, _, layout in found["entries"]}
        assert layouts["head"].startswith("S(0)"), layouts
        for key, outcome in fulls.items():
            if outcome[0] == "full":  # a known placement, assembled on its tp group
                assert outcome[1] <= 1e-5, (key, outcome)
            else:  # unknown placement, different batches across dp groups: never guessed
                assert outcome[1] == "local?" and "different values" in outcome[2], outcome
        assert fulls["blocks.0.fc1"][0] == "full" and fulls["blocks.1.fc2"][0] == "full"
    # saved by every rank, read in one process: the same verdict
    saved = fxdebug.compare_runs(fxdebug.load_records(str(tmp_path / "dp_tp")),
                                 fxdebug.load_records(str(tmp_path / "dp_tp")))
    assert saved.verdict_text in ("EQUAL", "INCOMPLETE")  # no unsharded run: nothing to
    # resolve unknown placements against, so they are "not assembled", never "equal"
    assert saved.verdict_text == "INCOMPLETE" and not saved.ok
    assert all(e.status == "unassembled" for e in saved.not_compared)


# -- one rank's shard scaled, judged by a float64 reference -----------------------------------
def _scaled_shard(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    original = Net()
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1))
    gm = fxdebug.instrument(copy.deepcopy(original))
    gm(x)
    a = fxdebug.records(gm)
    gm = fxdebug.instrument(copy.deepcopy(original).double())
    gm(x.double())
    reference = fxdebug.records(gm)
    model = parallelize_module(copy.deepcopy(original), mesh, {
        f"blocks.{i}.{n}": (ColwiseParallel() if n == "fc1" else RowwiseParallel())
        for i in range(2) for n in ("fc1", "fc2")})
    weight = model.blocks[1].fc1.weight
    with torch.no_grad():
        if rank == 1:
            weight.to_local()[:, :].mul_(1.0002)  # small: within float32's tolerances
    changed = weight.full_tensor() != original.blocks[1].fc1.weight  # ground truth
    rows = changed.any(dim=1).nonzero().flatten().tolist()
    gm = fxdebug.instrument(model)
    gm(x)
    plain = fxdebug.compare_runs(a, fxdebug.records(gm))
    judged = fxdebug.compare_runs(a, fxdebug.records(gm), reference=reference)
    return rows, _summary(plain), _summary(judged)


def test_one_ranks_scaled_shard_is_named_with_that_rank_by_a_reference():
    for rows, plain, judged in on_ranks(_scaled_shard, 2, None, timeout=300):
        # ColwiseParallel: rank 1 holds the second half of fc1's output features
        assert rows and min(rows) >= 4 * D // 2, rows
        assert not judged["ok"] and judged["verdict"] == "DIFFERENT"
        key, ranks, _ = judged["first"]
        assert key == "blocks.1.fc1" and ranks == (1,), judged["first"]
        keys = [k for k, *_ in judged["entries"]]
        assert all(s in ("equal", "rounding") for _, s, _, _ in
                   judged["entries"][:keys.index(key)])


# -- across dtypes: the first divergence is the first key rounding cannot explain ----------
def test_across_dtypes_the_first_divergence_is_the_first_beyond_rounding():
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(64, 64), torch.nn.GELU())]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(32, 64)
    gm = fxdebug.instrument(copy.deepcopy(model))
    gm(x)
    a = fxdebug.records(gm)
    broken = copy.deepcopy(model).bfloat16()
    with torch.no_grad():
        broken[4].weight.mul_(1.5)  # the bug: 50 %, far beyond bfloat16's rounding
    gm = fxdebug.instrument(broken)
    gm(x.bfloat16())
    report = fxdebug.compare_runs(a, fxdebug.records(gm))
    # ground truth: what bfloat16 alone does to the same model, key by key
    gm = fxdebug.instrument(copy.deepcopy(model).bfloat16())
    gm(x.bfloat16())
    rounding_only = fxdebug.compare_runs(a, fxdebug.records(gm))
    assert rounding_only.rounding.explained  # bfloat16 alone: every difference is rounding
    keys = [e.key for e in rounding_only.entries]
    rounding_keys = [e.key for e in rounding_only.divergences]  # beyond bfloat16's tolerances
    assert rounding_keys and keys.index(rounding_keys[0]) < keys.index("4")
    assert report.first_divergence.key == "4" and report.first_divergence.beyond_rounding
    assert "first beyond rounding: 4 " in report.table(wide=True)


# -- the command line: a verdict that did not compare every key exits 3 --------------------
def _batches(rank, world, folder):
    gm = fxdebug.instrument(Net(), folder=folder)
    gm(torch.randn(2, 4, D) + rank)  # data parallel: each rank its own batch
    fxdebug.records(gm)
    torch.distributed.barrier()


def test_cli_exit_status_3_when_keys_could_not_be_compared(tmp_path, capsys):
    folder = str(tmp_path / "dp")
    on_ranks(_batches, 2, folder)
    code = cli(["compare", folder, folder])  # nothing to resolve the batches against
    out = capsys.readouterr().out
    assert code == 3, out
    assert "verdict: INCOMPLETE" in out and "first not compared: blocks.0.norm" in out
    assert "9 not: 9 not assembled" in out
    report = fxdebug.compare_runs(folder, folder)
    assert report.to_dict()["verdict"] == "INCOMPLETE" and report.to_dict()["compared"] == 0
    assert os.path.isdir(os.path.join(folder, "rank-1"))


# -- a tiny HF Llama under a correct TP plan: one key per module call, each assembled once ----
def _llama_tp(rank, world):
    from sharded_families import configure, make
    _quiet()
    model, inputs = make("llama")
    truth = hooked(copy.deepcopy(model))
    twin = copy.deepcopy(model)
    for name, module in twin.named_modules():  # ground truth: forward hooks, unsharded
        if name:
            module.register_forward_hook(lambda m, a, out, name=name: truth.__setitem__(name, out))
    twin(*inputs)
    gm = fxdebug.instrument(copy.deepcopy(model))
    gm(*inputs)
    unsharded = fxdebug.records(gm)
    gm = fxdebug.instrument(copy.deepcopy(model).double())
    gm(*inputs)
    reference = fxdebug.records(gm)
    sharded = configure(copy.deepcopy(model), "llama", "tp", world)
    gm = fxdebug.instrument(sharded)
    gm(*inputs)
    rec = fxdebug.records(gm)
    live = fxdebug.compare_runs(unsharded, rec, reference=reference)  # a collective
    errors = {}
    for key in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj",
                "model.layers.1.mlp.up_proj"):  # one a DTensor, two inside traced parts
        errors[key] = (rec.record(key).placement.text,
                       float((rec.full(key) - truth[key]).abs().max()))
    return _summary(live), unsharded.keys(), errors


def test_llama_under_tensor_parallelism_compares_every_key_and_full_values_are_whole():
    pytest.importorskip("transformers")
    for found, keys, errors in on_ranks(_llama_tp, 2, timeout=300):
        assert found["ok"] and found["verdict"] == "EQUAL" and found["complete"], found["first"]
        assert [k for k, *_ in found["entries"]] == keys  # the same keys, whatever the front end
        assert "model.layers.0.self_attn/1" in keys  # attention weights the caller ignores
        for key, (placement, error) in errors.items():  # ColwiseParallel: shards along dim 2
            assert placement.startswith("S(2)@") and error <= 1e-5, (key, placement, error)


# -- every error's "Fix" is one the user can do: each fix called as it says -----------------
def _fixes_that_work(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    _quiet()
    said = {}
    torch.manual_seed(0)
    original = Net()
    x = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(1 + rank))  # own batches
    # 1. export refuses an FSDP2 model; its fix: the default front end
    model = copy.deepcopy(original)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    with pytest.raises(fxdebug.FxdebugError) as refused:
        fxdebug.trace(model, x, frontend="export")
    said["export"] = str(refused.value)
    gm = fxdebug.instrument(model)  # what the fix says
    torch.testing.assert_close(gm(x), copy.deepcopy(original)(x))
    # 2. full() of a local tensor whose ranks differ; fixes: compare_runs against the unsharded
    #    run, or use_local_output=False so the output is a DTensor
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    same = torch.randn(2, 4, D, generator=torch.Generator().manual_seed(7))  # every rank
    key = "blocks.0.fc1"
    plan = {"blocks.0.fc1": ColwiseParallel(), "blocks.0.fc2": RowwiseParallel()}
    local = fxdebug.instrument(parallelize_module(copy.deepcopy(original), mesh, plan),
                               capture="all")
    local(same)
    rec = fxdebug.records(local)
    relu = next(k for k in rec.keys() if k.startswith("blocks.0") and "relu" in k)
    with pytest.raises(fxdebug.FxdebugError) as differ:
        rec.full(relu)  # ColwiseParallel's local output, through relu: each rank its half
    said["full"] = str(differ.value)
    gm = fxdebug.instrument(copy.deepcopy(original), capture="all")
    gm(same)
    report = fxdebug.compare_runs(fxdebug.records(gm), rec)  # fix 1, as the error says
    entry = next(e for e in report.entries if e.key == relu)
    fixed = {"blocks.0.fc1": ColwiseParallel(use_local_output=False),
             "blocks.0.fc2": RowwiseParallel()}
    dtensor = fxdebug.instrument(parallelize_module(copy.deepcopy(original), mesh, fixed))
    dtensor(same)
    whole = fxdebug.records(dtensor).full(key)  # fix 2, as the error says
    expected = copy.deepcopy(original).blocks[0].fc1(
        copy.deepcopy(original).blocks[0].norm(same))
    return said, (entry.status, entry.layout), float((whole - expected).abs().max())


def test_each_fix_an_error_gives_works_when_called_as_it_says():
    for said, (status, layout), error in on_ranks(_fixes_that_work, 2, timeout=300):
        assert "Fix: leave frontend at its default: fxdebug.instrument(model)" in said["export"]
        assert "fxdebug.compare_runs(unsharded_records, records)" in said["full"]
        assert "use_local_output=False" in said["full"]
        assert status in ("equal", "close") and layout == "S(2)", (status, layout)
        assert error <= 1e-5


def test_a_failure_inside_torch_fx_gives_fixes_that_work_on_a_hf_model():
    pytest.importorskip("transformers")
    from sharded_families import make, output_tensor
    with warnings.catch_warnings():
        _quiet()
        model, inputs = make("llama")
        expected = output_tensor(model(*inputs))
        with pytest.raises(fxdebug.TraceFailure) as failed:
            fxdebug.trace(model)  # a decorated forward torch.fx cannot rebuild: no user line
        text = str(failed.value)
        assert "Rewrite the statement" not in text and "inside torch.fx" in text
        assert "frontend='export'" in text and "fxdebug.instrument(model)" in text
        exported = fxdebug.trace(model, *inputs, frontend="export")  # the first fix
        torch.testing.assert_close(output_tensor(exported(*inputs)), expected)
        gm = fxdebug.instrument(model)  # the second
        torch.testing.assert_close(output_tensor(gm(*inputs)), expected)
        assert "model.layers.0.self_attn/1" in fxdebug.records(gm).keys()
