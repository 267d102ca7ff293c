"""The analyses under one name, as before they had rooms of their own (each name works here
as it did; new code imports from the room):

    check_equivalence, vjp, jacobian_norms        fxdebug.equivalence
    find_nonfinite, watch_nonfinite               fxdebug.nonfinite
    compare_ranks                                 fxdebug.distributed
    compare_runs                                  fxdebug.runs
    lint_inplace                                  fxdebug.hazards

(``fxdebug.analysis.watch_nonfinite`` is the eager watch; ``fxdebug.watch_nonfinite`` also
finds the node a ``torch.compile``'d model's compiled code makes a NaN at.)

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> fxdebug.analysis.check_equivalence(model, fxdebug.trace(model), torch.randn(3, 2)).ok
True
"""

from ..runs.run_comparison import RunComparison, RunEntry, compare_runs
from ..equivalence.equivalence import EquivalenceReport, NodeComparison, check_equivalence
from ..equivalence.jacobian import JacobianNorms, jacobian_norms
from ..hazards.lint import Hazard, Hazards, lint_inplace
from ..nonfinite.nonfinite import NonfiniteReport, find_nonfinite
from ..distributed.ranks import compare_ranks
from ..distributed.ranks_report import RankEntry, RankReport
from ..equivalence.vector_jacobian import vjp
from ..nonfinite.watch import NonfiniteWatch, watch_nonfinite
from ..nonfinite.watch_ranks import RankFinding, RankNonfiniteReport
from ..nonfinite.watch_report import WatchReport

__all__ = ["check_equivalence", "EquivalenceReport", "NodeComparison", "find_nonfinite",
           "NonfiniteReport", "lint_inplace", "Hazard", "Hazards", "vjp", "jacobian_norms",
           "JacobianNorms",
           "watch_nonfinite", "NonfiniteWatch", "WatchReport", "RankFinding",
           "RankNonfiniteReport",
           "compare_ranks", "RankReport", "RankEntry", "compare_runs", "RunComparison",
           "RunEntry"]
