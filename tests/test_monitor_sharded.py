"""fxdebug.monitor's global series under FSDP2, tensor parallelism and FSDP x TP on gloo ranks
equal the statistics of the unsharded model on the concatenated global batch.

Ground truth, computed another way on every rank: an unsharded copy of the model (same
weights) trained eagerly on the concatenation of the ranks' batches (each data-parallel rank
its own batch; the ranks of one tensor-parallel group the same one), its module outputs kept
by forward hooks with ``retain_grad``, its parameters and their gradients read after
``backward()``, its updates as the parameters' change across ``optimizer.step()``, all
summarized with float64 torch ops. With a mean loss over each rank's batch, a rank's
activation gradients are ``world_dp`` times the unsharded model's (its loss is the mean over
the global batch), so the reference's are scaled by ``world_dp``.
"""

from __future__ import annotations

import copy
import warnings

import torch

import fxdebug
from fxdebug.monitoring.selection import selected_modules
from fxdebug.runtime.values import named_leaves
from ranks import on_ranks
import sharded_families as families
from test_monitor import check_series, reference

D = 8
LR = 0.05


def _barrier():
    import torch.distributed as dist
    dist.barrier()  # the group's first rank wrote global.jsonl before anyone reads it


def hooked_leaves(model: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """Forward hooks keeping every tensor of each named module's output (``path/0`` for a part
    of a tuple), with retain_grad for its gradient."""
    kept: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name in names:
        def hook(module, args, output, name=name):
            for key, leaf in named_leaves(output, name):
                if isinstance(leaf, torch.Tensor):
                    if leaf.requires_grad:
                        leaf.retain_grad()
                    kept[key] = leaf
        modules[name].register_forward_hook(hook)
    return kept


def truth(model, batches, names, every, world_dp, loss_of):
    """The unsharded model trained with SGD on the global batches: {step: {name: stats}}."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    kept = hooked_leaves(model, names)
    modules = dict(model.named_modules())
    expected: dict[int, dict[str, dict[str, float]]] = {}
    for step, batch in enumerate(batches):
        kept.clear()
        loss = loss_of(model(*batch))
        loss.backward()
        before = {}
        if step % every == 0:
            found = expected.setdefault(step, {})
            for key, value in kept.items():
                found[f"{key}.out"] = reference(value)
                if value.grad is not None:
                    found[f"{key}.grad"] = reference(value.grad * world_dp)
            for name in names:
                own = [p for p in modules[name].parameters(recurse=False) if p.requires_grad]
                if own:
                    found[f"{name}.param"] = reference(torch.cat([p.reshape(-1) for p in own]))
                    found[f"{name}.param_grad"] = reference(
                        torch.cat([p.grad.reshape(-1) for p in own]))
                    if step + 1 < len(batches):  # measured at the next step() call
                        before[name] = [p.detach().clone() for p in own]
            # one loss per data-parallel rank: their mean is the global batch's loss
            found["loss.out"] = {"count": float(world_dp), "mean": loss.item()}
        optimizer.step()
        optimizer.zero_grad()
        for name, kept_params in before.items():
            own = [p for p in modules[name].parameters(recurse=False) if p.requires_grad]
            expected[step][f"{name}.update"] = reference(
                torch.cat([(p - b).reshape(-1) for p, b in zip(own, kept_params)]))
    return expected


def train(model, batches, every, loss_of, folder, select=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with fxdebug.monitor(model, every=every, folder=folder, select=select) as mon:
        for batch in batches:
            loss = loss_of(mon.model(*batch))
            loss.backward()
            mon.step(loss)
            optimizer.step()
            optimizer.zero_grad()
    _barrier()
    return mon


def global_names(series) -> set:
    return {name for rows in series._global.values() for name in rows}


def expected_names(expected) -> set:
    return {name for found in expected.values() for name in found}


def mean_loss(output) -> torch.Tensor:
    return families.output_tensor(output).float().pow(2).mean()


# -- FSDP2 on 2 ranks ------------------------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.fc1 = torch.nn.Linear(D, 2 * D)
        self.act = torch.nn.GELU()
        self.fc2 = torch.nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.head = torch.nn.Linear(D, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _fsdp(rank, world, folder, config):
    from torch.distributed.fsdp import fully_shard
    model = MLP()
    whole = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    batches = [torch.randn(3 * world, D, generator=generator) for _ in range(5)]
    mesh = families.mesh_for(config, world)  # hsdp: (replicate, shard) = (world // 2, 2)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert len(model.head.weight.placements) == mesh.ndim  # a DTensor: pooled by placement
    mon = train(model, [(b[3 * rank:3 * (rank + 1)],) for b in batches], 2, mean_loss, folder)
    names = [name for name, _ in whole.named_modules() if name]
    expected = truth(whole, [(b,) for b in batches], names, 2, world, mean_loss)
    series = fxdebug.load_series(folder)
    check_series(series, expected)
    assert global_names(series) == expected_names(expected)
    return mon.notes


def test_fsdp2_global_series_equal_the_unsharded_models_on_the_concatenated_batch(tmp_path):
    assert on_ranks(_fsdp, 2, str(tmp_path), "fsdp") == [[], []]


def test_hsdp_counts_the_replicated_shards_once(tmp_path):
    assert on_ranks(_fsdp, 4, str(tmp_path), "hsdp") == [[]] * 4


# -- tensor parallelism on 2 ranks: local, DTensor, replicated and pending-sum outputs -------

class Settle(torch.nn.Module):
    """A DTensor's full value, plain (the unsharded model's values pass as they are)."""

    def forward(self, x):
        return x.full_tensor() if hasattr(x, "full_tensor") else x


class TPNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(D)          # plain, replicated: counts once
        self.up = torch.nn.Linear(D, 4 * D)        # Colwise, local Shard(-1) output
        self.act = torch.nn.GELU()                 # local, layout undeclared: a shard
        self.down = torch.nn.Linear(4 * D, D)      # Rowwise, local Replicate output
        self.gate = torch.nn.Linear(D, 4 * D)      # Colwise, DTensor Shard(-1) output
        self.act2 = torch.nn.ReLU()                # DTensor in, DTensor out
        self.proj = torch.nn.Linear(4 * D, D)      # Rowwise, DTensor Replicate output
        self.part = torch.nn.Linear(4 * D, D)      # Rowwise, DTensor Partial: left out
        self.settle = Settle()                     # plain, replicated (layout undeclared)
        self.settle2 = Settle()
        self.head = torch.nn.Linear(D, 3)          # plain parameters, replicated

    def forward(self, x):
        h = self.norm(x)
        y = self.down(self.act(self.up(h)))
        r = self.act2(self.gate(h))
        return self.head(y + self.settle(self.proj(r)) + self.settle2(self.part(r)))


def _tp_plan():
    from torch.distributed.tensor import Partial, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"up": ColwiseParallel(), "down": RowwiseParallel(),
            "gate": ColwiseParallel(use_local_output=False),
            "proj": RowwiseParallel(input_layouts=Shard(-1), use_local_output=False),
            "part": RowwiseParallel(input_layouts=Shard(-1), output_layouts=Partial(),
                                    use_local_output=False)}


def _tp(rank, world, folder):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    warnings.simplefilter("ignore")
    model = TPNet()
    whole = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(7)
    batches = [(torch.randn(4, D, generator=generator),) for _ in range(5)]  # one batch: tp only
    parallelize_module(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                       _tp_plan())
    mon = train(model, batches, 2, mean_loss, folder)
    names = [name for name, _ in whole.named_modules() if name]
    expected = truth(whole, batches, names, 2, 1, mean_loss)
    # a pending sum's terms make no faithful global value: left out, with a note
    left_out = {"part.out"}
    expected = {step: {name: stats for name, stats in found.items() if name not in left_out}
                for step, found in expected.items()}
    series = fxdebug.load_series(folder)
    check_series(series, expected)
    assert global_names(series) == expected_names(expected)
    assert [note.split(":")[0] for note in mon.notes] == ["part"]
    assert "pending sum (Partial on mesh dim tp)" in mon.notes[0]
    # a rank's own file holds its pieces: the Colwise output's half, the Partial's term
    assert series.get("up", "count", rank=rank)[1][0] == expected[0]["up.out"]["count"] / world
    assert series.get("part", "count", rank=rank)[1][0] == expected[0]["proj.out"]["count"]
    return True


def test_tensor_parallel_global_series_count_replicas_once_and_pool_shards(tmp_path):
    assert on_ranks(_tp, 2, str(tmp_path)) == [True, True]


# -- FSDP x TP on a 2x2 mesh: a Hugging Face Llama ---------------------------------------------

LLAMA_SELECT = ["model.embed_tokens", "model.layers.*", "model.norm", "lm_head"]


def _hugging_face(rank, world, folder, family, config):
    warnings.simplefilter("ignore")
    model, (ids,) = families.make(family)
    model.train()
    whole = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(11)
    # fsdp_tp: mesh (dp, tp) = (world // 2, 2), ranks 2d, 2d + 1 share a batch; tp: one batch
    world_dp, dp = (world // 2, rank // 2) if config == "fsdp_tp" else (1, 0)
    batches = [torch.randint(0, families.VOCAB, (2 * world_dp, families.SEQ),
                             generator=generator) for _ in range(3)]
    families.configure(model, family, config, world)
    mon = train(model, [(b[2 * dp:2 * (dp + 1)],) for b in batches], 2, families.loss_of, folder,
                select=LLAMA_SELECT)
    names = [name for name, _ in selected_modules(whole, LLAMA_SELECT)]
    expected = truth(whole, [(b,) for b in batches], names, 2, world_dp, families.loss_of)
    # fxdebug captures o_proj's output as RowwiseParallel's pending sum, before its hook
    # reduces it (the capture's placement says so): left out of the global series, with a note
    left_out = {f"{note.split(':')[0]}.out" for note in mon.notes}
    assert left_out <= {f"model.layers.{i}.self_attn.o_proj.out" for i in range(2)}, mon.notes
    assert all("pending sum (Partial on mesh dim" in note for note in mon.notes), mon.notes
    expected = {step: {name: stats for name, stats in found.items() if name not in left_out}
                for step, found in expected.items()}
    series = fxdebug.load_series(folder)
    updates = {step: {name: stats for name, stats in found.items() if name.endswith(".update")}
               for step, found in expected.items()}
    check_series(series, {step: {name: stats for name, stats in found.items()
                                 if not name.endswith(".update")}
                          for step, found in expected.items()})
    check_updates(series, updates, expected)
    assert global_names(series) == expected_names(expected)
    return len(left_out)


def check_updates(series, updates, expected):
    """An update is a difference of float32 parameters (after - before): where it is a few ulps
    of the parameter (a norm's weight near 1, moved 1e-6), the two runs' updates differ by an
    ulp here and there. Each stat within 2 ulps of the parameter's largest value."""
    eps = torch.finfo(torch.float32).eps
    for step, found in updates.items():
        for name, stats in found.items():
            key = name.rpartition(".")[0]
            bound = 2 * eps * expected[step][f"{key}.param"]["absmax"]
            for stat in ("mean", "min", "max", "absmax", "rms"):
                steps, values = series.get(key, stat, kind="update")
                found_value = values[steps.index(step)]
                assert abs(found_value - stats[stat]) <= bound + 1e-5 * abs(stats[stat]), (
                    f"{name}.{stat} at step {step}: series {found_value!r}, float64 reference "
                    f"{stats[stat]!r} (rounding bound {bound:.3g})")
            steps, values = series.get(key, "count", kind="update")
            assert values[steps.index(step)] == stats["count"], name


def test_fsdp_x_tp_llama_global_series_equal_the_unsharded_models_on_the_concatenated_batch(
        tmp_path):
    found = on_ranks(_hugging_face, 4, str(tmp_path), "llama", "fsdp_tp", timeout=300)
    assert len(set(found)) == 1, found


def test_tensor_parallel_qwen2_with_the_plan_transformers_ships(tmp_path):
    """``config.base_model_tp_plan`` applied with parallelize_module (``tp_hf``)."""
    found = on_ranks(_hugging_face, 2, str(tmp_path), "qwen2", "tp_hf", timeout=300)
    assert len(set(found)) == 1, found


# -- the update: measured at the next step, reduced and read with the next logged step ---------

def _update_timing(rank, world, folder):
    """Per step() call (and remove()): the all_reduce calls it made, the global lines and the
    callback calls it added; the update of step 0 against the parameters' change."""
    import json
    import os
    import torch.distributed as dist
    calls: list[str] = []
    plain = dist.all_reduce

    def counted(*args, **kwargs):  # the real collective, counted
        calls.append("all_reduce")
        return plain(*args, **kwargs)

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(3 + rank)
    seen: list[tuple[int, bool]] = []
    events = []
    path = os.path.join(folder, "global.jsonl")

    def lines():
        if rank != 0 or not os.path.exists(path):
            return []
        with open(path, encoding="utf-8") as handle:
            return [(entry["step"], sorted({name.rpartition(".")[2] for name in entry["rows"]}))
                    for entry in map(json.loads, handle.read().splitlines())]

    dist.all_reduce = counted
    try:
        mon = fxdebug.monitor(net, every=3, folder=folder, select="0",
                              callback=lambda step, values: seen.append(
                                  (step, "0.update.ratio" in values)))
        for step in range(5):
            net(torch.randn(2, 4, generator=generator)).sum().backward()
            before = (len(calls), len(lines()), len(seen))
            if step == 0:
                kept = [p.detach().clone() for p in net[0].parameters()]
            mon.step()
            events.append((step, len(calls) - before[0], lines()[before[1]:], seen[before[2]:]))
            for p in net.parameters():  # as DDP: every rank's parameters move alike
                plain(p.grad)
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                change = torch.cat([(p - b).reshape(-1) for p, b in zip(net[0].parameters(),
                                                                        kept)])
        before = (len(calls), len(lines()), len(seen))
        mon.remove()
        events.append(("remove", len(calls) - before[0], lines()[before[1]:], seen[before[2]:]))
    finally:
        dist.all_reduce = plain
    dist.barrier()
    series = fxdebug.load_series(folder)
    expected = reference(change)
    steps, values = series.get("0", "rms", kind="update")
    assert steps == [0, 3] and abs(values[0] - expected["rms"]) <= 1e-6 * expected["rms"], (
        values, expected)
    return events


def test_the_update_is_reduced_and_read_with_the_next_logged_step_never_off_steps(tmp_path):
    events = on_ranks(_update_timing, 2, str(tmp_path))
    update, step = ["update"], ["grad", "out", "param", "param_grad"]
    # (step, all_reduce calls in its step(), global lines written, callback calls (step, update?))
    assert events[0] == [
        (0, 2, [(0, step)], [(0, False)]),
        (1, 0, [], []),  # the update of step 0 is measured here, on the device: kept
        (2, 0, [], []),
        (3, 2, [(0, update), (3, step)], [(0, True), (3, False)]),  # one reduce for both
        (4, 0, [], []),
        ("remove", 2, [(3, update)], [(3, True)]),  # what is pending, published on remove()
    ]
    assert [event[:2] for event in events[1]] == [event[:2] for event in events[0]]


def test_an_off_step_after_a_logged_one_reads_nothing_back_to_the_host():
    """On a GPU: the step() that measures the update synchronises with the device never."""
    from test_cuda import DEVICE, ON_GPU, count_host_syncs
    if ON_GPU and not torch.cuda.is_available():
        import pytest
        pytest.skip("needs a CUDA GPU")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(),
                              torch.nn.Linear(8, 2)).to(DEVICE)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    seen = []
    with fxdebug.monitor(net, every=3, callback=lambda step, values: seen.append(step)) as mon:
        for step in range(4):
            net(torch.randn(2, 4, device=DEVICE)).sum().backward()
            with count_host_syncs() as syncs:
                mon.step()
            if step in (1, 2):
                assert syncs == [], (step, syncs)
            optimizer.step()
            optimizer.zero_grad()
    assert seen == [0, 0, 3]  # step 0, its update (read at step 3), step 3
