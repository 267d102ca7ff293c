"""watch_nonfinite: silent while finite; on the first bad step, names the node that made the NaN.

Ground truth is computed independently, in eager: which operation's output first
holds a non-finite value given finite inputs, the line it is on, and with
``retain_grad`` which activation's gradient first turns non-finite.
"""

import inspect

import pytest
import torch
import torch.nn.functional as F

import fxdebug


class LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, x):
        h = self.fc(x)
        h = torch.log(h)  # NaN where fc's output is negative
        return self.out(h)


class DropLog(torch.nn.Module):
    def forward(self, x):
        return torch.log(F.dropout(x, p=0.2, training=True))  # -inf where dropped


def line_of(cls, text):
    lines, start = inspect.getsourcelines(cls.forward)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_forward_nan_named_with_its_line():
    torch.manual_seed(0)
    net = LogNet()
    with torch.no_grad():  # positive fc outputs for the first steps, then not
        net.fc.weight.copy_(torch.eye(3))
        net.fc.bias.zero_()
    watch = fxdebug.watch_nonfinite(net)
    steps = [torch.rand(2, 3) + 0.5, torch.rand(2, 3) + 0.5, torch.tensor([[1.0, -2.0, 3.0]])]
    reports = []
    for x in steps:
        net.zero_grad()
        watch(x).sum().backward()
        reports.append(watch.check())
    assert reports[:2] == [None, None]
    report = reports[2]
    # independent: the first operation with non-finite output, given finite inputs
    h = net.fc(steps[2])
    assert torch.isfinite(h).all() and not torch.isfinite(torch.log(h)).all()
    assert report.forward.key == "log" and report.forward.created
    assert report.forward.location.endswith(f"test_watch.py:{line_of(LogNet, 'torch.log')}")
    assert report.forward.nan == int(torch.isnan(torch.log(h)).sum())


def test_backward_inf_named():
    scale = torch.nn.Parameter(torch.ones(3))

    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = scale

        def forward(self, x):
            return torch.sqrt(x * self.scale).sum()  # finite; d sqrt(m) / dm is inf at m == 0

    model = Scaled()
    watch = fxdebug.watch_nonfinite(model)
    watch(torch.tensor([1.0, 0.5, 2.0])).backward()
    assert watch.check() is None
    model.zero_grad()
    watch(torch.tensor([1.0, 0.0, 2.0])).backward()  # forward finite, backward inf
    report = watch.check()
    # independent: retain_grad on the product; its gradient is the first non-finite one
    m = torch.tensor([1.0, 0.0, 2.0]) * scale
    m.retain_grad()
    s = torch.sqrt(m)
    s.retain_grad()
    s.sum().backward()
    assert torch.isfinite(s.grad).all() and not torch.isfinite(m.grad).all()
    assert report.forward is None
    assert report.backward.key == "mul"
    assert [key for key, _, _ in report.backward.made_by] == ["sqrt"]


def test_replay_uses_the_steps_random_state():
    torch.manual_seed(3)
    watch = fxdebug.watch_nonfinite(DropLog())
    x = torch.rand(64) + 0.5
    for _ in range(10):
        out = watch(x)
        report = watch.check()
        if report is not None:
            break
    assert report is not None
    # the replay drew the same dropout mask as the step: the same number of -inf values
    assert report.forward.key == "log"
    assert report.forward.inf == int(torch.isinf(out).sum()) > 0
    assert watch.check() is report  # the first bad step's report, kept


class Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)

    def forward(self, x, mask=None, scale=1.0, flip=False):
        h = self.fc(x) * scale
        if mask is not None:
            h = h * mask
        if flip:  # a Python flag: the replay traces it as a constant
            h = -h
        return torch.log(h)  # NaN where h is negative


def test_keyword_and_non_tensor_arguments_are_passed_on_and_replayed():
    net = Scaled()
    with torch.no_grad():
        net.fc.weight.copy_(torch.eye(3))
        net.fc.bias.zero_()
    watch = fxdebug.watch_nonfinite(net)
    x, mask = torch.rand(2, 3) + 0.5, torch.ones(2, 3)
    out = watch(x, mask=mask, scale=2.0)
    assert torch.equal(out, net(x, mask=mask, scale=2.0))  # watch(...) is net(...)
    out.sum().backward()
    assert watch.check() is None
    net.zero_grad()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, -1.0, 1.0]])
    watch(x=x, mask=mask, scale=2.0, flip=False).nan_to_num().sum().backward()
    report = watch.check()
    # independent: the product is finite, its log is not
    h = net.fc(x) * 2.0 * mask
    assert torch.isfinite(h).all() and not torch.isfinite(torch.log(h)).all()
    assert report.forward.key == "log" and report.forward.created
    assert report.forward.nan == int(torch.isnan(torch.log(h)).sum())
    assert report.forward.location.endswith(f"test_watch.py:{line_of(Scaled, 'torch.log')}")


def test_data_parallel_wrapper_replays_its_module():
    net = Scaled()
    with torch.no_grad():
        net.fc.weight.copy_(-torch.eye(3))
        net.fc.bias.zero_()
    watch = fxdebug.watch_nonfinite(torch.nn.DataParallel(net))  # on the CPU: runs net
    watch(torch.rand(2, 3) + 0.5, flip=True).sum().backward()
    assert watch.check() is None
    net.zero_grad()
    watch(torch.rand(2, 3) + 0.5).nan_to_num().sum().backward()
    report = watch.check()
    assert report.forward.key == "log"
    assert "the module inside DataParallel" in report.table()


class Gated(torch.nn.Module):
    """A root torch.fx cannot trace (a branch on a tensor): replayed module by module."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.act = torch.nn.Softplus()
        self.head = torch.nn.Linear(3, 1)

    def forward(self, x, scale=1.0):
        if x.sum() > 0:
            x = x * scale
        return self.head(self.act(self.fc(x)))


def test_untraceable_model_is_replayed_module_by_module():
    net = Gated()
    watch = fxdebug.watch_nonfinite(net)
    watch(torch.rand(2, 3), scale=2.0).sum().backward()
    assert watch.check() is None
    with torch.no_grad():
        net.fc.weight[1, 2] = float("inf")  # a weight gone bad between two steps
    net.zero_grad()
    x = torch.rand(2, 3)
    watch(x, scale=2.0).sum().backward()
    report = watch.check()
    # independent: fc is the first module whose output is non-finite; it received an Inf
    assert not torch.isfinite(net.fc(x * 2.0)).all()
    assert report.forward.key == "fc" and not report.forward.created
    assert [v.name for v in report.forward.parameters if not v.finite] == ["fc.weight"]
    assert report.later_forward[:2] == ["act", "head"]
    assert "module by module" in report.table() and "cannot trace Gated" in report.table()
    assert report.forward.location.endswith(f"linear.py:{inspect.getsourcelines(torch.nn.Linear.forward)[1]}")


def test_hugging_face_keywords_watched_and_replayed():
    from tiny_transformers import quiet
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=64,
                                     max_position_embeddings=64, attn_implementation="eager")
    model = transformers.BertForSequenceClassification(config)
    watch = fxdebug.watch_nonfinite(model)
    ids, labels = torch.randint(0, 100, (2, 8)), torch.tensor([0, 1])
    quiet(watch, input_ids=ids, labels=labels).loss.backward()
    assert watch.check(loss=lambda out: out.loss) is None
    with torch.no_grad():
        model.bert.encoder.layer[1].output.dense.bias[3] = float("nan")
    model.zero_grad()
    quiet(watch, input_ids=ids, labels=labels).loss.backward()
    report = quiet(watch.check, loss=lambda out: out.loss)
    assert report.forward.key == "bert.encoder.layer.1.output.dense"
    assert [v.name for v in report.forward.parameters if not v.finite] == [
        "bert.encoder.layer.1.output.dense.bias"]


class NaiveNorm(torch.nn.Module):
    """Rows normalised with the one-pass variance E[x^2] - E[x]^2, then a linear layer."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(64, 4)

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean  # cancels: rounding decides the sign
        return self.fc((x - mean) / torch.sqrt(var))


def _rows_only_compiled_makes_nan(model, compiled, batch: int):
    """Rows (mean 100, spread 1e-3) where eager is finite, and rows where the compiled
    model alone gives NaN: each row is its own reduction, so rows keep their results in
    any batch of the same shape. Ground truth: eager and compiled outputs, row by row."""
    gen = torch.Generator().manual_seed(0)
    finite, nan = [], []
    for _ in range(20):
        x = 100.0 + 1e-3 * torch.randn(batch, 64, generator=gen)
        eager_ok = torch.isfinite(model(x)).all(-1)
        compiled_nan = torch.isnan(compiled(x)).any(-1)  # grad mode on: the training graph
        finite += [row for row, ok, bad in zip(x, eager_ok, compiled_nan) if ok and not bad]
        nan += [row for row, ok, bad in zip(x, eager_ok, compiled_nan) if ok and bad]
        if nan and len(finite) >= batch:
            return torch.stack(finite[:batch]), torch.stack(finite[:batch - 1] + nan[:1])
    pytest.skip("on this CPU the compiled one-pass variance gave no NaN where eager gives none")


def test_compiled_only_nan_is_not_reproduced_eagerly_and_the_compiled_node_is_named():
    torch.manual_seed(0)
    model = NaiveNorm()
    compiled = torch.compile(model)  # inductor
    clean, flagged = _rows_only_compiled_makes_nan(model, compiled, batch=16)
    # ground truth on the whole batches: eager finite; compiled NaN only on the flagged one
    assert torch.isfinite(model(flagged)).all() and torch.isfinite(model(clean)).all()
    assert torch.isfinite(compiled(clean)).all() and torch.isnan(compiled(flagged)).any()
    watch = fxdebug.watch_nonfinite(compiled)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    reports = []
    for x in (clean, clean, flagged):
        optimizer.zero_grad()
        watch(x).square().mean().backward()
        reports.append(watch.check())
        optimizer.step()
    assert reports[:2] == [None, None]
    report = reports[2]
    assert isinstance(report, fxdebug.NonfiniteReport)
    assert not report.ok and not report.reproduced and report.step == 3
    assert report.forward is None and report.backward is None  # the eager replay: finite
    text, table = repr(report), report.table()
    print(text, table, repr(watch), sep="\n")
    assert text.startswith("<WatchReport NaiveNorm, NOT REPRODUCED: step 3 flagged (outputs "
                           "NaN), eager replay finite; compiled code first differs at sub ("), text
    assert table.startswith("NOT REPRODUCED: step 3 was flagged (outputs NaN, gradients NaN) but "
                            "the eager replay is finite")
    assert "all finite" not in text and "all finite" not in repr(watch)
    verdict = [line for line in table.splitlines() if line.startswith("verdict:")]
    assert len(verdict) == 1 and verdict[0].startswith("verdict: NOT REPRODUCED")
    assert report.to_dict()["ok"] is False
    # the node in the compiled code: the cancelling subtraction, at its line in this file
    divergence = report.compiled.first_divergence
    assert report.compiled_backend == "inductor" and not report.compiled.ok
    assert divergence.key == "sub"
    assert divergence.source == (__file__, line_of(NaiveNorm, "- mean * mean"))
    assert f"the compiled code differs from eager first at sub (operator.sub, " \
           f"{divergence.location})" in table
    assert f"sub at {divergence.location}" in table and "torch.compiler.disable" in table


class Rescaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 1)
        self.scale = 1.0  # a Python attribute: no parameter, buffer or input holds it

    def forward(self, x):
        return self.fc(x) / self.scale


def test_a_replay_that_does_not_reproduce_says_so_and_what_to_do():
    torch.manual_seed(0)
    model, x = Rescaled(), torch.randn(4, 3)
    watch = fxdebug.watch_nonfinite(model)
    model.scale = 0.0
    out = watch(x)
    model.scale = 1.0  # changed after the step: the replay runs with 1.0
    assert not torch.isfinite(out).all() and torch.isfinite(model(x)).all()  # ground truth
    out.sum().backward()
    report = watch.check()
    assert not report.ok and not report.reproduced and report.compiled is None
    text, table = repr(report), report.table()
    assert "NOT REPRODUCED: step 1 flagged (outputs" in text and "all finite" not in text
    assert table.startswith("NOT REPRODUCED: step 1 was flagged (outputs")
    assert "state outside the parameters, buffers, RNG state and inputs" in table
    assert "verdict: all finite" not in table and "verdict: NOT REPRODUCED" in table
    assert "NOT REPRODUCED" in repr(watch) and watch.check() is report


class _ManyGradients(torch.nn.Module):
    """Gradients of two dtypes, more than one chunk of the CPU check, one that turns NaN."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(6)])
        self.wide = torch.nn.Linear(4, 40)  # more values than a (shrunk) chunk: checked alone
        self.gate = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))

    def forward(self, x):
        h = self.wide(self.layers(x)).sum(1)
        return h + (torch.sqrt(self.gate) * 0).sum().float()  # gate's gradient: NaN at 0


@pytest.mark.parametrize("alone", [2, 1 << 12], ids=["every-gradient-alone", "small-ones-grouped"])
@pytest.mark.parametrize("chunk", [8, 1 << 20])
def test_parameter_gradient_nan_found_in_any_chunk(monkeypatch, chunk, alone):
    from fxdebug.nonfinite import gradient_flags
    monkeypatch.setattr(gradient_flags, "_CHUNK", chunk)
    monkeypatch.setattr(gradient_flags, "_ALONE", alone)
    torch.manual_seed(0)
    model = _ManyGradients()
    watch = fxdebug.watch_nonfinite(model)
    x = torch.randn(2, 4)
    watch(x).sum().backward()
    assert watch.check() is None
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        model.gate[1] = 0.0
    out = watch(x)
    assert torch.isfinite(out).all()
    out.sum().backward()
    # independent: autograd's own gradient of gate
    assert torch.isnan(model.gate.grad).any()
    report = watch.check()
    assert report is not None and report.flagged == "gradients NaN"
    assert "gate" in report.flagged_detail
    assert "gate (1/3)" in str(report)  # the replay names the parameter and its NaN count


class _GrowsInForward(torch.nn.Module):
    """Registers a parameter during its first forward (a lazily built part)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(2, 2)
        self.extra = None

    def forward(self, x):
        if self.extra is None:
            self.extra = torch.nn.Parameter(torch.zeros(3))
        return self.fc(x).sum() + (torch.sqrt(self.extra) * 0).sum()


def test_parameter_registered_during_the_step_is_checked():
    model = _GrowsInForward()
    watch = fxdebug.watch_nonfinite(model)
    out = watch(torch.ones(1, 2))
    assert torch.isfinite(out)
    out.backward()
    assert torch.isnan(model.extra.grad).all()  # autograd's own: d sqrt(0) * 0 is NaN
    report = watch.check()
    assert report is not None and "extra" in report.flagged_detail
    # the registration hooks the watch held are gone when it is removed
    from torch.nn.modules import module as torch_module
    hooks = vars(torch_module).get("_global_parameter_registration_hooks", {})
    assert any(hook is watch._registrations for hook in hooks.values())
    watch.remove()
    assert watch._registrations.handles == []
    assert not any(hook is watch._registrations for hook in hooks.values())
