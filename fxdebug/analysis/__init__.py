"""Verdicts on a model: is it equivalent, where is the NaN, which write breaks autograd.

(Compiled models have their own subpackage, :mod:`fxdebug.compiled`.)

Each analysis runs the model (or a keyed copy) under controlled conditions and
names nodes by key and the user's ``file:line``::

    check_equivalence(reference, candidate, *inputs)     equivalence.py
      ├─ ControlledRuns                                 controlled_run.py
      ├─ compare_values(outputs)                        compare.py
      └─ localize: Capture("all") on both, match_nodes  node_matching.py
           (grads=True: activation_grads, in backward order)  activation_grads.py
    find_nonfinite(model, *inputs)                      nonfinite.py
    watch_nonfinite(model): a flag per step, find_nonfinite on the first bad one  watch.py
      (its report, NOT REPRODUCED when the replay is finite: watch_report.py)
      (torch.distributed: the flag all-reduced, every rank's finding gathered)   watch_ranks.py
    compare_ranks(records_or_module): fingerprints gathered, majority per key   ranks.py
      (the group, DDP unwrapped, DTensor shards: rank_group.py; the report: ranks_report.py)
    compare_runs(a, b): two runs (Records or saved folders) key by key   compare_runs.py
    lint_inplace(model, *inputs)                        lint.py (passes/aliasing.py)
    vjp(model, *inputs, of=, wrt=)                      vjp.py    } node_by_node.py: values with
    jacobian_norms(model, *inputs)                      jacobian.py } their autograd graph

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> fxdebug.analysis.check_equivalence(model, fxdebug.trace(model), torch.randn(3, 2)).ok
True
"""

from .compare_runs import RunComparison, RunEntry, compare_runs
from .equivalence import EquivalenceReport, NodeComparison, check_equivalence
from .jacobian import JacobianNorms, jacobian_norms
from .lint import Hazard, Hazards, lint_inplace
from .nonfinite import NonfiniteReport, find_nonfinite
from .ranks import compare_ranks
from .ranks_report import RankEntry, RankReport
from .vjp import vjp
from .watch import NonfiniteWatch, watch_nonfinite
from .watch_ranks import RankFinding, RankNonfiniteReport
from .watch_report import WatchReport

__all__ = ["check_equivalence", "EquivalenceReport", "NodeComparison", "find_nonfinite",
           "NonfiniteReport", "lint_inplace", "Hazard", "Hazards", "vjp", "jacobian_norms",
           "JacobianNorms",
           "watch_nonfinite", "NonfiniteWatch", "WatchReport", "RankFinding",
           "RankNonfiniteReport",
           "compare_ranks", "RankReport", "RankEntry", "compare_runs", "RunComparison",
           "RunEntry"]
