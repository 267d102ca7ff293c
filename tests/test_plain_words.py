"""What a user prints is short and says what happened: reports, stages, snapshots, and the
hint that turns a GPT-2 run as eager glue into one exported graph.

Ground truth for the GPT-2 case: the eager model's outputs, and the same model built with
``use_cache=False``.
"""

from __future__ import annotations

import operator
import warnings

import pytest
import torch
import torchvision

import fxdebug


def _to_torch_add(gm):
    for node in gm.graph.nodes:
        if node.target is operator.add:
            node.target = torch.add
    return gm


def test_printing_a_pass_run_prints_lines_not_graphs():
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    pm = fxdebug.PassManager([fxdebug.passes.Capture(), _to_torch_add], check_inputs=(x,))
    report = pm.run(model).report
    assert len(str(report)) < 1000 and len(repr(report)) < 160
    assert repr(pm) == "<PassManager 2 pass(es), checked: capture, _to_torch_add>"
    for stage in report.stages:
        assert len(repr(stage)) < 160 and "\n" not in repr(stage)
        assert repr(stage.snapshot) == f"<GraphSnapshot {stage.name!r}: " \
                                       f"{len(stage.snapshot.views)} nodes>"
    assert repr(report.stages[-1]) == ("<Stage '_to_torch_add', modified, 148 nodes, +0 -0 ~8, "
                                       "EQUIVALENT>")
    assert len(repr(report.stages)) < 1000
    assert "def forward" in report.stages[-1].snapshot.code  # the graph is still all there


@pytest.fixture
def gpt2_config():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers, dict(vocab_size=100, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                              bos_token_id=0, eos_token_id=0)


def test_a_key_value_cache_that_keeps_gpt2_eager_is_named_with_the_fix(gpt2_config):
    transformers, config = gpt2_config
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(**config)).eval()  # use_cache=True
    ids = torch.randint(0, 100, (1, 8))
    gm = fxdebug.instrument(model)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        out = gm(ids)
        assert torch.equal(out.last_hidden_state, model(ids).last_hidden_state)
    text = " ".join(str(w.message) for w in caught if "could not trace" in str(w.message))
    assert "key/value cache (DynamicCache" in text and "use_cache=False" in text
    summary = gm.fxdebug_partial.summary()
    assert summary.splitlines()[0].endswith("5 module(s) eager")
    assert summary.splitlines()[-1].startswith("hint: 5 module(s) ran eagerly because of a "
                                               "key/value cache")

    # the fix the hint gives, in the call: one exported graph, the same numbers
    whole = fxdebug.instrument(model)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = whole(ids, use_cache=False)
        assert torch.equal(out.last_hidden_state, model(ids, use_cache=False).last_hidden_state)
    report = whole.fxdebug_partial
    assert [(p.label, p.frontend) for p in report.parts] == [("", "export")]
    assert report.eager == [] and report.hints() == []
