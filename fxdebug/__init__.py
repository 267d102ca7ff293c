"""fxdebug: debug PyTorch models through torch.fx graph transformations.

>>> import torch, torchvision, fxdebug
>>> gm = fxdebug.instrument(torchvision.models.resnet18())
>>> _ = gm(torch.randn(1, 3, 64, 64))
>>> fxdebug.records(gm)["layer1.0.conv1"].shape
torch.Size([1, 64, 16, 16])
"""

from . import analysis, passes, reporting, runtime, testing, tracing
from .analysis import (EquivalenceReport, Hazard, Hazards, JacobianNorms, NonfiniteReport,
                       check_equivalence, find_nonfinite, jacobian_norms, lint_inplace, vjp,
                       watch_nonfinite)
from .dumping import dump
from .errors import FxdebugError, PassEquivalenceError, SelectionError, TraceFailure
from .instrument import accumulate_stats, instrument, records
from .pass_manager import PassManager
from .reporting import DiffRow, GraphDiff, diff, plots, print_tabular, tabular
from .runtime import Record, Records, Stats
from .tracing import (PartialReport, keys, part_inputs, partial, trace, traced_parts)

__version__ = "0.1.0"

__all__ = [
    "trace",
    "instrument",
    "records",
    "accumulate_stats",
    "Records",
    "Record",
    "Stats",
    "print_tabular",
    "tabular",
    "diff",
    "GraphDiff",
    "DiffRow",
    "vjp",
    "jacobian_norms",
    "JacobianNorms",
    "check_equivalence",
    "EquivalenceReport",
    "find_nonfinite",
    "NonfiniteReport",
    "watch_nonfinite",
    "testing",
    "lint_inplace",
    "Hazard",
    "Hazards",
    "passes",
    "dump",
    "PassManager",
    "FxdebugError",
    "TraceFailure",
    "SelectionError",
    "PassEquivalenceError",
    "partial",
    "PartialReport",
    "traced_parts",
    "part_inputs",
]
