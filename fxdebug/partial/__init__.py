"""Part-by-part tracing: models whose root cannot be traced, traced one module call at a time.

A detector's ``forward`` iterates over a list of images; a transformer checks
its keyword arguments: fx cannot trace such roots even with auto-leaf. The
model is then kept as a tree of dispatchers, and each module traces itself on
its first call, specialised to that call; what cannot be traced runs eagerly::

    build_partial_model(model) / instrument_parts(model, instrument_graph)   trace_parts.py
      (make the model)            traced_parts(model): its parts by label (list them)
      ├─ call_plan / export_plan: what stays an input, what is fixed   call_specialization.py
      ├─ which parts a capture pattern selects                         part_selection.py
      └─ PartialReport: traced parts, eager modules and why            report.py

>>> import torch, fxdebug
>>> class Loop(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.lin = torch.nn.Linear(2, 2)
...     def forward(self, xs):
...         return [self.lin(x) for x in xs]   # a loop over a list: the root cannot be traced
>>> model = fxdebug.trace(Loop(), frontend="auto")   # build_partial_model(Loop()) inside
>>> _ = model([torch.ones(1, 2)])
>>> list(fxdebug.partial.traced_parts(model))  # by label; '' is the root, traced for this call
['']
"""

from .report import EagerModule, PartialReport, TracedPart, is_partial
from .trace_parts import build_partial_model, instrument_parts, part_inputs, traced_parts

__all__ = ["build_partial_model", "instrument_parts", "is_partial", "part_inputs", "traced_parts",
           "PartialReport", "TracedPart", "EagerModule"]
