"""fxdebug: debug PyTorch models through torch.fx graph transformations.

>>> import torch, torchvision, fxdebug
>>> gm = fxdebug.instrument(torchvision.models.resnet18())
>>> _ = gm(torch.randn(1, 3, 64, 64))
>>> fxdebug.records(gm)["layer1.0.conv1"].shape
torch.Size([1, 64, 16, 16])
"""

import importlib
from typing import TYPE_CHECKING, Any

# Public names and the module each lives in. They are imported on first use (PEP 562), so that
# `import fxdebug` and the `fxdebug` command's --help and argument errors do not import torch.
_LAZY = {
    "analysis": "fxdebug.analysis", "passes": "fxdebug.passes", "reporting": "fxdebug.reporting",
    "runtime": "fxdebug.runtime", "testing": "fxdebug.testing", "tracing": "fxdebug.tracing",
    "compiled": "fxdebug.compiled", "equivalence": "fxdebug.equivalence",
    "nonfinite": "fxdebug.nonfinite", "runs": "fxdebug.runs", "distributed": "fxdebug.distributed",
    "hazards": "fxdebug.hazards", "base": "fxdebug.base",
    "keys": "fxdebug.tracing.keys", "partial": "fxdebug.partial",
    "plots": "fxdebug.reporting.plots",
    **dict.fromkeys(("CompiledReport", "backend", "check_compiled", "watch_nonfinite"),
                    "fxdebug.compiled"),
    **dict.fromkeys(("EquivalenceReport", "JacobianNorms", "check_equivalence",
                     "jacobian_norms"), "fxdebug.equivalence"),
    "vjp": "fxdebug.equivalence.vector_jacobian",
    **dict.fromkeys(("Hazard", "Hazards", "lint_inplace"), "fxdebug.hazards"),
    **dict.fromkeys(("NonfiniteReport", "find_nonfinite", "RankNonfiniteReport", "NonfiniteWatch",
                     "WatchReport"), "fxdebug.nonfinite"),
    **dict.fromkeys(("compare_ranks", "RankReport"), "fxdebug.distributed"),
    **dict.fromkeys(("RunComparison",), "fxdebug.runs"),
    "compare_runs": "fxdebug.runs.run_comparison",
    "dump": "fxdebug.dumping",
    **dict.fromkeys(("FxdebugError", "PassEquivalenceError", "SelectionError", "TraceFailure",
                     "StaleCaptureError", "SavedRunError", "FxdebugWarning", "EagerFallbackWarning",
                     "FidelityWarning", "PerformanceWarning"), "fxdebug.errors"),
    "instrument": "fxdebug.instrumenting", "records": "fxdebug.instrumenting",
    "accumulate_stats": "fxdebug.instrumenting", "set_step": "fxdebug.instrumenting",
    "flush": "fxdebug.instrumenting",
    **dict.fromkeys(("save_records", "load_records", "SavedRecords"), "fxdebug.runs.saved_runs"),
    "PassManager": "fxdebug.pass_manager", "PassReport": "fxdebug.pass_manager",
    **dict.fromkeys(("DiffRow", "GraphChangedError", "GraphDiff", "diff", "print_tabular",
                     "tabular"),
                    "fxdebug.reporting"),
    "report": "fxdebug.reporting.html",
    **dict.fromkeys(("Record", "Records", "Stats"), "fxdebug.runtime"),
    **dict.fromkeys(("PartialReport", "part_inputs", "traced_parts"), "fxdebug.partial"),
    "trace": "fxdebug.frontend",
    "monitor": "fxdebug.monitoring.training_monitor",
    "fake_precision": "fxdebug.passes.fake_precision",
    **dict.fromkeys(("precision_sensitivity", "SensitivityReport", "SensitivityEntry",
                     "PrecisionChoice"), "fxdebug.precision"),
    **dict.fromkeys(("Monitor", "load_series", "Series", "DriftReport"), "fxdebug.monitoring"),
}

if TYPE_CHECKING:  # the same names, eagerly, for type checkers and IDEs (tests/test_api.py
    # checks that this block, _LAZY and __all__ name the same things)
    from . import (analysis, base, distributed, equivalence, hazards, nonfinite, passes, reporting,
                   runs, runtime, testing, tracing)
    from .compiled import CompiledReport, backend, check_compiled, watch_nonfinite
    from .equivalence import EquivalenceReport, JacobianNorms, check_equivalence, jacobian_norms
    from .equivalence.vector_jacobian import vjp
    from .hazards import Hazard, Hazards, lint_inplace
    from .nonfinite import (NonfiniteReport, NonfiniteWatch, RankNonfiniteReport, WatchReport,
                            find_nonfinite)
    from .distributed import RankReport, compare_ranks
    from .runs import RunComparison
    from .runs.run_comparison import compare_runs
    from .dumping.pipeline import dump
    from .errors import (EagerFallbackWarning, FidelityWarning, FxdebugError, FxdebugWarning,
                         PassEquivalenceError, PerformanceWarning, SavedRunError,
                         SelectionError, StaleCaptureError, TraceFailure)
    from .instrumenting import accumulate_stats, flush, instrument, records, set_step
    from .pass_manager import PassManager, PassReport
    from .reporting import DiffRow, GraphChangedError, GraphDiff, plots, print_tabular
    from .reporting.graph_diff import diff
    from .reporting.node_table import tabular
    from .reporting.html import report
    from .runtime import Record, Records, Stats
    from .runs.saved_runs import SavedRecords, load_records, save_records
    from . import compiled, partial
    from .frontend import trace
    from .partial import PartialReport, part_inputs, traced_parts
    from .tracing import keys
    from .monitoring.training_monitor import monitor
    from .monitoring import DriftReport, Monitor, Series, load_series
    from .passes.fake_precision import fake_precision
    from .precision import (PrecisionChoice, SensitivityEntry, SensitivityReport,
                            precision_sensitivity)


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fxdebug' has no attribute {name!r}")
    module = importlib.import_module(module_name)
    # a subpackage (fxdebug.equivalence, which holds a module equivalence.py) is the package;
    # a module named like a function it defines (fxdebug.passes.fake_precision) gives the function
    value = module if (module_name == f"{__name__}.{name}" and hasattr(module, "__path__")) or (
        module_name.rpartition(".")[2] == name and name not in vars(module)) \
        else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.1.0"

__all__ = [
    "trace",
    "instrument",
    "records",
    "accumulate_stats",
    "set_step",
    "flush",
    "save_records",
    "load_records",
    "SavedRecords",
    "monitor",
    "Monitor",
    "load_series",
    "Series",
    "DriftReport",
    "fake_precision",
    "precision_sensitivity",
    "SensitivityReport",
    "SensitivityEntry",
    "PrecisionChoice",
    "compare_runs",
    "RunComparison",
    "Records",
    "Record",
    "Stats",
    "print_tabular",
    "tabular",
    "diff",
    "GraphDiff",
    "GraphChangedError",
    "DiffRow",
    "vjp",
    "jacobian_norms",
    "JacobianNorms",
    "check_equivalence",
    "EquivalenceReport",
    "check_compiled",
    "CompiledReport",
    "backend",
    "find_nonfinite",
    "NonfiniteReport",
    "watch_nonfinite",
    "NonfiniteWatch",
    "WatchReport",
    "RankNonfiniteReport",
    "compare_ranks",
    "RankReport",
    "testing",
    "lint_inplace",
    "Hazard",
    "Hazards",
    "passes",
    "dump",
    "PassManager",
    "PassReport",
    "FxdebugError",
    "TraceFailure",
    "SelectionError",
    "PassEquivalenceError",
    "StaleCaptureError",
    "SavedRunError",
    "FxdebugWarning",
    "EagerFallbackWarning",
    "FidelityWarning",
    "PerformanceWarning",
    "partial",
    "compiled",
    "PartialReport",
    "traced_parts",
    "part_inputs",
    "report",
    "keys",
    "plots",
    "analysis",
    "equivalence",
    "nonfinite",
    "runs",
    "distributed",
    "hazards",
    "base",
    "reporting",
    "runtime",
    "tracing",
]
