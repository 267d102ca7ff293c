"""Generated code and tables are byte-identical across processes and hash seeds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import sys, torch, torchvision, fxdebug
    sys.path.insert(0, "tests")
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


def _run(seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO)
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_code_and_tables_identical_across_hash_seeds():
    outputs = [_run(seed) for seed in ("0", "1", "2")]
    assert outputs[0] == outputs[1] == outputs[2]
    assert "layer1.0.conv1" in outputs[0] and "mix/split/low" in outputs[0]
    assert "0x" not in outputs[0]
