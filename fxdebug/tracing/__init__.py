"""Front ends: from an ``nn.Module`` to a keyed GraphModule.

Every node gets a stable key (module path plus a local counter,
``layer1.0.relu_1``), the user's ``file:line`` and, for module calls, the
structure of what the module returned::

    trace(model, *example_inputs, frontend="fx")          frontends.py
      ├─ "fx"      trace_fx(model)                        fx_tracer.py
      │              ├─ _Tracer: keys (keys.py), source lines (locations.py),
      │              │  faithful in-place ops; random ops, constructors, grad-mode and
      │              │  autocast blocks as nodes, inference_mode and attribute writes
      │              │  refused (fidelity.py)
      │              ├─ ``x += y`` nothing can observe -> ``operator.add``
      │              │  (inplace_lowering.py, value_facts.py; what a node aliases
      │              │  and writes: alias_rules.py, shared with passes and lint)
      │              └─ failure: explain_failure -> TraceFailure (failure.py),
      │                 or the failing submodule becomes an auto-leaf
      ├─ "export"  export_trace(model, *inputs)           export.py
      │              └─ torch.export, keys from nn_module_stack
      └─ "auto"    fx, else export, else trace_parts(model)   partial.py
                     └─ a copy of the model whose modules trace themselves on
                        their first call (call_plan.py): fx, else torch.export of
                        that call; the rest runs eagerly (capture selection:
                        part_selection.py)

Also here: :func:`~fxdebug.tracing.selection.select` (which keys a pattern
picks), :class:`~fxdebug.tracing.graph_module.DebugGraphModule` (the
GraphModule fxdebug returns) and module copies that share parameters.

>>> import torch, fxdebug
>>> gm = fxdebug.tracing.trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
>>> [n.meta["fxdebug_key"] for n in gm.graph.nodes]
['input', '0', 'output']
"""

from . import keys, partial
from .frontends import keyed_module, trace, unwrap_compiled
from .graph_module import DebugGraphModule, keyed_copy
from .partial import instrument_parts, is_partial, part_inputs, traced_parts
from .partial_report import EagerModule, PartialReport, TracedPart

__all__ = ["trace", "keyed_module", "unwrap_compiled", "keys", "partial", "DebugGraphModule", "keyed_copy", "instrument_parts",
           "is_partial", "part_inputs", "traced_parts", "PartialReport", "TracedPart",
           "EagerModule"]
