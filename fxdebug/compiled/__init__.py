"""Compiled models: where ``torch.compile`` first differs from eager, and captures inside compiled runs.

::

    check_compiled(model, *inputs, backend="inductor")    check.py
      ├─ compiled run: fxdebug's own entry point, no dynamo reset    watched_runs.py
      ├─ graph breaks: the reason dynamo gives each graph it ends
      └─ localize: dynamo graphs keyed (dynamo_graphs.py), compiled piece by
           piece against fxdebug's eager captures                   localize.py
    backend(inner="inductor"): an instrumenting dynamo backend      instrumenting_backend.py
    watch_nonfinite(model): the NaN watch, with check_compiled for a compiled model's
      step that the eager replay does not reproduce                 watch.py
    the training monitor's taps inside a compiled copy              monitor_taps.py
      └─ moment summaries as graph ops                              moments.py

(What inserted nodes call while dynamo traces them stays in :mod:`fxdebug.runtime`:
compiled_ops.py, compiled_stats.py, compiled_grads.py.)

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
>>> fxdebug.compiled.check_compiled(model, torch.randn(3, 2), backend="eager").ok
True
"""

from .instrumenting_backend import InstrumentingBackend, backend
from .check import CompiledDivergence, CompiledReport, GraphBreak, check_compiled
from .watch import watch_nonfinite

__all__ = ["check_compiled", "CompiledReport", "CompiledDivergence", "GraphBreak", "backend",
           "InstrumentingBackend", "watch_nonfinite"]
