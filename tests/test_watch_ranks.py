"""watch_nonfinite and instrument() under torch.distributed, on 2 gloo ranks.

Ground truth is computed in eager on the rank that got the bad input: the first
operation whose output is non-finite while its input is finite, and its line.
"""

from __future__ import annotations

import inspect
import json

import torch

import fxdebug
from ranks import on_ranks


class LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 1)
        with torch.no_grad():  # fc(x) == x: log is finite while the inputs are positive
            self.fc.weight.copy_(torch.eye(3))
            self.fc.bias.zero_()

    def forward(self, x):
        h = self.fc(x)
        h = torch.log(h)  # NaN where fc's output is negative
        return self.out(h)


LOG_LINE = inspect.getsourcelines(LogNet.forward)[1] + 2


def step_input(rank: int, step: int) -> torch.Tensor:
    """Positive inputs, except on rank 1 at step 3."""
    x = torch.rand(4, 3, generator=torch.Generator().manual_seed(10 * step + rank)) + 0.5
    if rank == 1 and step == 3:
        x[2, 1] = -1.0
    return x


def _watch(rank, world, wrap_ddp):
    import torch.distributed as dist
    torch.manual_seed(0)
    net = LogNet()
    model = torch.nn.parallel.DistributedDataParallel(net) if wrap_ddp else net
    reduces = []
    all_reduce = dist.all_reduce

    def counting(*args, **kwargs):  # the watch's collectives (DDP's run in C++)
        reduces.append(1)
        return all_reduce(*args, **kwargs)

    dist.all_reduce = counting
    try:
        watch = fxdebug.watch_nonfinite(model)
        for step in range(1, 6):
            model.zero_grad()
            watch(step_input(rank, step)).sum().backward()
            report = watch.check()
            if report is not None:
                break
    finally:
        dist.all_reduce = all_reduce
    x = step_input(rank, step)
    truth = None
    if torch.isfinite(net.fc(x)).all() and not torch.isfinite(torch.log(net.fc(x))).all():
        truth = "log"
    local = report.local
    return dict(step=step, reduces=len(reduces), ranks=report.ranks, flagged=report.flagged,
                findings=[(f.rank, f.made_here, f.where, f.key, f.location, f.nonfinite_in)
                          for f in report.findings],
                local_forward=None if local is None or local.forward is None else
                (local.forward.key, local.forward.created, local.forward.location),
                local_ok=None if local is None else local.ok, truth=truth,
                table=report.table(wide=True), repr=repr(report), again=watch.check() is report,
                json=json.dumps(report.to_dict()), html=report._repr_html_()[:5])


def test_nan_on_rank_1_at_step_3_stops_every_ddp_rank_at_step_3_naming_rank_1_and_the_node():
    first, second = on_ranks(_watch, 2, True)
    for found in (first, second):
        assert found["step"] == 3 and found["again"]
        assert found["reduces"] == 3  # one small collective per step
        assert found["ranks"] == (1,)
        # DDP averages gradients: rank 0's are non-finite too, its own replay is finite
        assert found["flagged"] == (0, 1)
        rank0, rank1 = found["findings"]
        assert rank0[:3] == (0, False, "received") and rank0[5] == "parameter gradients"
        assert rank1[:4] == (1, True, "forward", "log")
        assert rank1[4].endswith(f"test_watch_ranks.py:{LOG_LINE}")
        assert rank1[5] == "outputs and parameter gradients"
        assert "made on rank 1: forward log" in found["repr"] and "\n" not in found["repr"]
        assert json.loads(found["json"])["ranks"] == [1] and found["html"] == "<pre>"
    # the node, from rank 1's own replay, as eager says
    assert second["truth"] == "log" and first["truth"] is None
    assert second["local_forward"][:2] == ("log", True)
    assert second["local_forward"][2].endswith(f"test_watch_ranks.py:{LOG_LINE}")
    assert first["local_ok"] is True
    assert "rank 1" not in first["table"].split("this rank's replay")[1]


def test_without_ddp_only_the_rank_that_went_non_finite_is_flagged():
    first, second = on_ranks(_watch, 2, False)
    for found in (first, second):
        assert found["step"] == 3 and found["ranks"] == (1,) and found["flagged"] == (1,)
    assert first["local_ok"] is None  # rank 0 had nothing to replay
    assert second["local_forward"][:2] == ("log", True)


def make_cnn() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 3))


def _instrumented_ddp(rank, world):
    import torch.distributed as dist
    DDP = torch.nn.parallel.DistributedDataParallel
    plain, watched = make_cnn(), make_cnn()
    ddp, gm = DDP(plain), fxdebug.instrument(DDP(watched))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, watched)]
    same, captures_differ = [], []
    for step in range(3):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(step * 7 + rank))
        for model, optimizer in zip((ddp, gm), optimizers):
            optimizer.zero_grad()
            model(x).square().mean().backward()
        grads = [(p.grad, q.grad) for p, q in zip(plain.parameters(), watched.parameters())]
        same.append(all(torch.equal(a, b) for a, b in grads))
        # all-reduced: the gradient is the same on every rank (gathered, compared)
        for a, _ in grads:
            gathered = [torch.empty_like(a) for _ in range(world)]
            dist.all_gather(gathered, a)
            same.append(torch.equal(gathered[0], gathered[1]))
        rec = fxdebug.records(gm)
        with torch.no_grad():  # this rank's own capture: its own input through its conv
            same.append(torch.equal(rec["module.0"], watched[0](x)))
        conv = rec["module.0"].contiguous()
        gathered = [torch.empty_like(conv) for _ in range(world)]
        dist.all_gather(gathered, conv)
        captures_differ.append(not torch.equal(gathered[0], gathered[1]))
        for optimizer in optimizers:
            optimizer.step()
    same.extend(torch.equal(p, q) for p, q in zip(plain.parameters(), watched.parameters()))
    return same, captures_differ, type(gm).__name__


def test_instrumented_ddp_trains_bitwise_like_ddp_with_captures_per_rank():
    for same, captures_differ, kind in on_ranks(_instrumented_ddp, 2):
        assert all(same) and all(captures_differ)
        assert kind == "DistributedDataParallel"


def _fsdp2(rank, world):
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = LogNet()
    fully_shard(net)
    watch = fxdebug.watch_nonfinite(net)
    for step in range(1, 6):
        net.zero_grad()
        watch(step_input(rank, step)).sum().backward()
        report = watch.check()
        if report is not None:
            break
    return step, report.flagged, [(f.rank, f.where, f.nonfinite_in) for f in report.findings]


def test_fsdp2_ranks_stop_on_the_same_step_and_replay_it_together():
    first, second = on_ranks(_fsdp2, 2)
    assert first == second
    step, flagged, findings = first
    assert step == 3 and 1 in flagged
    # every rank replayed (FSDP2's collectives run on all): rank 1 names the node, rank 0's
    # own step is finite (its gradient shard, if flagged, came through the reduce-scatter)
    assert [(rank, where, what.startswith("outputs")) for rank, where, what in findings
            if rank == 1] == [(1, "forward", True)]
    assert [where for rank, where, _ in findings if rank == 0] in (["received"], ["finite here"])
