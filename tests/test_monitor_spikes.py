"""fxdebug.monitor(spikes=...): a planted spike step is replayed once and its first node named
(checked against forward hooks that find the first non-finite module output independently);
a spike that a replay cannot reproduce (a gradient corrupted after backward, as a faulty
reduction would) is reported as not reproduced; a finite loss spike from a bad batch
reproduces and stays within rounding of float64; the replay leaves the RNG, .grad and
BatchNorm buffers as they were; under DDP the rank holding the first non-finite node is named."""

from __future__ import annotations

import json

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError
from fxdebug.monitoring.spikes import Factor, NonFinite, Sigma

from ranks import on_ranks


class Scaled(torch.nn.Module):
    """``(x * scale) ** 2``: with a huge ``scale`` it overflows float32, not float64."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(1.0))

    def forward(self, x):
        return (x * self.scale) ** 2


def make_net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               Scaled(), torch.nn.Linear(8, 1))


def first_nonfinite_module(net, x):
    """Ground truth another way: forward hooks, the first leaf module whose output is not finite."""
    found = []
    handles = [module.register_forward_hook(
        lambda m, i, o, name=name: found.append(name) if not torch.isfinite(o).all() else None)
        for name, module in net.named_children()]
    with torch.no_grad():
        was = net.training
        net.eval()
        net(x)
        net.train(was)
    for handle in handles:
        handle.remove()
    return found[0] if found else None


def train(net, steps, plant, mon_kwargs, batch=None):
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    reports = {}
    with fxdebug.monitor(net, **mon_kwargs) as mon:
        for step in range(steps):
            x = batch(step) if batch else torch.randn(16, 6)
            plant(net, step, x)
            loss = mon.model(x).pow(2).mean()
            loss.backward()
            extra = plant.after_backward(net, step) if hasattr(plant, "after_backward") else None
            del extra
            report = mon.step(loss)
            if report is not None:
                reports[step] = report
            else:  # a spike step's update is skipped, as a training loop would
                opt.step()
            opt.zero_grad()
    return reports, mon


def test_a_planted_overflow_is_replayed_once_and_its_node_named(tmp_path):
    net = make_net()
    spike = 13
    seen = {}

    def plant(net, step, x):
        net[3].scale.fill_(1e25 if step == spike else 1.0)
        if step == spike:
            seen["first"] = first_nonfinite_module(net, x)

    reports, mon = train(net, 20, plant, dict(every=4, folder=tmp_path, spikes=True))
    assert list(reports) == [spike] and seen["first"] == "3"
    report = reports[spike]
    assert report.reproduced is True
    assert report.first_nonfinite.split(".")[0] == "3", report
    assert report.first_nonfinite_where == "forward"
    assert report.first_divergence.split(".")[0] == "3", report  # inf in float32 only
    assert "loss is nan" in report.trigger or "loss is inf" in report.trigger
    assert mon.spikes == [report]
    lines = (tmp_path / "spikes.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [spike]
    loaded = fxdebug.load_series(tmp_path).spikes
    assert loaded[0]["first_divergence"] == report.first_divergence
    assert loaded[0]["reproduced"] is True


class CorruptGradient:
    """After backward at one step, a NaN written into a gradient: what a faulty reduction does."""

    def __init__(self, step):
        self.step = step

    def __call__(self, net, step, x):
        pass

    def after_backward(self, net, step):
        if step == self.step:
            net[4].weight.grad[0, 0] = float("nan")


def test_a_spike_the_replay_does_not_reproduce_is_reported_as_such():
    reports, _ = train(make_net(), 12, CorruptGradient(9), dict(every=5, spikes=[NonFinite()]))
    assert list(reports) == [9]
    report = reports[9]
    assert report.reproduced is False
    assert "NaN/Inf in other places" in report.reproduced_why
    assert report.first_nonfinite is None  # the replay itself is finite everywhere
    assert "NO" in report.table() and "NOT REPRODUCED" in repr(report)


def test_a_finite_loss_spike_reproduces_within_rounding_of_float64_and_leaves_the_run_as_it_was():
    net = make_net()
    spike = 30
    state = {}

    def batch(step):
        return torch.randn(16, 6)

    def plant(net, step, x):
        net[3].scale.fill_(6.0 if step == spike else 1.0)  # finite: (6 tanh(.))**2 <= 36
        if step == spike:  # what the step leaves behind, to compare after mon.step()
            state["rng"] = torch.get_rng_state()
            state["buffers"] = [b.clone() for b in net.buffers()]

    plant_after = {}

    def after_backward(net, step):
        if step == spike:
            plant_after["grads"] = [p.grad.clone() for p in net.parameters()]
    plant.after_backward = after_backward

    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    reports = {}
    with fxdebug.monitor(net, every=10, spikes=[Factor("loss", 10, window=20)]) as mon:
        for step in range(spike + 1):
            x = batch(step)
            plant(net, step, x)
            loss = mon.model(x).pow(2).mean()
            loss.backward()
            plant.after_backward(net, step)
            rng_before_step = torch.get_rng_state()
            report = mon.step(loss)
            if report is not None:
                reports[step] = report
                assert torch.equal(torch.get_rng_state(), rng_before_step)
                assert all(torch.equal(p.grad, g)
                           for p, g in zip(net.parameters(), plant_after["grads"]))
            opt.step()
            opt.zero_grad()
    assert list(reports) == [spike]
    report = reports[spike]
    assert report.reproduced is True and report.compared is True
    assert report.first_divergence is None and report.first_nonfinite is None
    assert "> 10x the window max" in report.trigger
    assert report.moved and all(not name.startswith("loss.") for name, *_ in report.moved)


def test_a_model_that_draws_random_numbers_is_not_compared_against_float64():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    with fxdebug.monitor(net, every=100, spikes=[Factor("loss", 1.0001, window=2, min_steps=1)]) as mon:
        reports = []
        for _ in range(6):
            loss = net(torch.randn(4, 6)).pow(2).mean()
            loss.backward()
            if (report := mon.step(loss)) is not None:
                reports.append(report)
            net.zero_grad()
    assert reports
    assert all(r.reproduced is True and r.compared is False for r in reports)
    assert any("draws random numbers" in note for note in reports[0].notes)


def test_rules_on_a_series_fire_on_logged_steps():
    net = make_net()

    def plant(net, step, x):
        net[3].scale.fill_(30.0 if step == 8 else 1.0)

    reports, _ = train(net, 10, plant, dict(every=2, spikes=[Factor("3.out.absmax", 10, window=4,
                                                                    min_steps=2)]))
    assert list(reports) == [8]
    assert reports[8].trigger.startswith("3.out.absmax")


def test_bad_rules_say_what_to_pass():
    with pytest.raises(FxdebugError, match="metric is 'loss', 'grad_norm' or a series"):
        Factor("loss_value", 10)
    with pytest.raises(FxdebugError, match="spikes= takes True"):
        fxdebug.monitor(make_net(), spikes="yes")
    with pytest.raises(FxdebugError, match="window="):
        Sigma("grad_norm", 6, window=1)


def _ddp_spike(rank, world):
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), Scaled(), torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-2)
    found = {}
    with fxdebug.monitor(ddp, every=3, spikes=True) as mon:
        for step in range(8):
            torch.manual_seed(100 * step + rank)
            x = torch.randn(4, 6)
            if step == 6 and rank == 1:  # a batch that overflows float32 in Scaled (key 1)
                x = x * 1e20
            loss = ddp(x).pow(2).mean()
            loss.backward()
            report = mon.step(loss)
            if report is not None:
                found[step] = (report.reproduced, report.first_nonfinite, report.rank,
                               report.first_divergence)
            else:
                opt.step()
            opt.zero_grad()
    return found


def test_under_ddp_every_rank_replays_and_the_rank_holding_the_first_nonfinite_node_is_named():
    results = on_ranks(_ddp_spike, 2, timeout=90)
    assert results[0] == results[1], results
    (step, (reproduced, nonfinite, rank, divergence)), = results[0].items()
    assert step == 6 and reproduced is True and rank == 1
    assert nonfinite.split(".")[0] == "1" and divergence.split(".")[0] == "1"


def test_a_forward_replaced_on_the_instance_is_named_since_logged_steps_run_the_class_forward():
    net = make_net()
    plain = net.forward

    def autocast_forward(*args, **kwargs):  # what a mixed-precision wrapper does
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return plain(*args, **kwargs)
    net.forward = autocast_forward
    with pytest.warns(fxdebug.errors.FidelityWarning, match="replaced on the instance"):
        mon = fxdebug.monitor(net, every=1)
    mon.remove()
    assert net.forward is autocast_forward


def test_huge_finite_gradients_are_not_a_nonfinite_spike():
    """Gradients near 1e20 are finite; their float32 squares are not (the norm is taken again
    in float64 before a rule reads it)."""
    net = torch.nn.Linear(2, 1)
    with fxdebug.monitor(net, every=100, spikes=[NonFinite()]) as mon:
        loss = net(torch.full((3, 2), 1e20)).sum()
        loss.backward()
        assert torch.isfinite(net.weight.grad).all()
        assert mon.step(loss) is None


def test_a_compiled_model_is_replayed_eagerly_and_its_node_named():
    net = make_net()
    compiled = torch.compile(net, backend="aot_eager")

    def plant(net, step, x):
        net[3].scale.fill_(1e25 if step == 6 else 1.0)

    reports, _ = _train_compiled(net, compiled, plant)
    assert list(reports) == [6]
    assert reports[6].reproduced is True
    assert reports[6].first_nonfinite.split(".")[0] == "3"


def _train_compiled(net, compiled, plant):
    opt = torch.optim.SGD(net.parameters(), lr=1e-2)
    reports = {}
    with fxdebug.monitor(compiled, every=3, spikes=[NonFinite()]) as mon:
        for step in range(8):
            x = torch.randn(16, 6)
            plant(net, step, x)
            loss = mon.model(x).pow(2).mean()
            loss.backward()
            if (report := mon.step(loss)) is not None:
                reports[step] = report
            else:
                opt.step()
            opt.zero_grad()
    return reports, mon
