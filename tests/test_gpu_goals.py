"""benchmarks/gpu_goals.py, the table a GPU session runs first: its GPT traces and instruments
faithfully (outputs and captures against eager forward hooks), and the script runs to the end.

The timings themselves are the benchmark's business; here only that every row is there.
"""

from __future__ import annotations

import os

import torch

import fxdebug
import gpu_goals  # benchmarks/gpu_goals.py, on the path through pyproject's pythonpath
from subprocesses import REPO, child_env, python


def test_the_gpt_of_the_goals_is_captured_as_eager_computes_it():
    torch.manual_seed(0)
    model = gpu_goals.GPT(layers=2, width=32, heads=4, vocabulary=50, context=16).eval()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = {}
    hooks = [module.register_forward_hook(
        lambda mod, args, out, name=name: seen.__setitem__(name, out.detach().clone()))
        for name, module in model.named_modules() if name]
    with torch.no_grad():
        expected = model(idx)
    for hook in hooks:
        hook.remove()
    gm = fxdebug.instrument(model)
    with torch.no_grad():
        torch.testing.assert_close(gm(idx), expected, rtol=0, atol=0)
    records = fxdebug.records(gm)
    assert "fxdebug_auto_leaves" in gm.meta and gm.meta["fxdebug_auto_leaves"] == []
    for name in ("h.0.attn", "h.1.mlp.1", "ln_f", "lm_head"):
        torch.testing.assert_close(records[name], seen[name], rtol=0, atol=0)


def test_the_script_gives_every_row_on_the_cpu():
    script = os.path.join(REPO, "benchmarks", "gpu_goals.py")
    child = python([script, "--quick", "--models", "gpt2", "--repeats", "1", "--warmup", "0"],
                   cwd=REPO, env=child_env())
    assert child.returncode == 0, child.stderr
    rows = [line for line in child.stdout.splitlines() if line.startswith("| ")]
    labels = [row.split("|")[1].strip() for row in rows[1:]]
    assert labels == [label for label in gpu_goals.ROWS if "CUDA graph" not in label]
    goals = [row for row in rows[1:] if "(<=" in row]
    assert len(goals) == 5 and all(("met" in row) or ("MISSED" in row) for row in goals)
    assert "not measured" not in child.stdout
