"""Records survive being copied: pickle, torch.save / torch.load, deepcopy, all_gather_object.

A copy holds new tensors whose version counters start afresh; it must read
back every capture (ground truth: forward hooks on the eager model), keep a
capture that was stale when copied stale, and notice writes made to the copy
afterwards, without ever taking the copy itself for a write.
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed as dist
import torchvision

import fxdebug
from fxdebug.errors import StaleCaptureError
from hooks import hook_captures


def _pickle(rec):
    return pickle.loads(pickle.dumps(rec))


def _torch_save(rec):
    buffer = io.BytesIO()
    torch.save(rec, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _all_gather_object(rec):
    """``dist.all_gather_object`` in a one-rank gloo group (what a DDP job sends between ranks)."""
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            gathered = [None]
            dist.all_gather_object(gathered, rec)
        finally:
            dist.destroy_process_group()
    return gathered[0]


COPIES = {"pickle": _pickle, "torch.save": _torch_save, "deepcopy": copy.deepcopy,
          "all_gather_object": _all_gather_object}


@pytest.fixture(scope="module")
def resnet_run():
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18().eval(), torch.randn(1, 3, 32, 32)
    truth = hook_captures(model, x)
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        out = gm(x)
    return fxdebug.records(gm), truth, out


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copied_records_reads_every_capture_as_the_hooks_saw_it(resnet_run, how):
    rec, truth, _ = resnet_run
    copied = COPIES[how](rec)
    assert copied.keys() == rec.keys()
    assert not [key for key in copied.keys() if copied.record(key).stale]
    for key, value in truth.items():
        assert torch.equal(copied[key], value), key
    assert "stale" not in copied.table()


@pytest.mark.parametrize("how", list(COPIES))
def test_a_copy_keeps_a_stale_capture_stale_and_sees_writes_to_itself(how):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    gm = fxdebug.instrument(model)
    out = gm(torch.randn(3, 4))
    out.detach().add_(1)                     # the user's code writes the output after the forward
    copied = COPIES[how](fxdebug.records(gm))
    assert copied.record("2").stale
    with pytest.raises(StaleCaptureError, match="'2'"):
        copied["2"]
    fresh = COPIES[how](copied)              # a copy of a copy: still stale, others still read
    assert fresh.record("2").stale and not fresh.record("0").stale
    fresh.record("0").value.mul_(2)          # a write to the copy's own tensor
    assert fresh.record("0").stale and not copied.record("0").stale
