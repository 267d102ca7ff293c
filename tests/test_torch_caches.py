"""torch's own caches hold torch's functions after every fxdebug entry point, as in a fresh process.

Ground truth: a process that never imports fxdebug records what torch's caches
hold (``torch.overrides``' lru_caches, torch.fx's wrap registry, dynamo's rule
tables) as qualified names with their type and file. Another process empties
those caches before each public entry point, runs it, and records them again:
both must be the same. Then a tool that trusts ``get_ignored_functions()`` the
way torchlens does runs after ``instrument``.
"""

from __future__ import annotations

import json
import textwrap

from subprocesses import run_python

_FINGERPRINTS = textwrap.dedent("""
    import functools, json, os, sys
    import numpy, torch, torch.fx, torchvision
    import torch._dynamo.trace_rules as trace_rules
    import torch.fx._symbolic_trace as symbolic_trace
    import torch.overrides as overrides

    def name(obj):
        code = getattr(obj, "__code__", None)
        where = os.path.basename(code.co_filename) if code is not None else ""
        qualname = obj if isinstance(obj, str) else getattr(obj, "__qualname__", "")
        return f"{getattr(obj, '__module__', '')}.{qualname}[{type(obj).__name__}]{where}"

    def fingerprints():
        found = {
            "get_ignored_functions": sorted(map(name, overrides.get_ignored_functions())),
            "get_testing_overrides": sorted(map(name, overrides.get_testing_overrides())),
            "get_overridable_functions": sorted(
                name(f) for fs in overrides.get_overridable_functions().values() for f in fs),
            "_get_tensor_methods": sorted(map(name, overrides._get_tensor_methods())),
            "get_default_nowrap_functions": sorted(
                map(name, overrides.get_default_nowrap_functions())),
            "fx wrap registry": sorted(n for _, n in symbolic_trace._wrapped_fns_to_patch),
            "dynamo get_torch_obj_rule_map": sorted(  # (torch.* keys: what the patches touch)
                name(k) for k in trace_rules.get_torch_obj_rule_map()
                if getattr(k, "__module__", None) == "torch"),
        }
        return found

    CACHES = [overrides.get_ignored_functions, overrides.get_testing_overrides,
              overrides._get_overridable_functions, overrides._get_tensor_methods,
              overrides.get_default_nowrap_functions]  # (dynamo's map: polyfills add to it)
""")

_FRESH = _FINGERPRINTS + "print(json.dumps(fingerprints()))\n"

_AFTER_EACH_ENTRY_POINT = _FINGERPRINTS + textwrap.dedent("""
    import pathlib, tempfile, warnings
    import fxdebug
    from test_good_guest import _entry_points
    warnings.simplefilter("ignore")
    folder = pathlib.Path(tempfile.mkdtemp())
    entry_points = _entry_points(folder)  # (builds a few instrumented models first)
    after = {}
    for label, call in entry_points.items():
        for cache in CACHES:
            cache.cache_clear()  # cold, as in a process where this entry point comes first
        call()
        after[label] = fingerprints()
    print(json.dumps(after))
""")

_TRUSTING_TOOL = textwrap.dedent("""
    import torch, torchvision, fxdebug
    from torch.overrides import get_ignored_functions

    def wrap_torch(names):
        # as torchlens does: every torch function torch does not call ignored gets a wrapper
        # that asks torch's state; were is_grad_enabled not the ignored one, it would recurse
        ignored, calls, originals = get_ignored_functions(), [], {}
        for name in names:
            function = getattr(torch, name)
            if function in ignored:
                continue
            originals[name] = function
            def wrapper(*args, _function=function, _name=name, **kwargs):
                calls.append((_name, torch.is_grad_enabled()))
                return _function(*args, **kwargs)
            setattr(torch, name, wrapper)
        return originals, calls

    model = torchvision.models.resnet18()
    gm = fxdebug.instrument(model)
    originals, calls = wrap_torch(["is_grad_enabled", "from_numpy", "relu", "flatten"])
    try:
        torch.relu(torch.ones(2))
        torch.flatten(torch.ones(2, 2))
    finally:
        for name, function in originals.items():
            setattr(torch, name, function)
    print(sorted(originals), calls)
""")

_PATCH_CACHED_INSIDE_A_TRACE = textwrap.dedent("""
    import torch, fxdebug
    from torch.overrides import get_ignored_functions

    class AsksTorch(torch.nn.Module):  # a forward that fills torch's cache mid-trace
        def forward(self, x):
            get_ignored_functions.cache_clear()
            get_ignored_functions()
            return x + 1

    fxdebug.trace(AsksTorch())
    ignored = get_ignored_functions()
    print(torch.is_grad_enabled in ignored, torch.from_numpy in ignored)
""")


def test_torch_caches_after_every_entry_point_equal_a_fresh_process():
    fresh = run_python(_FRESH)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    expected = json.loads(fresh.stdout.splitlines()[-1])
    run = run_python(_AFTER_EACH_ENTRY_POINT)
    assert run.returncode == 0, run.stderr[-3000:]
    after = json.loads(run.stdout.splitlines()[-1])
    assert len(after) > 15  # trace, instrument, find_nonfinite, check_equivalence, lint, dump...
    rules = "dynamo get_torch_obj_rule_map"
    assert any(n.startswith("torch.is_grad_enabled[builtin") for n in expected[rules])
    for label, caches in after.items():
        for cache, names in caches.items():
            if cache == rules:  # which polyfills torch registered depends on import order:
                shared = {n.split("[")[0] for n in names} & {n.split("[")[0] for n in expected[rules]}
                names = [n for n in names if n.split("[")[0] in shared]  # the same torch names,
                expected[rules] = [n for n in expected[rules] if n.split("[")[0] in shared]
                assert "torch.is_grad_enabled" in shared  # and each the same object kind, file
            missing = sorted(set(expected[cache]) - set(names))
            extra = sorted(set(names) - set(expected[cache]))
            assert not missing and not extra, (label, cache, missing[:5], extra[:5])


def test_a_tool_that_trusts_get_ignored_functions_works_after_instrument():
    """torchlens' pattern: before the fix it recursed, is_grad_enabled wrapped as if overridable."""
    run = run_python(_TRUSTING_TOOL)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == "['flatten', 'relu'] [('relu', True), ('flatten', True)]"


def test_a_cache_torch_fills_during_a_trace_holds_torchs_functions_after_it():
    run = run_python(_PATCH_CACHED_INSIDE_A_TRACE)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True"]
