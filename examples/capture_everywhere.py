"""capture="all" means all, also where the model runs eagerly.

A block torch.fx cannot trace (a branch on a value) becomes an auto-leaf, and a
torch.nn.TransformerEncoder is a leaf of every fx graph: the graph calls each
as one node. fxdebug still captures every module call inside them (keyed per
call, as forward hooks count calls) and, with capture="all", every torch op,
e.g. the attention scores and the softmax. Each record says how it was captured.

Run: python examples/capture_everywhere.py
"""
import warnings

import torch

import fxdebug


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.act = torch.nn.GELU()

    def forward(self, x):
        y = self.act(self.fc(x))
        if y.mean() > 0:  # a branch on a value: fx makes this module a leaf
            y = y * 0.5
        return torch.softmax(y @ y.transpose(-1, -2), dim=-1) @ y


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.gated = Gated()

    def forward(self, x):
        return self.gated(self.encoder(x))


def main():
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(4, 2, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the auto-leaf warning
        gm = fxdebug.instrument(model, capture="all")
    with torch.no_grad():
        assert torch.equal(gm(x), model(x))
    rec = fxdebug.records(gm)
    for key in ("encoder.layers.0.linear1", "gated.fc", "gated.matmul", "gated.softmax", "gated"):
        record = rec.record(key)
        print(f"{key:28} {record.via:13} {record.op:30} {tuple(record.shape)}")
    probabilities = rec["gated.softmax"]
    assert torch.allclose(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))
    print(f"ok: {len(rec)} tensors captured, "
          f"{sum(r.via == 'eager op' for r in rec.records())} of them ops inside leaf modules")


if __name__ == "__main__":
    main()
