"""transformers models (tiny configs, random weights): captures per layer under module paths.

Ground truth: eager outputs and forward hooks on the same modules.
"""

from __future__ import annotations

import pytest
import torch

import fxdebug
from hooks import hook_captures
from subprocesses import REPO, fxdebug_cli
from tiny_transformers import quiet as _quiet

transformers = pytest.importorskip("transformers")

import transformer_layers  # noqa: E402  examples/: the tiny-config factories the example and the CLI use

transformers.logging.set_verbosity_error()
MODELS = {"bert": "encoder.layer.1.", "gpt2": "h.1.", "llama": "layers.1."}


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request):
    torch.manual_seed(0)
    model, (ids,) = getattr(transformer_layers, request.param)()
    with torch.no_grad():
        expected = model(ids).last_hidden_state
    return request.param, model, ids, expected, hook_captures(model, ids)


def test_instrument_captures_every_layer_like_forward_hooks(tiny):
    name, model, ids, expected, truth = tiny
    instrumented = fxdebug.instrument(model)  # the root cannot be traced: parts
    with torch.no_grad():
        out = _quiet(instrumented, ids)
    assert torch.equal(out.last_hidden_state, expected)
    rec = fxdebug.records(instrumented)
    layer = [key for key in rec.keys() if key.startswith(MODELS[name])]
    assert len(layer) >= 8, layer
    assert rec.keys() == list(truth)
    for key in truth:
        assert torch.equal(rec[key], truth[key]), key
    # symbolic tracing with symbolic arguments cannot make a graph of the root; with the call's
    # arguments fixed it can, through the decorators that wrap forward in (*args, **kwargs)
    # (BertModel); where the mask code branches on shapes (GPT2Model, LlamaModel) torch.export can
    root = instrumented.fxdebug_partial.parts[0]
    assert root.path == "" and (root.frontend, bool(root.fx_reason)) in (("fx", False), ("export", True))
    assert root.frontend == ("fx" if name == "bert" else "export")
    assert instrumented.fxdebug_partial.eager == []


def test_export_front_end_keys_are_module_paths(tiny):
    name, model, ids, expected, truth = tiny
    gm = _quiet(fxdebug.trace, model, ids, frontend="auto")
    assert gm.meta["fxdebug_frontend"] == "export"
    instrumented = fxdebug.instrument(gm)
    with torch.no_grad():
        assert torch.equal(instrumented(ids).last_hidden_state, expected)
    rec = fxdebug.records(instrumented)
    assert any(key.startswith(MODELS[name]) for key in rec.keys())
    for key in truth:
        if key in rec:
            assert torch.equal(rec[key], truth[key]), key
    # only modules that compute nothing in eval mode (dropout) have no node in the graph
    missing = [key for key in truth if key not in rec]
    assert missing == []  # Identity and eval-mode Dropout get an alias node when exported


def test_cli_summary_through_a_factory():
    result = fxdebug_cli("summary", "examples/transformer_layers.py:gpt2", "--depth", "3", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "h.1.attn.c_attn" in result.stdout and "h.1.mlp" in result.stdout
    assert "input 1x8" in result.stdout
    assert "eager modules (run as Python" in result.stdout
