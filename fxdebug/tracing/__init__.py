"""Front ends: from an ``nn.Module`` to a keyed GraphModule.

Every node gets a stable key (module path plus a local counter,
``layer1.0.relu_1``), the user's ``file:line`` and, for module calls, the
structure of what the module returned::

    trace_fx(model)                                        fx_tracer.py
      ├─ _Tracer: keys (keys.py), source lines (locations.py),
      │  faithful in-place ops; random ops, constructors, grad-mode and
      │  autocast blocks as nodes, inference_mode and attribute writes
      │  refused (fidelity.py)
      ├─ a traced-through module's forward hooks (FSDP2's, a user's) as
      │  run-time nodes around its body, never run at trace time (module_hooks.py)
      ├─ ``x += y`` nothing can observe -> ``operator.add``
      │  (inplace_lowering.py, value_facts.py; what a node aliases
      │  and writes: alias_rules.py, shared with passes and lint)
      └─ failure: explain_failure -> TraceFailure (failure.py),
         or the failing submodule becomes an auto-leaf
    export_trace(model, *inputs)                           export.py
      └─ torch.export, keys from nn_module_stack

:func:`fxdebug.trace` (:mod:`fxdebug.frontend`) picks one of these, or traces
part by part (:mod:`fxdebug.partial`). Also here:
:func:`~fxdebug.tracing.selection.select` (which keys a pattern picks),
:class:`~fxdebug.tracing.graph_module.DebugGraphModule` (the GraphModule
fxdebug returns), module copies that share parameters, and
:func:`~fxdebug.tracing.transaction.model_transaction` (a failed call, and every
trace, leaves the user's model as it was).

>>> import torch
>>> from fxdebug.tracing import trace_fx
>>> gm = trace_fx(torch.nn.Sequential(torch.nn.Linear(2, 2)))
>>> [n.meta["fxdebug_key"] for n in gm.graph.nodes]
['input', '0', 'output']
"""

from . import keys
from .export import export_trace
from .fx_tracer import trace_fx
from .graph_module import DebugGraphModule, keyed_copy

__all__ = ["trace_fx", "export_trace", "keys", "DebugGraphModule", "keyed_copy"]
