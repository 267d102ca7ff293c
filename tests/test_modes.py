"""An instrumented module follows train() / eval() like its model, whichever object is switched.

Ground truth: an independent copy of the model run eagerly in the same mode with the
same seed (dropout and stochastic depth draw the same numbers).
"""

from __future__ import annotations

import copy
import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision

import fxdebug
from fxdebug.runtime import leaves

# the classification models the suite builds (benchmarks/zoo.py FAST, test_instrument.py,
# test_value_facts.py, test_dump_portable.py) and those the train/eval switch trips
ZOO = {
    "resnet18": lambda: torchvision.models.resnet18(),
    "mobilenet_v3_small": lambda: torchvision.models.mobilenet_v3_small(),
    "squeezenet1_1": lambda: torchvision.models.squeezenet1_1(),
    "regnet_x_400mf": lambda: torchvision.models.regnet_x_400mf(),
    "shufflenet_v2_x0_5": lambda: torchvision.models.shufflenet_v2_x0_5(),
    "efficientnet_b0": lambda: torchvision.models.efficientnet_b0(),
    "vgg11": lambda: torchvision.models.vgg11(),
    "convnext_tiny": lambda: torchvision.models.convnext_tiny(),
    "googlenet": lambda: torchvision.models.googlenet(aux_logits=True, init_weights=False),
    "vit": lambda: torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32,
        dropout=0.5, attention_dropout=0.5),
    "densenet": lambda: torchvision.models.DenseNet(growth_rate=8, block_config=(2, 2),
                                                   num_init_features=16, drop_rate=0.5),
}


def _outputs(value) -> list:
    return [tensor for _, tensor in leaves(value, is_leaf=lambda v: isinstance(v, torch.Tensor))]


def _run(module, x, seed=0):
    torch.manual_seed(seed)
    with torch.no_grad():
        return module(x)


def _assert_same(got, expected):
    assert type(got) is type(expected)
    got, expected = _outputs(got), _outputs(expected)
    assert len(got) == len(expected) > 0
    for a, b in zip(got, expected):
        assert torch.equal(a, b), (a - b).abs().max().item()


@pytest.mark.parametrize("name", list(ZOO))
@pytest.mark.parametrize("start", ["train", "eval"])
def test_instrumented_in_one_mode_runs_like_eager_in_the_other(name, start):
    # the model itself is the ground truth: in train mode BatchNorm normalises with the
    # batch's statistics (the running ones it updates are not read), in eval mode nothing
    # is updated
    torch.manual_seed(0)
    model = ZOO[name]().train(start == "train")
    size = 32 if name == "vit" else 64
    x = torch.randn(2, 3, size, size)
    gm = fxdebug.instrument(model, depth=1)
    if start == "train":
        gm.eval()  # the user switches the instrumented module...
        model.eval()  # (the model's own root, for the eager run)
    else:
        model.train()  # ... or the model
    _assert_same(_run(gm, x), _run(model, x))
    assert len(fxdebug.records(gm).keys()) > 0


class Drop(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return F.dropout(self.fc(x), p=0.5, training=self.training)


def test_dropout_reading_self_training_follows_gm_eval():
    model = Drop().train()
    gm = fxdebug.instrument(model)
    assert "training = True" in gm.code
    gm.eval()
    assert "training = False" in gm.code  # gm.eval() swaps the graph at once
    x = torch.randn(4, 8)
    assert torch.equal(_run(gm, x), model.fc(x).detach())
    gm.train()
    assert torch.equal(_run(gm, x, seed=3), _run(_with(model, True), x, 3))


def _with(model, training):
    twin = copy.deepcopy(model)
    return twin.train(training)


def test_googlenet_returns_its_outputs_tuple_in_train_mode():
    torch.manual_seed(0)
    model = torchvision.models.googlenet(aux_logits=True, init_weights=False).eval()
    gm = fxdebug.instrument(model)
    x = torch.randn(2, 3, 64, 64)
    assert isinstance(_run(gm, x), torch.Tensor)
    model.train()
    out = _run(gm, x)
    assert type(out).__name__ == "GoogLeNetOutputs"
    assert "aux1" in fxdebug.records(gm).keys()  # the train graph's own keys


def test_switching_a_submodule_on_either_side():
    torch.manual_seed(0)
    model = torchvision.models.efficientnet_b0().eval()  # features.3: stochastic depth p>0
    gm = fxdebug.instrument(model, depth=1)
    truth = copy.deepcopy(model)
    x = torch.randn(2, 3, 64, 64)
    gm.get_submodule("features.3").train()  # gm's own container of a traced-through module
    truth.features[3].train()
    _assert_same(_run(gm, x), _run(truth, x))
    assert model.features[3][0].training  # the model's side takes it (one model)
    model.features[3].eval(), truth.features[3].eval()  # now the model's side
    _assert_same(_run(gm, x), _run(truth, x))
    assert not gm.get_submodule("features.3").training


def test_mode_switch_survives_copies_and_pickles(tmp_path):
    torch.manual_seed(0)
    model = Drop().eval()
    gm = fxdebug.instrument(model)
    x = torch.randn(4, 8)
    for copied in (copy.deepcopy(gm), pickle.loads(pickle.dumps(gm))):
        inner = copied.meta["fxdebug_modes"].model
        assert inner is not model
        inner.train()
        expected = _run(_with(inner, True), x, 5)
        assert torch.equal(_run(copied, x, 5), expected)
        copied.eval()
        assert torch.equal(_run(copied, x), inner.fc(x).detach())
    assert not model.training and "training = False" in gm.code  # the original untouched


def test_dump_is_made_and_runs_in_the_mode_it_was_made_in(tmp_path):
    torch.manual_seed(0)
    model = Drop().train()
    gm = fxdebug.instrument(model)
    model.eval()  # no call in between: dump takes the eval graph
    x = torch.randn(4, 8)
    fxdebug.dump(gm, x, folder=tmp_path / "dumped")
    source = (tmp_path / "dumped" / "module.py").read_text()
    assert "TRAINING = False" in source and "training = False" in source


def test_ddp_world_of_one_follows_model_eval():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(),
                              torch.nn.Dropout(0.5), torch.nn.Linear(6, 3))
    x = torch.randn(5, 4)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(folder, 'store')}",
                                rank=0, world_size=1)
        try:
            ddp = torch.nn.parallel.DistributedDataParallel(net)
            gm = fxdebug.instrument(ddp)
            eager = copy.deepcopy(net)
            _assert_same(_run(gm, x), _run(eager, x))  # train: batch statistics, dropout
            ddp.eval(), eager.eval()
            _assert_same(_run(gm, x), _run(eager, x))
            assert torch.equal(fxdebug.records(gm)["module.1"], eager[1](eager[0](x)).detach())
            gm.train(), eager.train()  # the instrumented copy switched: the same
            _assert_same(_run(gm, x, 7), _run(eager, x, 7))
        finally:
            dist.destroy_process_group()


def test_many_instrumented_modules_compiled_in_one_process_keep_fullgraph():
    """Past dynamo's recompile limit for the code every DebugGraphModule shares, the mode check
    runs as plain Python: compiling an eleventh instrumented module still gives one graph."""
    for seed in range(11):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5),
                                    torch.nn.ReLU()).eval()
        gm = fxdebug.instrument(model)
        x = torch.randn(3, 4)
        out = torch.compile(gm, backend="eager", fullgraph=True)(x)
        assert torch.equal(out, model(x))
        assert torch.equal(fxdebug.records(gm)["2"], out)
