"""Captures inside code that runs eagerly: eager modules, auto-leaves, torch.nn modules with children.

Ground truth: the attention weights transformers returns with output_attentions=True,
forward hooks on every module (tests/hooks.py), retain_grad on the eager model.
"""

from __future__ import annotations


import pytest
import torch

import fxdebug
from hooks import hook_captures
from test_stats import assert_stats_equal, truth
from tiny_transformers import quiet as _quiet, tiny_bert, tiny_gpt2


# -- attention probabilities inside Hugging Face attention blocks ---------------------------
def _bert():
    return tiny_bert(), "encoder.layer.{}.attention.self"


def _gpt2():
    return tiny_gpt2(), "h.{}.attn"


@pytest.mark.parametrize("factory", [_bert, _gpt2], ids=["bert", "gpt2"])
def test_attention_probabilities_are_captured_inside_eager_attention(factory):
    torch.manual_seed(0)
    model, attention = factory()
    ids = torch.randint(0, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids, output_attentions=True)
    instrumented = fxdebug.instrument(model, capture="all")
    with torch.no_grad():
        out = _quiet(instrumented, ids, output_attentions=True)
    assert torch.equal(out.last_hidden_state, expected.last_hidden_state)
    rec = fxdebug.records(instrumented)
    for layer, weights in enumerate(expected.attentions):
        key = f"{attention.format(layer)}.softmax"
        # symbolic tracing fails on the model (**kwargs calls): torch.export makes its graph
        assert rec.record(key).via == "graph"
        assert rec.record(key).op == "aten.softmax.int"
        assert torch.equal(rec[key], weights), key
        assert f"{attention.format(layer)}.matmul" in rec  # the scores, before the softmax
    # module outputs keep their keys and say how they were captured
    assert rec.record(f"{attention.format(0)}/0").via in ("eager module", "graph")
    # capture="modules" records no op
    modules = fxdebug.instrument(model)
    with torch.no_grad():
        _quiet(modules, ids)
    assert not any(r.via == "eager op" for r in fxdebug.records(modules).records())


# -- a block auto-leaf must make a leaf ------------------------------------------------------
class Gated(torch.nn.Module):
    """fx cannot trace it (a branch on a value): auto-leaf keeps it as one node."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.norm = torch.nn.BatchNorm2d(4)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        y = self.act(self.norm(self.conv(x)))
        if y.mean() > 0:
            y = self.act(y - 0.5)
        return torch.sigmoid(y) * 2


class WithLeaves(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.block = Gated()
        self.other = Gated()
        self.head = torch.nn.Conv2d(4, 2, 1)

    def forward(self, x):
        return self.head(self.other(self.block(self.block(self.stem(x)))))


def test_module_calls_inside_auto_leaves_equal_forward_hooks():
    torch.manual_seed(0)
    model = WithLeaves().eval()
    x = torch.randn(2, 3, 8, 8)
    truth = hook_captures(model, x)
    gm = fxdebug.instrument(model)
    assert isinstance(gm, torch.fx.GraphModule)
    assert [path for path, _ in gm.meta["fxdebug_auto_leaves"]] == ["block", "other"]
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    rec = fxdebug.records(gm)
    assert rec.keys() == list(truth)  # block.act_1, block_1, block.conv_1...: per call
    for key in truth:
        assert torch.equal(rec[key], truth[key]), key
    assert rec.record("block.conv_1").via == "eager module"
    assert rec.record("stem").via == "graph"
    assert not hasattr(model.block, "forward") or "forward" not in model.block.__dict__


def test_ops_inside_an_auto_leaf_with_capture_all_and_stats():
    torch.manual_seed(0)
    model = WithLeaves().eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        inner = model.block.act(model.block.norm(model.block.conv(model.stem(x))))
        sigmoid = torch.sigmoid(model.block.act(inner - 0.5))
    rec = fxdebug.records(_run(fxdebug.instrument(model, capture="all"), x))
    assert [k for k in rec.keys() if k.startswith("block.") and "_" not in k][:6] == [
        "block.conv", "block.norm", "block.act", "block.mean", "block.gt", "block.sub"]
    assert torch.equal(rec["block.sigmoid"], sigmoid)
    assert rec.record("block.sigmoid").via == "eager op"
    stats = fxdebug.records(_run(fxdebug.instrument(model, capture="all", mode="stats"), x))
    assert stats.keys() == rec.keys()
    # the statistics of the eager op's own value: float64's, within the stats tests' tolerance
    assert_stats_equal(stats["block.sigmoid"], truth(sigmoid), sigmoid.dtype)


def _run(gm, x):
    with torch.no_grad():
        gm(x)
    return gm


def test_gradients_inside_an_auto_leaf_equal_retain_grad():
    torch.manual_seed(0)
    model = WithLeaves().eval()
    x = torch.randn(2, 3, 8, 8)
    kept = {}

    def keep(name):
        def hook(_module, _inputs, output):
            if name not in kept:
                output.retain_grad()
                kept[name] = output
        return hook

    handles = [model.block.conv.register_forward_hook(keep("block.conv")),
               model.other.norm.register_forward_hook(keep("other.norm"))]
    model(x).square().sum().backward()
    for handle in handles:
        handle.remove()
    model.zero_grad()
    gm = fxdebug.instrument(model, grads=True)
    gm(x).square().sum().backward()
    grads = fxdebug.records(gm).grads
    for key, tensor in kept.items():
        assert torch.allclose(grads[key], tensor.grad, rtol=1e-5, atol=1e-6), key


# -- torch.nn modules with children ---------------------------------------------------------
def test_transformer_encoder_internals_are_captured():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16),
                                torch.nn.TransformerEncoder(layer, num_layers=2)).eval()
    x = torch.randn(5, 2, 8)
    truth = hook_captures(model, x)
    assert "1.layers.1.linear2" in truth
    gm = _quiet(fxdebug.instrument, model)
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    rec = fxdebug.records(gm)
    assert rec.keys() == list(truth)
    for key in truth:
        assert torch.equal(rec[key], truth[key]), key
    everything = _quiet(fxdebug.instrument, model, capture="all")
    with torch.no_grad():
        everything(x)
    ops = [r.key for r in fxdebug.records(everything).records() if r.via == "eager op"]
    assert ops[:3] == ["1.layers.0.self_attn.multi_head_attention_forward/0",
                       "1.layers.0.add", "1.layers.0.relu"]


class _Counting(torch.nn.Module):
    """A leaf module whose forward writes to itself, with a child and a dropout inside."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)
        self.calls = 0

    def forward(self, x):
        out = self.drop(torch.relu(self.inner(x)))
        self.calls += 1
        self.last = out
        return out


class _HoldsCounting(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = torch.nn.Linear(4, 4)
        self.counting = _Counting()

    def forward(self, x):
        return self.counting(self.pre(x))


def _no_instance_forward(model):
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


def test_region_writes_land_on_the_users_module_and_nothing_stays_attached():
    import copy
    torch.manual_seed(0)
    model = _HoldsCounting().eval()
    twin = copy.deepcopy(model)  # ground truth: the same model run eagerly
    x = torch.randn(2, 4)
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[_Counting]))
    assert _no_instance_forward(model) == []
    copies = (copy.deepcopy(gm), _pickled(gm))  # before the run stores a non-leaf tensor
    out = gm(x)
    expected = twin(x)
    assert torch.equal(out, expected)
    assert model.counting.calls == 1 and torch.equal(model.counting.last, twin.counting.last)
    assert torch.equal(fxdebug.records(gm)["counting.inner"], hook_captures(twin, x)["counting.inner"])
    assert _no_instance_forward(model) == []  # nothing of fxdebug's is left on the user's modules
    model(x)  # the user's own call records nothing new
    assert model.counting.calls == 2 and fxdebug.records(gm).keys().count("counting.inner") == 1
    for other in copies:  # copies capture inside their own leaves
        other(x)
        assert "counting.inner" in fxdebug.records(other).keys() and model.counting.calls == 2


def _pickled(gm):
    import io
    buffer = io.BytesIO()
    torch.save(gm, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def test_region_follows_the_users_train_and_eval_and_cleans_up_after_an_error():
    torch.manual_seed(0)
    model = _HoldsCounting().train()
    gm = fxdebug.instrument(fxdebug.trace(model, leaf_modules=[_Counting]))
    x = torch.randn(2, 4)
    model.eval()  # on the user's model: the leaf module inside gm is the same object
    assert torch.equal(gm(x), model(x))  # no dropout: eval outputs equal
    with pytest.raises(RuntimeError):
        gm(torch.randn(2, 5))  # a wrong shape fails inside the region
    assert _no_instance_forward(model) == []
