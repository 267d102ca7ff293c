"""Generated code and tables are byte-identical across processes and hash seeds."""

from __future__ import annotations

import textwrap

from subprocesses import outputs_under_hash_seeds

SCRIPT = textwrap.dedent("""
    import sys, torch, torchvision, fxdebug
    from models import NestedOutputs
    torch.manual_seed(0)
    for model, x, capture in ((torchvision.models.resnet18().eval(), torch.randn(1, 3, 64, 64), "modules"),
                              (NestedOutputs().eval(), torch.randn(2, 8), "all")):
        for mode in ("tensor", "stats"):
            gm = fxdebug.instrument(model, capture=capture, mode=mode)
            with torch.no_grad():
                gm(x)
            print(gm.code)
            print(fxdebug.records(gm).table())
""")


def test_code_and_tables_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "layer1.0.conv1" in outputs[0] and "mix/split/low" in outputs[0]
    assert "0x" not in outputs[0]
