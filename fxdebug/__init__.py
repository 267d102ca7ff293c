"""fxdebug: debug PyTorch models through torch.fx graph transformations.

>>> import torch, torchvision, fxdebug
>>> gm = fxdebug.instrument(torchvision.models.resnet18())
>>> _ = gm(torch.randn(1, 3, 64, 64))
>>> fxdebug.records(gm)["layer1.0.conv1"].shape
torch.Size([1, 64, 16, 16])
"""

import importlib
import importlib.util
from typing import Any

# The public names, each with the module it lives in: the one list. `__all__` is its keys;
# the names are imported on first use (PEP 562), so that `import fxdebug` and the `fxdebug`
# command's --help and argument errors do not import torch. Type checkers and IDEs read the
# same names from __init__.pyi, written from this table (python tests/test_api.py rewrites it;
# the test fails while it differs).
_LAZY = {
    # trace and instrument a model, read its captures
    "trace": "fxdebug.frontend",
    **dict.fromkeys(("instrument", "records", "accumulate_stats", "set_step"),
                    "fxdebug.instrumenting"),
    **dict.fromkeys(("Records", "Record", "Stats"), "fxdebug.runtime"),
    **dict.fromkeys(("PartialReport", "traced_parts", "part_inputs"), "fxdebug.partial"),
    # passes and the graph's tables
    "passes": "fxdebug.passes",
    **dict.fromkeys(("PassManager", "PassManagerResult", "PassReport"), "fxdebug.pass_manager"),
    **dict.fromkeys(("print_tabular", "GraphDiff", "DiffRow"), "fxdebug.reporting"),
    "diff": "fxdebug.reporting.graph_diff",
    "report": "fxdebug.reporting.html",
    "plots": "fxdebug.reporting.plots",
    "dump": "fxdebug.dumping",
    # analyses
    **dict.fromkeys(("check_equivalence", "EquivalenceReport", "jacobian_norms",
                     "JacobianNorms"), "fxdebug.equivalence"),
    "vjp": "fxdebug.equivalence.vector_jacobian",
    "testing": "fxdebug.testing",
    **dict.fromkeys(("find_nonfinite", "NonfiniteReport", "NonfiniteWatch", "WatchReport",
                     "RankNonfiniteReport"), "fxdebug.nonfinite"),
    **dict.fromkeys(("check_compiled", "CompiledReport", "backend", "InstrumentingBackend",
                     "watch_nonfinite"), "fxdebug.compiled"),
    **dict.fromkeys(("lint_inplace", "Hazard", "Hazards"), "fxdebug.hazards"),
    # runs, ranks, training
    **dict.fromkeys(("save_records", "load_records", "SavedRecords", "ShardedRecords",
                     "RunComparison"), "fxdebug.runs"),
    "compare_runs": "fxdebug.runs.run_comparison",
    **dict.fromkeys(("compare_ranks", "RankReport"), "fxdebug.distributed"),
    "monitor": "fxdebug.monitoring.training_monitor",
    **dict.fromkeys(("Monitor", "load_series", "Series", "DriftReport"), "fxdebug.monitoring"),
    "SpikeReport": "fxdebug.monitoring.spike_report",
    # precision what-if
    "fake_precision": "fxdebug.passes.fake_precision",
    **dict.fromkeys(("precision_sensitivity", "SensitivityReport", "SensitivityEntry",
                     "PrecisionChoice"), "fxdebug.precision"),
    # errors and warnings
    **dict.fromkeys(("FxdebugError", "TraceFailure", "SelectionError", "PassEquivalenceError",
                     "StaleCaptureError", "SavedRunError", "GraphChangedError",
                     "ReferenceMismatchError", "FxdebugWarning", "EagerFallbackWarning",
                     "FidelityWarning", "PerformanceWarning", "FxdebugDeprecationWarning"),
                    "fxdebug.errors"),
}

# Old names, for one release: name -> (module, attribute, the new spelling the warning names;
# "" where the function warns when called).
_DEPRECATED = {
    "tabular": ("fxdebug.reporting.node_table", "tabular_text",
                "fxdebug.print_tabular(gm, *inputs) (file=io.StringIO() for the text)"),
    "flush": ("fxdebug.instrumenting", "flush", ""),
    "keys": ("fxdebug.tracing.keys", "", "fxdebug.passes.inherit_key"),
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        return _other_attribute(name)
    module = importlib.import_module(module_name)
    # a subpackage (fxdebug.equivalence, which holds a module equivalence.py) is the package;
    # a module named like a function it defines (fxdebug.passes.fake_precision) gives the function
    value = module if (module_name == f"{__name__}.{name}" and hasattr(module, "__path__")) or (
        module_name.rpartition(".")[2] == name and name not in vars(module)) \
        else getattr(module, name)
    globals()[name] = value
    return value


def _other_attribute(name: str) -> Any:
    """A deprecated name (with its warning), or a subpackage not in ``__all__``
    (``fxdebug.runtime``: pickles and dumped folders import it; ``fxdebug.equivalence``)."""
    if name in _DEPRECATED:
        module_name, attribute, new = _DEPRECATED[name]
        if new:
            from .errors import deprecated
            deprecated(f"fxdebug.{name}", new, stacklevel=4)
        module = importlib.import_module(module_name)
        return getattr(module, attribute) if attribute else module
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'fxdebug' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = list(_LAZY)
