"""PassManager, print_tabular and diff: every pass's change made visible, and checked."""

from __future__ import annotations

import logging
import operator
import textwrap

import pytest
import torch
import torchvision

import fxdebug
from fxdebug.passes import Capture, GradHooks, Pass
from fxdebug.reporting.node_table import tabular_text
from subprocesses import fxdebug_cli, outputs_under_hash_seeds



class TwoSubs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x) - self.b(x)
        return torch.relu(y) - x


def swap_first_sub(gm):
    """A user pass: swap the operands of the first ``sub`` node (a real bug, on purpose)."""
    node = next(n for n in gm.graph.nodes if n.target is operator.sub)
    node.args = (node.args[1], node.args[0])
    return gm


def test_capture_pass_diff_lists_exactly_the_inserted_nodes():
    model = torchvision.models.resnet18()
    before = fxdebug.trace(model)
    after = fxdebug.trace(model)
    Capture()(after)
    d = fxdebug.diff(before, after)
    assert not d.removed and not d.changed
    added = [row.key for row in d.added]
    inserted = [n.meta["fxdebug_key"] for n in after.graph.nodes if n.meta.get("fxdebug_pass")]
    assert added == inserted
    assert all(row.after.pass_name == "capture" for row in d.added)
    gm = fxdebug.instrument(model)
    gm(torch.randn(1, 3, 64, 64))
    captured = [key for key in added if key.endswith(":capture")]
    assert [key[: -len(":capture")] for key in captured] == fxdebug.records(gm).keys()


def test_swapping_one_sub_shows_exactly_one_changed_row():
    before = fxdebug.trace(TwoSubs())
    after = swap_first_sub(fxdebug.trace(TwoSubs()))
    after.recompile()
    d = fxdebug.diff(before, after)
    assert [(row.mark, row.key) for row in d.rows if row.mark != " "] == [("~", "sub")]
    assert d.changed[0].changes == ("args (a, b) -> (b, a)",)
    assert "-    sub = a - b" in d.code_diff() and "+    sub = b - a" in d.code_diff()
    assert "~" in d.table() and "1 nodes" not in d.table()


def test_replacement_recorded_with_inherit_key_is_a_change_not_remove_and_add():
    before = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    after = fxdebug.trace(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU()))
    relu = next(n for n in after.graph.nodes if n.target == "1")
    with after.graph.inserting_after(relu):
        new = after.graph.call_function(torch.sigmoid, relu.args)
    relu.replace_all_uses_with(new)
    after.graph.erase_node(relu)
    fxdebug.passes.inherit_key(new, relu)
    after.recompile()
    d = fxdebug.diff(before, after)
    assert [(row.mark, row.key) for row in d.rows if row.mark != " "] == [("~", "1")]
    assert d.changed[0].changes[0] == "replaces _1"


def test_report_of_a_three_pass_run_holds_four_snapshots():
    x = torch.randn(2, 4)
    model = TwoSubs()
    pm = fxdebug.PassManager([Capture(), GradHooks(), lambda gm: gm], check_inputs=(x,))
    with pytest.warns(UserWarning, match="pass '<lambda>' changed nothing in the graph"):
        result = pm.run(model)
        gm, report = result.graph_module, result.report
    assert len(report.snapshots) == 4
    assert [stage.name for stage in report.stages] == ["input", "capture", "grads", "<lambda>"]
    assert [stage.modified for stage in report.stages[1:]] == [True, True, False]
    assert all(stage.equivalence.ok for stage in report.stages[1:])
    assert torch.equal(gm(x), model(x))


def test_a_pass_that_changes_numbers_is_named_with_the_node():
    x = torch.randn(2, 4)
    pm = fxdebug.PassManager([Capture(), swap_first_sub], check_inputs=(x,))
    with pytest.raises(fxdebug.PassEquivalenceError) as info:
        pm.run(TwoSubs())
    error = info.value
    assert error.pass_name == "swap_first_sub"
    assert "'swap_first_sub' (after 'capture')" in str(error)
    assert "first divergent node: sub (operator.sub, tests/test_passes.py:" in str(error)
    assert len(error.report.snapshots) == 3 and not error.report.stages[-1].equivalence.ok


class Explodes(Pass):
    name = "explodes"

    def run(self, gm):
        raise ValueError("cannot handle node 'sub_1'")


def test_a_pass_that_raises_keeps_its_type_and_names_itself_and_the_earlier_passes():
    pm = fxdebug.PassManager([Capture(), GradHooks(), Explodes()])
    with pytest.raises(ValueError, match="cannot handle") as info:
        pm.run(TwoSubs())
    note = "\n".join(info.value.__notes__)
    assert "pass 'explodes' failed at node 'sub_1' (after 'capture', 'grads'" in note
    assert len(info.value.report.snapshots) == 3


def test_pass_returning_garbage_is_named():
    with pytest.raises(TypeError, match="pass 'bad' returned int"):
        fxdebug.PassManager([fxdebug.passes.as_pass(_bad)]).run(TwoSubs())


def _bad(gm):
    return 3


_bad.__name__ = "bad"


def test_progress_is_logged_without_forcing_a_level(caplog):
    assert logging.getLogger("fxdebug").level == logging.NOTSET
    with caplog.at_level(logging.INFO, logger="fxdebug"):
        fxdebug.PassManager([Capture()]).run(TwoSubs())
    assert "pass capture: modified=True nodes +" in caplog.text


def test_tabular_has_canonical_targets_shapes_and_sources(hooks):
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 64, 64)
    gm = fxdebug.trace(model)
    text = tabular_text(gm, x)
    assert "0x" not in text and "built-in" not in text
    assert "torch.flatten" in text and "operator.add" in text  # `out += identity`, lowered
    shapes = {key: "x".join(map(str, t.shape)) for key, t in hooks(model, x).items()}
    rows = {line.split()[0]: line.split() for line in text.splitlines()[2:]}
    for key in ("conv1", "layer1.0.conv1", "layer4.1.relu_1", "fc"):
        assert shapes[key] in rows[key], key
    assert "torchvision/models/resnet.py:" in rows["layer1.0.conv1"][-2]
    assert rows["layer1.0.iadd"][-3] == "layer1.0"  # module column of a function node


def test_shapes_run_leaves_the_model_untouched():
    model = torchvision.models.resnet18()  # training mode: a forward would update BN statistics
    stats = model.bn1.running_mean.clone()
    tabular_text(fxdebug.trace(model), torch.randn(2, 3, 64, 64))
    assert torch.equal(model.bn1.running_mean, stats) and model.training and model.bn1.training


def test_print_tabular_without_inputs(capsys):
    fxdebug.print_tabular(fxdebug.instrument(TwoSubs()))
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:4] == ["key", "opcode", "name", "target"]
    assert "capture" in out and "0x" not in out


SCRIPT = textwrap.dedent("""
    import sys, torch, torchvision, fxdebug
    from test_passes import TwoSubs, swap_first_sub
    torch.manual_seed(0)
    x = torch.randn(1, 3, 64, 64)
    gm, report = fxdebug.PassManager([fxdebug.passes.Capture(), fxdebug.passes.GradHooks()],
                                     check_inputs=(x,)).run(torchvision.models.resnet18())
    for stage in report.stages:
        print(stage.snapshot.table())
        if stage.diff is not None:
            print(stage.diff.table(unchanged=True))
            print(stage.diff.code_diff())
    print(report.table())
    print(fxdebug.diff(fxdebug.trace(TwoSubs()), swap_first_sub(fxdebug.trace(TwoSubs()))).table())
""")


def test_tables_and_code_diffs_identical_across_hash_seeds():
    outputs = outputs_under_hash_seeds(SCRIPT)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "0x" not in outputs[0] and "+++ after" in outputs[0]


def _cli(*args):
    return fxdebug_cli(*args)


def test_cli_passes_prints_each_diff_and_code_diffs():
    result = _cli("passes", "--input", "1,3,64,64", "--pass", "capture", "--pass", "grads",
                  "--check")
    assert result.returncode == 0, result.stderr
    assert "== pass capture: +77 -0 ~0" in result.stdout
    assert "== pass grads: +76 -0 ~1" in result.stdout  # 75 hooks and the view of x conv1 reads
    assert result.stdout.rstrip().splitlines()[-1].split() == ["grads", "yes", "+76", "-0", "~1", "ok"]
    code = _cli("passes", "--input", "1,3,64,64", "--pass", "capture", "--code")
    assert code.returncode == 0 and "+++ after" in code.stdout
    bad = _cli("passes", "--pass", "nope")
    assert bad.returncode == 2 and "choose from capture, grads" in bad.stderr
