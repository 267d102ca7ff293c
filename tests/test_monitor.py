"""fxdebug.monitor: statistics over training steps equal float64 statistics computed another way
(forward hooks, retain_grad, parameter copies), on one process and on 2 gloo ranks under DDP; the
folder, TensorBoard's event files and load_series give the same numbers; remove() leaves the
model as it was; the folder is byte-identical across processes and hash seeds."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import math
import os
import textwrap

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError, SelectionError

from ranks import on_ranks
from subprocesses import outputs_under_hash_seeds

RTOL = 1e-5  # float32 values summarized by fxdebug's kernels vs float64 torch ops


def make_net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.GELU(),
                               torch.nn.Linear(8, 3))


def reference(values: torch.Tensor) -> dict[str, float]:
    """The monitor's stats of ``values``, computed with float64 torch ops."""
    v = values.detach().double().reshape(-1)
    mean = v.mean()
    centered = v - mean
    m2 = centered.pow(2).mean()
    return {"count": float(v.numel()), "mean": mean.item(), "std": v.std().item(),
            "min": v.min().item(), "max": v.max().item(), "absmax": v.abs().max().item(),
            "rms": v.pow(2).mean().sqrt().item(), "norm": v.norm().item(),
            "zeros_pct": 100.0 * (v == 0).sum().item() / v.numel(), "nonfinite": 0.0,
            "kurtosis": (centered.pow(4).mean() / (m2 * m2)).item()}


SCALED = ("mean", "std", "min", "max", "absmax", "rms")


def close(found: float, value: float, stat: str, stats: dict[str, float]) -> bool:
    """Equal to float32 rounding: a mean near 0 (of a gradient) is compared against the rms."""
    if math.isnan(value):  # the kurtosis of a constant (the gradient of a sum)
        return math.isnan(found)
    scale = stats.get("rms", 0.0) if stat in SCALED else 0.0
    return math.isclose(found, value, rel_tol=RTOL, abs_tol=max(RTOL * scale, 1e-12))


def assert_stats(found: dict[str, float], expected: dict[str, float], what: str) -> None:
    for stat, value in expected.items():
        assert close(found[stat], value, stat, expected), (
            f"{what}.{stat}: monitor {found[stat]!r}, float64 reference {value!r}")


def hooked(model: torch.nn.Module, names) -> dict[str, torch.Tensor]:
    """Forward hooks keeping each named module's output, with retain_grad for its gradient."""
    kept: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for name in names:
        def hook(module, args, output, name=name):
            output.retain_grad()
            kept[name] = output
        modules[name].register_forward_hook(hook)
    return kept


def pooled(tensors) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in tensors])


def train(net, mon, steps, batches, lr=0.05, planted=None):
    """SGD steps; the float64 reference of every logged step: {step: {name: stats}}."""
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    names = [name for name, _ in net.named_modules() if name]
    kept = hooked(net, names)
    expected: dict[int, dict[str, dict[str, float]]] = {}
    for step in range(steps):
        loss = mon.model(batches[step]).sum()
        loss.backward()
        logged = mon._logging
        before = {}
        if logged:
            found = expected.setdefault(step, {})
            measured = step + 1 < steps  # the update: at the next step() call
            for name in names:
                found[f"{name}.out"] = reference(kept[name])
                found[f"{name}.grad"] = reference(kept[name].grad)
                own = list(dict(net.named_modules())[name].parameters(recurse=False))
                if own:
                    found[f"{name}.param"] = reference(pooled(own))
                    found[f"{name}.param_grad"] = reference(pooled(p.grad for p in own))
                    if measured:
                        before[name] = [p.detach().clone() for p in own]
        mon.step(loss)
        optimizer.step()
        optimizer.zero_grad()
        for name, kept_params in before.items():
            own = list(dict(net.named_modules())[name].parameters(recurse=False))
            update = pooled(p - b for p, b in zip(own, kept_params))
            found = expected[step]
            found[f"{name}.update"] = reference(update)
            found[f"{name}.update"]["ratio"] = (update.pow(2).mean().sqrt()
                                                / pooled(kept_params).pow(2).mean().sqrt()).item()
        if planted is not None:
            with torch.no_grad():
                planted.mul_(1.5)
    return expected


def check_series(series, expected, rank=None):
    for step, found in expected.items():
        for name, stats in found.items():
            key, _, kind = name.rpartition(".")
            for stat, value in stats.items():
                steps, values = series.get(key, stat, kind=kind, rank=rank)
                assert step in steps, f"{name}.{stat}: step {step} not recorded ({steps})"
                assert close(values[steps.index(step)], value, stat, stats), (
                    f"{name}.{stat} at step {step}: series "
                                                    f"{values[steps.index(step)]!r}, float64 "
                                                    f"reference {value!r}")


def test_series_equal_float64_statistics_of_hooks_retain_grad_and_parameter_copies(tmp_path):
    net = make_net()
    torch.manual_seed(1)
    batches = [torch.randn(5, 6) for _ in range(7)]
    calls = []
    with fxdebug.monitor(net, every=3, folder=tmp_path,
                         callback=lambda step, values: calls.append((step, values))) as mon:
        expected = train(net, mon, 7, batches)
    assert sorted(expected) == [0, 3, 6]
    series = fxdebug.load_series(tmp_path)
    assert series.steps == [0, 3, 6]
    assert series.keys() == ["0", "1", "2", "3", "loss"]
    check_series(series, expected)
    # the callback got the same numbers, each logged step, then its update at the next step
    assert [step for step, _ in calls] == [0, 0, 3, 3, 6]
    assert_stats({k.split(".")[-1]: v for k, v in calls[2][1].items() if k.startswith("3.out.")},
                 expected[3]["3.out"], "callback 3.out")
    assert math.isclose(calls[1][1]["0.update.ratio"], expected[0]["0.update"]["ratio"],
                        rel_tol=RTOL)


class _TiedLM(torch.nn.Module):
    """A language model whose output layer shares the embedding's weight (as GPT-2's), with
    more values than the kernel sums in float64 (the float32 lanes)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(5000, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 5000, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def test_a_tied_weight_series_and_updates_equal_float64_statistics(tmp_path):
    torch.manual_seed(3)
    net = _TiedLM()
    batches = [torch.randint(0, 5000, (3, 7)) for _ in range(5)]
    with fxdebug.monitor(net, every=2, folder=tmp_path) as mon:
        expected = train(net, mon, 5, batches, lr=0.5)
        kept = mon._copies.buffers([p for _, own in mon._parameters for p in own])
        assert kept[0] is kept[-1]  # emb's and head's weight: one buffer, copied once
    assert "emb.update" in expected[0] and "head.update" in expected[2]
    check_series(fxdebug.load_series(tmp_path), expected)


def test_off_steps_record_nothing_and_run_the_models_own_forward(monkeypatch):
    net = make_net()
    monitor_module = importlib.import_module("fxdebug.monitoring.training_monitor")
    summaries = []
    real, real_many = monitor_module.summarize_moments, monitor_module.summarize_many
    monkeypatch.setattr(monitor_module, "summarize_moments",
                        lambda t: summaries.append(1) or real(t))
    monkeypatch.setattr(monitor_module, "summarize_many",
                        lambda ts, **kw: summaries.extend([1] * len(ts)) or real_many(ts, **kw))
    seen = []
    with fxdebug.monitor(net, every=4, start=2, end=9,
                         callback=lambda step, values: seen.append(step)) as mon:
        copies = []
        real_copy = mon._copy.forward
        mon._copy.forward = lambda *a, **k: copies.append(1) or real_copy(*a, **k)
        per_step = []
        for step in range(10):
            before = (len(summaries), len(copies))
            net(torch.randn(2, 6)).sum().backward()
            mon.step()
            per_step.append((len(summaries) - before[0], len(copies) - before[1]))
    assert seen == [2, 2, 6, 6]  # logged steps 2 and 6, their updates at steps 3 and 7
    logged = [step for step, (_, ran) in enumerate(per_step) if ran]
    assert logged == [2, 6]
    quiet = [step for step, (made, _) in enumerate(per_step) if made == 0]
    assert quiet == [0, 1, 4, 5, 8, 9]  # 3 and 7 measure the update of 2 and 6, nothing else


def test_a_planted_weight_growth_tops_the_drift_table(tmp_path, capsys):
    net = make_net()
    with fxdebug.monitor(net, every=2, folder=tmp_path) as mon:
        train(net, mon, 12, [torch.randn(4, 6) for _ in range(12)], lr=0.01,
              planted=net[0].weight)
    report = fxdebug.load_series(tmp_path).drift()
    assert report.rows[0].key == "0" and report.rows[0].factor > 20
    assert {row.key for row in report.rows[:2]} == {"0"}  # its weights and its output
    assert all(len(line) <= 80 for line in report.table().splitlines())
    assert repr(report).startswith("<DriftReport ") and "most moved 0 " in repr(report)
    assert report.to_dict()["rows"][0]["key"] == "0"
    from fxdebug.cli import main
    assert main(["series", str(tmp_path), "--limit", "3"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[3].split()[0] == "0", printed


def test_select_by_pattern_and_type():
    net = make_net()
    with fxdebug.monitor(net, every=1, select=[torch.nn.Linear],
                         callback=lambda s, v: seen.update(v)) as mon:
        seen: dict[str, float] = {}
        net(torch.randn(2, 6)).sum().backward()
        mon.step()
    assert sorted({name.split(".")[0] for name in seen}) == ["0", "3"]
    with fxdebug.monitor(net, select=["1", torch.nn.LayerNorm]) as mon:
        assert list(mon._modules) == ["1"]
    with pytest.raises(SelectionError, match="matches no module"):
        fxdebug.monitor(net, select="10")


def test_remove_leaves_the_model_as_it_was():
    net = make_net()
    x = torch.randn(3, 6)
    before = net(x)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    mon = fxdebug.monitor(net, every=1)
    assert mon.model is net and "forward" in vars(net)
    out = net(x)
    assert torch.equal(out, before)  # a logged step's forward: the instrumented copy's, bitwise
    out.sum().backward()
    mon.step()
    mon.remove()
    mon.remove()  # twice is fine
    assert "forward" not in vars(net)
    for module in net.modules():
        assert not (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                    or module._backward_pre_hooks), module
    assert all(p._backward_hooks is None or not p._backward_hooks for p in net.parameters())
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items())
    assert torch.equal(net(x), before)
    with pytest.raises(FxdebugError, match="after remove"):
        mon.step()


def test_errors_say_what_to_pass():
    net = make_net()
    with pytest.raises(FxdebugError, match="every= must be a positive int"):
        fxdebug.monitor(net, every=0)
    with pytest.raises(FxdebugError, match="end= must be None or an int above"):
        fxdebug.monitor(net, start=5, end=5)
    with pytest.raises(FxdebugError, match="writer= takes a TensorBoard SummaryWriter"):
        fxdebug.monitor(net, writer="runs/tb")
    with pytest.raises(FxdebugError, match="no manifest.json"):
        fxdebug.load_series(os.path.dirname(__file__))
    from fxdebug.cli import main
    assert main(["series", os.path.dirname(__file__)]) == 2  # trouble: not a monitor's folder


def test_a_torn_last_line_is_skipped_and_a_resumed_run_appends(tmp_path):
    net = make_net()
    for _ in range(2):  # the second run appends to the same files
        with fxdebug.monitor(net, every=1, folder=tmp_path) as mon:
            for _ in range(2):
                net(torch.randn(2, 6)).sum().backward()
                mon.step()
    path = tmp_path / "rank-0.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == 2 * 3 and all(json.loads(line)["step"] in (0, 1) for line in lines)
    with open(path, "a") as handle:
        handle.write('{"step":2,"rows":{"0.out":[1.0,')  # a crash while writing
    series = fxdebug.load_series(tmp_path)
    assert series.steps == [0, 1]
    assert series.notes and "torn last line" in series.notes[0]
    with pytest.raises(FxdebugError, match="unknown stat 'ratio' for kind 'out'"):
        series.get("0", "ratio")
    assert series.get("0", "rms", kind="update")[0] == [0]  # the last step's: never measured
    with pytest.raises(FxdebugError, match="no series 5.out.rms in .*series.keys"):
        series.get("5", "rms")


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install tensorboard)")
def test_tensorboard_event_files_read_back_give_the_same_numbers(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter
    net = make_net()
    writer = SummaryWriter(str(tmp_path / "tb"))
    with fxdebug.monitor(net, every=2, folder=tmp_path / "series", writer=writer) as mon:
        train(net, mon, 5, [torch.randn(4, 6) for _ in range(5)])
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    series = fxdebug.load_series(tmp_path / "series")
    tags = events.Tags()["scalars"]
    assert "3.out.kurtosis" in tags and "0.update.ratio" in tags and "1.param_grad.rms" in tags
    for key, kind, stat in (("3", "out", "kurtosis"), ("1", "grad", "std"), ("0", "update", "ratio"),
                            ("0", "param_grad", "absmax"), ("loss", "out", "mean")):
        scalars = events.Scalars(f"{key}.{kind}.{stat}")
        steps, values = series.get(key, stat, kind=kind)
        assert [s.step for s in scalars] == steps == [0, 2, 4][:len(steps)]
        for scalar, value in zip(scalars, values):
            assert math.isclose(scalar.value, value, rel_tol=1e-6), (key, kind, stat)


def one_layer_gpt2(vocab: int, positions: int) -> torch.nn.Module:
    """A Hugging Face GPT-2 of one layer, 16 wide, random weights (seed 0)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=16, n_layer=1, n_head=2,
                                     n_positions=positions, use_cache=False,
                                     attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def assert_out_and_grad(series, key: str, output: torch.Tensor) -> None:
    """``key``'s first logged out and grad series equal float64 statistics of ``output`` (a
    forward hook's, with retain_grad) and of its gradient."""
    for kind, tensor in (("out", output), ("grad", output.grad)):
        expected = reference(tensor)
        assert_stats({stat: series.get(key, stat, kind=kind)[1][0] for stat in expected},
                     expected, f"{key}.{kind}")


def test_a_hugging_face_gpt2_is_monitored_through_its_instrumented_parts(tmp_path):
    model = one_layer_gpt2(vocab=50, positions=16)
    x = torch.randint(0, 50, (2, 8))
    kept = hooked(model, ["transformer.h.0.attn.c_proj"])
    with pytest.warns(fxdebug.EagerFallbackWarning):
        with fxdebug.monitor(model, every=1, folder=tmp_path, select="transformer.h.0.*") as mon:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            mon.step(loss)
    series = fxdebug.load_series(tmp_path)
    assert "transformer.h.0.mlp.c_fc" in series.keys() and "transformer.wte" not in series.keys()
    assert_out_and_grad(series, "transformer.h.0.attn.c_proj", kept["transformer.h.0.attn.c_proj"])


DETERMINISM = textwrap.dedent("""
    import sys, torch, fxdebug
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    with fxdebug.monitor(net, every=2, folder=sys.argv[1], spikes=True) as mon:
        for step in range(6):
            x = torch.randn(4, 6) * (1e20 if step == 3 else 1.0)  # step 3: a replayed spike
            loss = net(x).pow(2).mean()
            loss.backward()
            if mon.step(loss) is None:
                opt.step()
            opt.zero_grad()
    for name in sorted(__import__("os").listdir(sys.argv[1])):
        print(name, open(__import__("os").path.join(sys.argv[1], name)).read())
""")


def test_the_folder_is_byte_identical_across_processes_and_hash_seeds(tmp_path):
    outputs = outputs_under_hash_seeds(DETERMINISM, args=lambda seed: (str(tmp_path / seed),))
    assert outputs[0] == outputs[1] == outputs[2]
    assert "manifest.json" in outputs[0] and '"step":4' in outputs[0]
    assert 'spikes.jsonl {"first_divergence":' in outputs[0] and '"step":3,' in outputs[0]


# -- DDP on 2 gloo ranks ---------------------------------------------------------------------

def _ddp(rank, world, folder):
    from torch.nn.parallel import DistributedDataParallel
    net = make_net()
    whole = copy.deepcopy(net)  # the unsharded model, trained on the concatenated batch
    torch.manual_seed(7)
    batches = [torch.randn(4 * world, 6) for _ in range(5)]
    own = [b[4 * rank:4 * (rank + 1)] for b in batches]
    ddp = DistributedDataParallel(net)
    with fxdebug.monitor(ddp, every=2, folder=folder) as mon:
        assert mon.model is ddp
        local = train(net, mon, 5, own)
    # the reference: the whole batch, loss scaled so its parameter gradients are DDP's average
    # (its activation gradients are then 1/world of the ranks'; scaled back below)
    expected = reference_whole(whole, batches, world)
    series = fxdebug.load_series(folder)
    check_series(series, expected)
    check_series(series, {step: {k: v for k, v in found.items() if k.endswith(".out")}
                          for step, found in local.items()}, rank=rank)
    return series.ranks


def reference_whole(net, batches, world):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05)
    names = [name for name, _ in net.named_modules() if name]
    kept = hooked(net, names)
    expected = {}
    for step, batch in enumerate(batches):
        loss = net(batch).sum() / world
        loss.backward()
        before = {}
        if step % 2 == 0:
            found = expected.setdefault(step, {})
            for name in names:
                found[f"{name}.out"] = reference(kept[name])
                found[f"{name}.grad"] = reference(kept[name].grad * world)
                own = list(dict(net.named_modules())[name].parameters(recurse=False))
                if own:
                    found[f"{name}.param"] = reference(pooled(own))
                    found[f"{name}.param_grad"] = reference(pooled(p.grad for p in own))
                    if step + 1 < len(batches):  # the last step's update is never measured
                        before[name] = [p.detach().clone() for p in own]
        optimizer.step()
        optimizer.zero_grad()
        for name, kept_params in before.items():
            own = list(dict(net.named_modules())[name].parameters(recurse=False))
            expected[step][f"{name}.update"] = reference(pooled(p - b for p, b in
                                                                zip(own, kept_params)))
    return expected


def test_ddp_global_batch_statistics_equal_the_unsharded_models_on_the_concatenated_batch(tmp_path):
    assert on_ranks(_ddp, 2, str(tmp_path)) == [[0, 1], [0, 1]]
    assert sorted(os.listdir(tmp_path)) == ["global.jsonl", "manifest.json", "rank-0.jsonl",
                                            "rank-1.jsonl"]


def _one_rank_fails(rank, world):
    net = make_net()
    with fxdebug.monitor(net, every=1) as mon:
        net(torch.randn(2, 6)).sum().backward()
        if rank == 1:
            mon._parameters = [("0", [object()])]  # its statistics fail inside step()
        try:
            mon.step()
        except FxdebugError as exc:
            return str(exc)
    return "no error"


def test_a_rank_whose_statistics_fail_stops_every_rank_instead_of_a_hang():
    messages = on_ranks(_one_rank_fails, 2, timeout=60)
    assert all("failed on rank 1" in message for message in messages), messages
    assert "AttributeError" in messages[1]
