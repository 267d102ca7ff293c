"""fxdebug.monitor's logged forwards summarize a large capture when it is made: the series still
equal float64 statistics of forward hooks and retain_grad, a later in-place op does not change
what was recorded, and neither the activation nor its gradient is kept past the point where
autograd lets it go (a plain step's memory, not every activation and gradient at once)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import fxdebug
from fxdebug.monitoring.moment_records import AT_ONCE_NUMEL

from test_monitor import (assert_out_and_grad, assert_stats, check_series, hooked,
                          one_layer_gpt2, reference, train)

WIDE = 4096  # a batch of 40 makes every hidden activation 163840 values: over AT_ONCE_NUMEL


def wide_net(inplace: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, WIDE),
                               torch.nn.ReLU(inplace=True) if inplace else torch.nn.GELU(),
                               torch.nn.Linear(WIDE, 8))


def test_large_captures_series_equal_float64_statistics_of_hooks(tmp_path):
    assert 40 * WIDE >= AT_ONCE_NUMEL
    net = wide_net()
    torch.manual_seed(1)
    batches = [torch.randn(40, 64) for _ in range(4)]
    with fxdebug.monitor(net, every=2, folder=tmp_path) as mon:
        expected = train(net, mon, 4, batches, lr=0.01)
    assert sorted(expected) == [0, 2] and "0.update" in expected[0]
    check_series(fxdebug.load_series(tmp_path), expected)


def test_an_in_place_op_after_a_large_capture_does_not_change_what_was_recorded(tmp_path):
    net = wide_net(inplace=True)
    before: dict[str, torch.Tensor] = {}
    net[0].register_forward_hook(lambda m, a, out: before.__setitem__("0", out.detach().clone()))
    x = torch.randn(40, 64)
    with fxdebug.monitor(net, every=1, folder=tmp_path) as mon:
        mon.model(x).sum().backward()
        mon.step()
    series = fxdebug.load_series(tmp_path)
    expected = reference(before["0"])
    assert expected["min"] < 0  # the ReLU that runs after the capture would have made it 0
    assert_stats({stat: series.get("0", stat, kind="out")[1][0] for stat in expected},
                 expected, "0.out (before the in-place ReLU)")


def test_large_activations_and_their_gradients_are_let_go_as_in_a_plain_step():
    net = wide_net()
    refs: list[weakref.ref] = []

    def keep_refs(module, args, output):  # the hidden activation, and its gradient when it comes
        refs.append(weakref.ref(output))
        output.register_hook(lambda grad: refs.append(weakref.ref(grad)))
    net[1].register_forward_hook(keep_refs)
    with fxdebug.monitor(net, every=1) as mon:
        assert mon.logged
        out = mon.model(torch.randn(40, 64))
        out.sum().backward()
        del out
        gc.collect()
        assert len(refs) == 2 and [ref() for ref in refs] == [None, None], (
            "the logged step keeps the activation or its gradient after the backward")
        mon.step()
    assert mon.notes == []


def test_a_hugging_face_gpt2_large_logits_equal_float64_statistics(tmp_path):
    model = one_layer_gpt2(vocab=2048, positions=64)
    x = torch.randint(0, 2048, (2, 64))
    assert 2 * 64 * 2048 >= AT_ONCE_NUMEL  # the logits are summarized when made
    kept = hooked(model, ["lm_head"])
    with pytest.warns(fxdebug.EagerFallbackWarning):
        with fxdebug.monitor(model, every=1, folder=tmp_path, select="lm_head") as mon:
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            mon.step(loss)
    assert_out_and_grad(fxdebug.load_series(tmp_path), "lm_head", kept["lm_head"])
