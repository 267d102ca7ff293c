"""Precision what-if: which nodes can run in bfloat16, float16 or float8, measured forward
and backward against float64, and the recipe to hand to the trainer.

::

    fxdebug.fake_precision(model, keys, dtype)      the pass (fxdebug.passes.fake_precision)
    rep = precision_sensitivity(model, *inputs)     sensitivity.py -> SensitivityReport (report.py)
    choice = rep.choose(budget=...)                 choice.py -> PrecisionChoice
    rep.first_beyond(budget=...)                    choice.py -> Breakpoint
    (each step measured as steps.py runs it; on a sharded model, a collective: an
    unsharded copy on every rank, each step's numbers combined over the ranks, world.py)

>>> import torch, fxdebug
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
>>> rep = fxdebug.precision_sensitivity(net, torch.randn(4, 8), dtypes=("bfloat16",))
>>> choice = rep.choose(budget=4, relative_to="autocast")
>>> choice.ok
True
"""

from .choice import Breakpoint, ModuleFilter, PrecisionChoice
from .report import SensitivityEntry, SensitivityReport
from .sensitivity import precision_sensitivity

__all__ = ["precision_sensitivity", "SensitivityReport", "SensitivityEntry", "PrecisionChoice",
           "Breakpoint", "ModuleFilter"]
