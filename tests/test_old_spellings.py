"""Renamed names and arguments: the old spelling works for one release, with a
FxdebugDeprecationWarning that names the new one, and gives what the new spelling gives."""

from __future__ import annotations

import os

import pytest
import torch

import fxdebug
from fxdebug.errors import renamed_arguments

OLD = fxdebug.FxdebugDeprecationWarning


def _net() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


class _Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_the_warning_is_a_deprecation_warning_and_an_fxdebug_warning():
    assert issubclass(OLD, DeprecationWarning) and issubclass(OLD, fxdebug.FxdebugWarning)


def test_vjp_of_is_output():
    net, x = _net(), torch.randn(2, 3)
    with pytest.warns(OLD, match=r"vjp\(of=\).*use vjp\(output=\)"):
        old = fxdebug.vjp(net, x, of="2", wrt="0")
    torch.testing.assert_close(old, fxdebug.vjp(net, x, output="2", wrt="0"), rtol=0, atol=0)
    with pytest.raises(TypeError, match="both of= and output="), pytest.warns(OLD):
        fxdebug.vjp(net, x, of="2", output="2", wrt="0")


def test_find_nonfinite_backward_is_grads():
    x = -torch.ones(2)
    with pytest.warns(OLD, match=r"find_nonfinite\(backward=\).*use find_nonfinite\(grads=\)"):
        old = fxdebug.find_nonfinite(_Log(), x, backward=False)
    new = fxdebug.find_nonfinite(_Log(), x, grads=False)
    assert (old.forward.key, old.backward_ran) == (new.forward.key, new.backward_ran) == ("log", False)


def test_instrument_save_to_is_folder_and_flush_is_records(tmp_path):
    net, x = _net(), torch.randn(2, 3)
    with pytest.warns(OLD, match=r"instrument\(save_to=\).*use instrument\(folder=\)"):
        old = fxdebug.instrument(net, save_to=tmp_path / "old")
    new = fxdebug.instrument(net, folder=tmp_path / "new")
    old(x), new(x)
    with pytest.warns(OLD, match=r"fxdebug.flush\(gm\).*use fxdebug.records\(gm\)"):
        fxdebug.flush(old)
    assert os.listdir(tmp_path / "old") == ["run-000001"]
    assert os.path.exists(tmp_path / "old" / "run-000001" / "manifest.json")
    read_old, read_new = fxdebug.load_records(tmp_path / "old"), fxdebug.records(new)
    assert read_old.keys() == read_new.keys() == ["0", "1", "2"]
    for key in read_old.keys():
        torch.testing.assert_close(read_old[key], read_new[key], rtol=0, atol=0)


def test_save_and_load_records_path_is_folder(tmp_path):
    gm = fxdebug.instrument(_net())
    gm(torch.randn(2, 3))
    with pytest.warns(OLD, match=r"save_records\(path=\).*use save_records\(folder=\)"):
        saved = fxdebug.save_records(fxdebug.records(gm), path=tmp_path / "r")
    with pytest.warns(OLD, match=r"load_records\(path=\).*use load_records\(folder=\)"):
        old = fxdebug.load_records(path=saved)
    new = fxdebug.load_records(folder=saved)
    assert old.keys() == new.keys() == ["0", "1", "2"]
    torch.testing.assert_close(old["2"], fxdebug.records(gm)["2"], rtol=0, atol=0)


def test_dump_folder_before_the_inputs(tmp_path):
    gm, x = fxdebug.instrument(_net()), torch.randn(2, 3)
    with pytest.warns(OLD, match=r"dump\(gm, folder, \*inputs\).*dump\(gm, \*inputs, folder=folder\)"):
        old = fxdebug.dump(gm, tmp_path / "old", x)
    new = fxdebug.dump(gm, x, folder=tmp_path / "new")
    assert sorted(os.listdir(old)) == sorted(os.listdir(new))
    for name in ("module.py", "run.py"):
        with open(os.path.join(old, name)) as a, open(os.path.join(new, name)) as b:
            assert a.read() == b.read()
    with pytest.raises(fxdebug.FxdebugError, match="needs the folder"):
        fxdebug.dump(gm, x)


def test_compare_runs_positional_tolerances(tmp_path):
    gm = fxdebug.instrument(_net())
    gm(torch.randn(2, 3))
    a = fxdebug.records(gm)
    gm(torch.randn(2, 3))
    b = fxdebug.records(gm)
    with pytest.warns(OLD, match=r"rtol, atol by position in compare_runs\(\)"):
        old = fxdebug.compare_runs(a, b, 1e-3, 1e-5)
    new = fxdebug.compare_runs(a, b, rtol=1e-3, atol=1e-5)
    assert (old.ok, old.first_divergence.key) == (new.ok, new.first_divergence.key) == (False, "0")
    with pytest.raises(TypeError, match="takes 2 positional"):
        fxdebug.compare_runs(a, b, 1e-3, 1e-5, 1.0)


def test_watch_close_is_remove_and_the_watch_is_a_context_manager():
    from torch.nn.modules import module as torch_module
    hooks = vars(torch_module).get("_global_parameter_registration_hooks", {})
    with fxdebug.watch_nonfinite(_net()) as watch:
        watch(torch.randn(2, 3)).sum().backward()
        assert watch.check() is None
        assert any(hook is watch._registrations for hook in hooks.values())
    assert not any(hook is watch._registrations for hook in hooks.values())
    watch(torch.randn(2, 3))  # a later step registers them again
    with pytest.warns(OLD, match=r"NonfiniteWatch.close\(\).*use NonfiniteWatch.remove\(\)"):
        watch.close()
    assert not any(hook is watch._registrations for hook in hooks.values())


def test_the_eager_watch_path_is_the_one_watch_without_compiled_code():
    with pytest.warns(OLD, match="use fxdebug.watch_nonfinite"):
        old = fxdebug.nonfinite.watch_nonfinite(_Log())
    new = fxdebug.watch_nonfinite(_Log())
    assert type(old) is type(new) is fxdebug.NonfiniteWatch
    assert old.check_compiled is None and new.check_compiled is fxdebug.check_compiled
    for watch in (old, new):
        watch(-torch.ones(2, requires_grad=True)).sum().backward()
        assert watch.check().forward.key == "log"
    with pytest.raises(TypeError, match="expects an nn.Module"):
        fxdebug.watch_nonfinite(torch.log)


def test_backend_records_method_is_fxdebug_records():
    net, x = _net(), torch.randn(2, 3)
    be = fxdebug.backend(inner="eager")
    compiled = torch.compile(net, backend=be)
    torch._dynamo.reset()
    compiled(x)
    new = fxdebug.records(be)
    with pytest.warns(OLD, match=r"backend.records\(\).*use fxdebug.records\(backend\)"):
        old = be.records()
    assert old is new and new.keys() == ["0", "1", "2"]
    assert not hasattr(be, "named_parameters")


def test_pass_manager_result_unpacked_as_a_tuple():
    net, x = _net(), torch.randn(2, 3)
    result = fxdebug.PassManager([fxdebug.passes.Capture()], check_inputs=(x,)).run(net)
    assert result.modified and result.report.stages[-1].name == "capture"
    with pytest.warns(OLD, match=r"gm, report = PassManager\(...\).run\(model\)"):
        gm, report = result
    assert gm is result.graph_module and report is result.report
    untouched = fxdebug.PassManager([]).run(net)
    assert not untouched.modified


def test_one_helper_refuses_what_no_spelling_allows():
    @renamed_arguments({"old": "new"}, keyword_only=("a", "b"))
    def f(x, *, new=None, a=None, b=None):
        return x, new, a, b

    assert f(1, new=2, a=3) == (1, 2, 3, None)
    with pytest.warns(OLD):
        assert f(1, 3, old=2) == (1, 2, 3, None)
    with pytest.raises(TypeError, match="multiple values for argument 'a'"), pytest.warns(OLD):
        f(1, 3, a=3)
