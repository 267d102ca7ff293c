"""Autograd hazards: in-place writes that break backward, found before any backward runs.

::

    lint_inplace(model, *inputs)     lint.py (the aliasing facts: passes/aliasing.py)

>>> import torch, fxdebug
>>> fxdebug.hazards.lint_inplace(torch.nn.Sequential(torch.nn.ReLU()), torch.randn(2)).ok
True
"""

from .lint import Hazard, Hazards, lint_inplace

__all__ = ["lint_inplace", "Hazard", "Hazards"]
