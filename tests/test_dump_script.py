"""Dumps of script and notebook models: fx.wrap'd functions of __main__ are copied as source."""

from __future__ import annotations

import os
import runpy
import sys
import textwrap

import pytest
import torch

import fxdebug

SCRIPT = textwrap.dedent('''
    import math
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    import fxdebug

    SCALE = 0.5
    OFFSETS = (1.0, -2.0)


    def _shifted(t):
        return t * SCALE + OFFSETS[0]


    @torch.fx.wrap
    def clamp_if_large(x, lo):
        if float(x.detach().abs().max()) > 1e6:  # a value-dependent branch: why it is wrapped
            return x
        return F.relu(_shifted(x) - lo) + math.pi


    class ScriptNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return clamp_if_large(self.lin(x), OFFSETS[1])


    torch.manual_seed(0)
    model = ScriptNet().eval()
    x = torch.randn(2, 4)
    fxdebug.dump(fxdebug.trace(model), x, folder=sys.argv[1])
    torch.save({"x": x, "eager": model(x)}, sys.argv[2])
''')


def _load(folder):
    path = os.path.join(folder, "module.py")
    namespace = {"__file__": path, "__name__": "dumped_script_net"}
    with open(path) as handle:
        exec(compile(handle.read(), path, "exec"), namespace)
    return namespace


def test_wrapped_function_of_the_script_is_copied_with_what_it_uses(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    monkeypatch.setattr(sys, "argv", [str(script), str(tmp_path / "dumped"), str(tmp_path / "eager.pt")])
    runpy.run_path(str(script), run_name="__main__")  # as `python train.py` runs it
    truth = torch.load(tmp_path / "eager.pt", weights_only=True)
    code = (tmp_path / "dumped" / "module.py").read_text()
    for line in ("import math", "import torch.nn.functional as F", "SCALE = 0.5",
                 "OFFSETS = (1.0, -2.0)", "def _shifted(t):", "@torch.fx.wrap",
                 "def clamp_if_large(x, lo):"):
        assert line in code.splitlines(), line
    assert "class ScriptNet" not in code.split("# -- copied")[1].split("\nclass ")[0]
    namespace = _load(str(tmp_path / "dumped"))
    with torch.no_grad():
        assert torch.equal(namespace["load"]()(truth["x"]), truth["eager"])
    again = fxdebug.trace(namespace["load"]())  # still one call: fx.wrap'd again in module.py
    assert [n.target.__name__ for n in again.graph.nodes if n.op == "call_function"] == ["clamp_if_large"]
    readme = (tmp_path / "dumped" / "README.md").read_text()
    assert "`_shifted`, `clamp_if_large`" in readme


def test_a_function_without_source_is_refused_by_name(tmp_path):
    namespace = {"__name__": "__main__", "torch": torch}
    exec(compile("def typed_at_prompt(x):\n    return x * 2\n", "<stdin>", "exec"), namespace)
    exec(compile("torch.fx.wrap('typed_at_prompt')\n", "<stdin>", "exec"), namespace)

    class UsesIt(torch.nn.Module):
        def forward(self, x):
            return namespace["typed_at_prompt"](x)

    gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    last = [n for n in gm.graph.nodes if n.op == "call_module"][-1]
    with gm.graph.inserting_after(last):
        node = gm.graph.call_function(namespace["typed_at_prompt"], (last,))
    node.meta["fxdebug_key"] = "doubled"
    last.replace_all_uses_with(node, delete_user_cb=lambda user: user is not node)
    gm.recompile()
    with pytest.raises(fxdebug.FxdebugError) as caught:
        fxdebug.dump(gm, torch.ones(1, 2), folder=tmp_path / "out")
    message = str(caught.value)
    assert "node 'doubled'" in message and "typed_at_prompt" in message
    assert "interactive prompt" in message and "Define it in a file" in message
    assert os.listdir(tmp_path) == []
