"""fxdebug: debug PyTorch models through torch.fx graph transformations.

>>> import torch, torchvision, fxdebug
>>> gm = fxdebug.instrument(torchvision.models.resnet18())
>>> _ = gm(torch.randn(1, 3, 64, 64))
>>> fxdebug.records(gm)["layer1.0.conv1"].shape
torch.Size([1, 64, 16, 16])
"""

from . import passes
from .passes.manager import PassManager
from .errors import FxdebugError, PassEquivalenceError, SelectionError, TraceFailure
from .equivalence import EquivalenceReport, check_equivalence
from .nonfinite import NonfiniteReport, find_nonfinite
from . import testing
from .graph_diff import DiffRow, GraphDiff, diff
from .graph_table import print_tabular, tabular
from .dump import dump
from .instrument import instrument, records
from .records import Record, Records, Stats
from .jacobian import JacobianNorms, jacobian_norms
from .lint import Hazard, Hazards, lint_inplace
from .tracing import trace
from . import partial
from .partial import PartialReport, part_inputs, traced_parts
from .vjp import vjp

__version__ = "0.1.0"

__all__ = [
    "trace",
    "instrument",
    "records",
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
