"""Captures of tensor- and sequence-parallel models know their placement; full() assembles them.

On 2 and 4 gloo ranks. Ground truth is computed another way on every rank:
- values: forward hooks on the unsharded model (same weights, same full input);
- DTensor captures: their own ``full_tensor()`` and the placements a forward hook on a
  sharded twin sees;
- placements of local tensors: what torch documents each ParallelStyle hands on
  (ColwiseParallel Shard(-1), RowwiseParallel Replicate or its output_layouts,
  SequenceParallel Shard(sequence_dim));
- compare_ranks: the tensors themselves all-gathered and compared with torch.equal.
"""

from __future__ import annotations

import copy

import pytest
import torch

import fxdebug
from ranks import on_ranks
from tp_models import D, Net

SEQ = 4


def full_input(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(seed))


def hooked_outputs(model):
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if name and not isinstance(module, torch.nn.ModuleList):
            module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))
    return seen


def plan(kind: str):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    styles = {}
    for i in range(2):
        if kind == "colrow":
            styles.update({f"blocks.{i}.fc1": ColwiseParallel(),
                           f"blocks.{i}.fc2": RowwiseParallel()})
        elif kind == "colrow-dtensor":  # fc1 hands fc2 a DTensor
            styles.update({f"blocks.{i}.fc1": ColwiseParallel(use_local_output=False),
                           f"blocks.{i}.fc2": RowwiseParallel()})
        else:  # sequence parallel: the norm's output sharded on the sequence
            local = kind == "sequence-local"
            styles.update({f"blocks.{i}.norm": SequenceParallel(use_local_output=local),
                           f"blocks.{i}.fc1": ColwiseParallel(input_layouts=Shard(1)),
                           f"blocks.{i}.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return styles


# what each capture must say, per plan: (placement text, a DTensor?)
EXPECTED = {
    "colrow": {"norm": ("local?", False), "fc1": ("S(2)@tp", False), "fc2": ("R", False),
               "": ("local?", False)},
    "colrow-dtensor": {"norm": ("local?", False), "fc1": ("S(2)@tp", True), "fc2": ("R", False),
                       "": ("local?", False)},
    "sequence": {"norm": ("S(1)@tp", True), "fc1": ("S(2)@tp", False), "fc2": ("S(1)@tp", False),
                 "": ("local?", False)},
    "sequence-local": {"norm": ("S(1)@tp", False), "fc1": ("S(2)@tp", False),
                       "fc2": ("S(1)@tp", False), "": ("local?", False)},
}


def _tensor_parallel(rank, world, kind):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Net()
    unsharded = copy.deepcopy(model)
    reference = hooked_outputs(unsharded)
    x = full_input()
    expected_out = unsharded(x)
    parallelize_module(model, mesh, plan(kind))
    twin = copy.deepcopy(model)  # deepcopy keeps the hooks: the sharded twin runs eagerly
    twin_seen = hooked_outputs(twin)
    sequence = kind.startswith("sequence")
    mine = x.chunk(world, dim=1)[rank] if sequence else x  # SP: each rank its sequence piece
    twin(mine)
    gm = fxdebug.instrument(model)
    out = gm(mine)
    torch.testing.assert_close(out, expected_out.chunk(world, dim=1)[rank] if sequence
                               else expected_out)
    rec = fxdebug.records(gm)
    table = rec.table(wide=True)
    for key in rec.keys():
        record = rec.record(key)
        part = key.rsplit(".", 1)[1] if key.startswith("blocks.") and key.count(".") == 2 else ""
        text, is_dtensor = EXPECTED[kind][part] if key != "head" else ("local?", False)
        assert record.placement is not None and record.placement.text == text, (key, record)
        assert isinstance(rec[key], DTensor) == is_dtensor, key
        assert isinstance(twin_seen[key], DTensor) == is_dtensor, key
        if is_dtensor:  # exact: the placements torch itself gave the module's output
            assert rec[key].placements == twin_seen[key].placements, key
            assert record.placement.global_shape == tuple(twin_seen[key].shape)
            torch.testing.assert_close(rec[key].full_tensor(), reference[key])
        assert text in table and repr(record).count(record.placement.describe()) == 1
        if text == "local?":
            assert "placement unknown" in repr(record)
            if sequence:  # each rank its own piece: never guessed into a whole
                with pytest.raises(fxdebug.FxdebugError, match=r"ranks hold \d+ different "
                                                              r"values.*use_local_output=False"):
                    rec.full(key)
            else:  # replicated here: every rank holds the same bits, that value is the whole
                torch.testing.assert_close(rec.full(key), reference[key])
                torch.testing.assert_close(rec[key], reference[key])
            continue
        assert record.placement.mesh_dims == (("tp", world),)
        full = rec.full(key)  # a collective: every rank, same keys, same order
        torch.testing.assert_close(full, reference[key], msg=key)
        assert record.placement.global_shape == tuple(reference[key].shape)
        if text.startswith("S("):  # this rank's piece is the truth's rank-th chunk
            dim = int(text[2])
            torch.testing.assert_close(rec[key] if not is_dtensor else rec[key].to_local(),
                                       reference[key].chunk(world, dim=dim)[rank])
    return rec.keys()


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind", ["colrow", "colrow-dtensor", "sequence", "sequence-local"])
def test_tensor_parallel_captures_know_placement_and_full_equals_unsharded(world, kind):
    keys = on_ranks(_tensor_parallel, world, kind)
    assert all(k == keys[0] for k in keys) and "blocks.1.fc1" in keys[0]


def _fsdp_tp(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Net()
    unsharded = copy.deepcopy(model)
    reference = hooked_outputs(unsharded)
    x = full_input(seed=10 + mesh.get_coordinate()[0])  # each data-parallel rank its batch
    unsharded(x)
    parallelize_module(model, mesh["tp"], plan("colrow"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    gm = fxdebug.instrument(model)
    gm(x)
    rec = fxdebug.records(gm)
    placed = {}
    for key in rec.keys():
        text = rec.record(key).placement.text
        placed[key] = text
        if text == "local?":
            torch.testing.assert_close(rec[key], reference[key])
        else:
            torch.testing.assert_close(rec.full(key), reference[key], msg=key)
    return placed


def test_fsdp_and_tensor_parallel_on_a_2d_mesh_captures_equal_unsharded():
    results = on_ranks(_fsdp_tp, 4)
    assert all(r == results[0] for r in results)
    assert results[0]["blocks.0.fc1"] == "S(2)@tp" and results[0]["blocks.1.fc2"] == "R"


def differing(named) -> list[str]:
    """Keys whose tensor is not bitwise equal on every rank: the tensors themselves gathered."""
    import torch.distributed as dist
    found = []
    for key, tensor in named:
        tensor = tensor.detach()
        tensor = (tensor.to_local() if hasattr(tensor, "to_local") else tensor).contiguous()
        gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, tensor)
        if not all(torch.equal(gathered[0], other) for other in gathered[1:]):
            found.append(key)
    return found


def _layernorm_out_of_sync(rank, world, kind, odd):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Net()
    parallelize_module(model, mesh, plan(kind))
    gm = fxdebug.instrument(model)
    sequence = kind.startswith("sequence")
    x = full_input().chunk(world, dim=1)[rank] if sequence else full_input()
    gm(x)
    rec = fxdebug.records(gm)
    before = (fxdebug.compare_ranks(rec), fxdebug.compare_ranks(model))
    sharded_pieces_differ = differing([(k, rec[k]) for k in rec.keys()
                                       if rec.record(k).placement.text.startswith("S(")])
    norm = model.blocks[1].norm.weight
    with torch.no_grad():
        if rank == odd:
            (norm.to_local() if hasattr(norm, "to_local") else norm)[3] += 0.5
    truth = differing([("blocks.1.norm.weight", norm)])
    gm(x)
    after = (fxdebug.compare_ranks(fxdebug.records(gm)), fxdebug.compare_ranks(model))
    first = after[1].first_divergence
    return ([(r.verdict_text, r.first_divergence) for r in before], sharded_pieces_differ,
            truth, (first.key, first.ranks), after[0].verdict_text in ("INCOMPLETE",
                                                                       "NOTHING TO COMPARE"),
            {e.key: (e.status, e.majority) for e in after[0].entries})


@pytest.mark.parametrize("world,kind", [(2, "colrow"), (4, "colrow"), (4, "sequence")])
def test_compare_ranks_names_the_layernorm_weight_out_of_sync_on_one_tp_rank(world, kind):
    odd = world - 1
    for before, sharded_differ, truth, weights, activations_ok, status in on_ranks(
            _layernorm_out_of_sync, world, kind, odd):
        # sharded pieces differ, not compared: the verdict says so, never EQUAL (under sequence
        # parallelism every capture is a piece: nothing to compare)
        records = "NOTHING TO COMPARE" if kind == "sequence" else "INCOMPLETE"
        assert before == [(records, None), ("INCOMPLETE", None)]
        assert sharded_differ  # ground truth: the pieces do differ across the group
        assert truth == ["blocks.1.norm.weight"]
        assert weights == ("blocks.1.norm.weight", (odd,))
        # activations: the sharded ones and those of unknown placement are not compared;
        # the replicated ones are, on every rank (the all-reduce makes them equal again)
        assert activations_ok
        assert status["blocks.1.fc1"][0] == "one copy"
        if kind == "colrow":
            assert status["blocks.1.fc2"] == ("equal", tuple(range(world)))
            assert status["blocks.1.norm"][0] == "one copy"


def _pipelined(rank, world):
    from torch.distributed.pipelining import SplitPoint, pipeline
    torch.manual_seed(0)
    model = Net()
    x = full_input()
    pipe = pipeline(model, mb_args=(x,), split_spec={"blocks.1": SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    messages = []
    for obj in (pipe, stage):
        for call in (fxdebug.instrument, fxdebug.trace):
            with pytest.raises(fxdebug.FxdebugError) as info:
                call(obj)
            messages.append(str(info.value))
    # what the message says works: the stage's own module, instrumented
    gm = fxdebug.instrument(pipe.get_stage_module(rank))
    return messages, type(gm).__name__


def test_pipeline_parallelism_stops_with_an_error_that_says_what_works():
    for messages, instrumented in on_ranks(_pipelined, 2):
        assert len(messages) == 4 and instrumented
        for message in messages:
            assert "pipeline parallelism" in message and "get_stage_module" in message
        assert messages[0].startswith("fxdebug.instrument: Pipe is pipeline parallelism")
