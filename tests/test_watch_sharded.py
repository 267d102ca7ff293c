"""watch_nonfinite on sharded models (FSDP2, tensor parallel) on 2 gloo ranks: every rank
replays the flagged step together, and the rank that made the NaN names the node.

Ground truth is eager, on an unsharded copy of the model (same weights, same inputs):
the first operation whose output is non-finite while its input is finite, on the
features that rank holds; for the backward, ``retain_grad`` on the activations.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fxdebug
from fxdebug.nonfinite.watch_ranks import RankFinding, settle
from ranks import on_ranks


class HalvesNet(torch.nn.Module):
    """fc1 makes the features ``[x + 2, x]`` (tensor parallel: rank 0 holds the first half,
    rank 1 the second); ``log`` is NaN where a value is negative, ``sqrt`` is finite at 0
    and its gradient there is infinite."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.fc1 = torch.nn.Linear(3, 6)
        self.fc2 = torch.nn.Linear(6, 1)
        with torch.no_grad():
            self.fc1.weight.copy_(torch.cat([torch.eye(3), torch.eye(3)]))
            self.fc1.bias.copy_(torch.tensor([2.0, 2.0, 2.0, 0.0, 0.0, 0.0]))

    def forward(self, x):
        h = self.fc1(x)
        if self.op == "log":
            return self.fc2(torch.log(h))
        return self.fc2(torch.sqrt(h))


_LINES = inspect.getsourcelines(HalvesNet.forward)[0]
_FIRST = inspect.getsourcelines(HalvesNet.forward)[1]
LINE = {op: _FIRST + next(i for i, text in enumerate(_LINES) if f"torch.{op}(h)" in text)
        for op in ("log", "sqrt")}


def step_input(rank: int, step: int, op: str, parallel: str) -> torch.Tensor:
    """Positive inputs; at step 3 one value is -1 (log) or 0 (sqrt) on rank 1's batch (FSDP2,
    data parallel), or in the one batch every rank sees (tensor parallel)."""
    seed = 10 * step + (rank if parallel == "fsdp" else 0)
    x = torch.rand(4, 3, generator=torch.Generator().manual_seed(seed)) + 0.5
    if step == 3 and (rank == 1 or parallel == "tp"):
        x[2, 1] = -1.0 if op == "log" else 0.0
    return x


def sharded(model: torch.nn.Module, parallel: str, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model.fc1, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    return parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return _local(tensor).detach().clone().view(torch.int32)  # NaN equals itself, bitwise


def _truth(eager: HalvesNet, x: torch.Tensor, rank: int, parallel: str) -> dict:
    """What eager says on this rank's features: the op that made non-finite values from
    finite ones in the forward, and in the backward whether sqrt's own output gradient was
    finite while fc1's (its input's) was not."""
    mine = slice(0, 6) if parallel == "fsdp" else slice(3 * rank, 3 * rank + 3)
    h = eager.fc1(x)
    h.retain_grad()
    made = torch.log(h) if eager.op == "log" else torch.sqrt(h)
    made.retain_grad()
    eager.fc2(made).sum().backward()
    finite = lambda t: bool(torch.isfinite(t[:, mine]).all())  # noqa: E731
    return dict(forward=eager.op if finite(h) and not finite(made) else None,
                backward=eager.op if finite(made.grad) and not finite(h.grad) else None)


def _watch(rank, world, op, parallel):
    import copy
    torch.manual_seed(0)
    net = HalvesNet(op)
    eager = copy.deepcopy(net)
    model = sharded(net, parallel, world)
    watch = fxdebug.watch_nonfinite(model)
    for step in range(1, 6):
        model.zero_grad()
        watch(step_input(rank, step, op, parallel)).sum().backward()
        before = [(_bits(p), _bits(p.grad)) for p in model.parameters()]
        report = watch.check()
        if report is not None:
            break
    # the replay left every shard and gradient as the step left them, FSDP2's shards in place
    kept = all(torch.equal(_bits(p), a) and torch.equal(_bits(p.grad), g)
               and type(p).__name__ == "DTensor" for p, (a, g) in zip(model.parameters(), before))
    truth = _truth(eager, step_input(rank, step, op, parallel), rank, parallel)
    # and training goes on: one more step, collectives and all, finite as at step 1
    model.zero_grad()
    watch(step_input(rank, 1, op, parallel)).sum().backward()
    kept = kept and all(bool(torch.isfinite(_local(p.grad)).all()) for p in model.parameters())
    local = report.local
    return dict(step=step, kept=kept, truth=truth, ranks=report.ranks, flagged=report.flagged,
                findings=[(f.rank, f.made_here, f.where, f.key, f.location) for f in report.findings],
                forward=None if local is None or local.forward is None else
                (local.forward.key, local.forward.created, local.forward.location),
                backward=None if local is None or local.backward is None else
                (local.backward.key, local.backward.made_by),
                table=report.table(wide=True), repr=repr(report), again=watch.check() is report)


def _check(results, op: str, where: str) -> None:
    first, second = results
    for found in results:
        assert found["step"] == 3 and found["again"] and found["kept"]  # every rank, step 3
        assert found["ranks"] == (1,)
        made = [f for f in found["findings"] if f[1]]
        assert made == [(1, True, where, made[0][3], made[0][4])]
        assert made[0][4].endswith(f"test_watch_sharded.py:{LINE[op]}" if where == "forward"
                                   else "test_watch_sharded.py:" + made[0][4].split(":")[-1])
        assert f"made on rank 1: {where}" in found["repr"]
        rank0 = found["findings"][0]
        assert rank0[:3] in ((0, False, "received"), (0, False, "finite here"))
    # eager: rank 1's features made the values, rank 0's did not
    assert second["truth"][where] == op and first["truth"][where] is None
    return first, second


def test_fsdp2_nan_made_in_rank_1s_forward_is_named_by_rank_1_every_rank_stops():
    first, second = _check(on_ranks(_watch, 2, "log", "fsdp"), "log", "forward")
    assert second["forward"][:2] == ("log", True)
    assert second["forward"][2].endswith(f"test_watch_sharded.py:{LINE['log']}")
    assert first["forward"] is None  # rank 0's own forward stayed finite
    assert "rank 1 made them at forward log" in first["table"]


def test_fsdp2_nan_made_in_rank_1s_backward_names_the_backward_node():
    first, second = _check(on_ranks(_watch, 2, "sqrt", "fsdp"), "sqrt", "backward")
    key, made_by = second["backward"]
    # sqrt's output gradient is finite, its input's is not: the backward of sqrt made it
    assert [(k, where.endswith(f"test_watch_sharded.py:{LINE['sqrt']}")) for k, _, where
            in made_by] == [("sqrt", True)]
    assert second["forward"] is None and first["backward"] is None


def test_tensor_parallel_nan_made_in_rank_1s_shard_named_by_rank_1():
    first, second = _check(on_ranks(_watch, 2, "log", "tp"), "log", "forward")
    assert second["forward"][:2] == ("log", True)
    # rank 0 went non-finite only at fc2, whose all-reduce brought rank 1's NaN
    assert first["findings"][0][:4] == (0, False, "received", "fc2")
    assert first["forward"][0] == "fc2"


def test_tensor_parallel_nan_made_in_rank_1s_backward_names_the_backward_node():
    first, second = _check(on_ranks(_watch, 2, "sqrt", "tp"), "sqrt", "backward")
    assert [k for k, _, _ in second["backward"][1]] == ["sqrt"]
    assert first["findings"][0][:3] == (0, False, "finite here")


def test_settle_names_the_rank_whose_replay_stopped_in_the_others_timeouts():
    stopped = RankFinding(1, "outputs", False, "replay failed", detail="ValueError: bad loss")
    waited = RankFinding(0, "", False, "replay failed",
                         detail="DistBackendError: Timed out waiting 60000ms for recv")
    settled = settle([waited, stopped])
    assert settled[1] == stopped
    assert settled[0].detail.endswith("(a collective of the replay waited for rank 1, whose "
                                      "replay stopped)")


# -- a Hugging Face decoder (tiny Llama) under FSDP2 and TP: the replay names a node -------
def _nan_llama():
    """A tiny Llama whose token 0 embeds to zeros and whose first RMSNorm has eps 0: a batch
    holding token 0 makes NaN there (0 * rsqrt(0)); other batches stay finite."""
    import sharded_families as families
    model, (ids,) = families.make("llama")
    with torch.no_grad():
        model.model.embed_tokens.weight[0].zero_()
    model.model.layers[0].input_layernorm.variance_epsilon = 0.0
    return model, ids.clamp(min=1)


def _watch_llama(rank, world, config):
    import warnings
    import sharded_families as families
    warnings.simplefilter("ignore")
    model, ids = _nan_llama()
    if config == "hooked":  # one process: a forward hook on the root, as FSDP2 registers one
        model.register_forward_hook(lambda module, args, out: out)
    else:
        families.configure(model, "llama", config, world)
    watch = fxdebug.watch_nonfinite(model)
    for step in range(1, 4):
        model.zero_grad()
        x = ids.clone()
        if step == 2 and rank == 1:
            x[0, 3] = 0
        families.loss_of(watch(x)).backward()
        report = watch.check()
        if report is not None:
            break
    local = report if config == "hooked" else report.local
    findings = [] if config == "hooked" else [(f.rank, f.made_here, f.where, f.key)
                                              for f in report.findings]
    # ground truth, eager: the first RMSNorm's output on this rank's step-2 batch
    eager, _ = _nan_llama()
    seen = {}

    def norm_hook(module, args, out):  # returns None: the output stays as it is
        seen.setdefault("norm", bool(torch.isfinite(out).all()))

    eager.model.layers[0].input_layernorm.register_forward_hook(norm_hook)
    eager(x)
    return dict(step=step, findings=findings, norm_finite=seen["norm"],
                forward=None if local.forward is None else (local.forward.key,
                                                            local.forward.created),
                creators=list(local.creators), text=repr(report))


def test_hugging_face_model_with_root_hooks_replays_to_a_node():
    pytest.importorskip("transformers")
    # before: the root's forward-hook node indexed the leaves of CausalLMOutputWithPast as
    # traced (logits, past_key_values, hidden_states, attentions: Proxies), while the run's
    # output leaves its None fields out: IndexError in the replay, no node named
    found = _watch_llama(1, 1, "hooked")
    assert found["step"] == 2 and not found["norm_finite"]  # eager: the NaN is made there
    # the first RMSNorm runs inside LlamaModel, which fx runs as a leaf (mask control flow)
    assert found["forward"] == ("model", True), found["text"]
    assert found["creators"] == ["model"]  # not the ModelOutput built from model's NaN


@pytest.mark.parametrize("config", ["fsdp", "tp"])
def test_hugging_face_model_under_fsdp2_and_tp_replay_names_the_node(config):
    pytest.importorskip("transformers")
    first, second = on_ranks(_watch_llama, 2, config, timeout=300)
    assert first["step"] == second["step"] == 2
    assert first["norm_finite"] and not second["norm_finite"]  # eager: rank 1's batch made it
    for found in (first, second):
        assert not [f for f in found["findings"] if f[2] == "replay failed"], found["text"]
        assert (1, True, "forward", "model") in found["findings"], found["text"]
    if config == "fsdp":  # rank 0's forward stayed finite: its gradients received the NaN
        assert first["findings"][0] == (0, False, "received", "")
        assert first["forward"] is None and second["forward"] == ("model", True)
