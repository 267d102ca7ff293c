"""The runtime: what inserted nodes call while an instrumented module runs.

Nothing here imports a pass or a front end; passes insert nodes that call
these functions, and the functions write into the module's Recorder::

    gm(x)                                      an instrumented GraphModule
      ├─ begin_run(recorder, (x,))             a fresh Records for this forward
      ├─ capture(recorder, value, key, op)     Records.add: a view, or a copy
      │                                        where a later in-place op writes
      ├─ capture_stats(recorder, value, ...)   Records.add_stats: a large tensor summarized at
      │                                        once, small ones together when the forward ends
      │                                        (stats_batch.py; large ones: fxdebug.stats)
      ├─ own_value(x)                          a view of an input: hooks go on it, not on x
      ├─ record_grads(recorder, value, ...)    Tensor.register_hook -> Records.grads
      ├─ edit_grads(edit, value, key)          Tensor.register_hook(edit.fn) on an activation
      ├─ edited_parameter(edit, p, name)       a view of p whose gradient is edited
      ├─ call_with_parameters(module, {n: v})  the module reads the edited view, not p
      ├─ stop(key, op, inputs)                 pdb in the generated forward
      ├─ forward_pre_hooks / forward_hooks     a traced-through module's hooks, at run time
      ├─ begin_part(part recorder, inputs)     a traced part of a part-by-part model
      └─ EagerScope                             code that runs eagerly (eager modules,
                                                leaf modules): module calls and ops
    records(gm)                                recorder.latest: the Records of the calling
                                               thread's latest run
    torch.compile(gm)(x)                       the same node functions, traced by dynamo, emit
                                               custom ops (fxdebug::begin_run, ::capture):
                                               compiled_ops.py; gradient hooks: compiled_grads.py
    torch.compile(fxdebug.monitor's copy)      the monitor's taps: output and gradient moment
                                               summaries as graph ops, no graph break
                                               (fxdebug.compiled.monitor_taps)

Under all of it: nested values walked one way, with ``/`` keys (values.py, on torch's
pytree); below it, the statistics engine (:mod:`fxdebug.stats`) and the helpers every room
uses (:mod:`fxdebug.base`: formatting, the Report base, torch_compat).

Every node function is registered with ``torch.fx.node.has_side_effect`` and
emits itself again under re-tracing. They are published here, as
``fxdebug.runtime.capture`` and so on, which is also the name generated code
uses (``fxdebug_runtime_capture``) and dumped folders import.

>>> import torch, fxdebug
>>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
>>> "fxdebug_runtime_capture(" in gm.code
True
"""

from .asserts import PROXY_IN_TEXT, TracedMessage, traced_message
from .debugger import stop, stops_disabled
from .gradients import (PASSES_THROUGH, GradEdit, call_with_parameters, edit_grads, edited_parameter,
                        own_value, record_grads)
from .nodes import RECORDER_ATTR, Recorder, begin_run, capture, capture_stats, emit_if_tracing
from .eager_ops import (EAGER_MODULE, EAGER_OP, REGIONS_ATTR, EagerKeys, EagerScope, RegionForward,
                        RegionForwards)
from .module_hooks import ROOT_HOOKS_ATTR, HookedRoot, forward_hooks, forward_pre_hooks, leaf_paths
from .parts import PartRecorder, SharedRecorder, begin_part
from .placement import Placement, plan_layouts
from .records import Record, Records
from ..stats.summary import (Stats, combine, stats_from_summaries, stats_from_summary, summarize,
                             tensor_stats)
from .values import (children, clone_inputs, flatten_tensors, leaves, map_leaves, map_tensors,
                     named_leaves, outputs_loss)

__all__ = ["Recorder", "RECORDER_ATTR", "Records", "Record", "Stats", "tensor_stats", "Placement",
           "plan_layouts",
           "summarize", "combine", "stats_from_summary", "stats_from_summaries",
           "begin_run", "capture", "capture_stats", "record_grads", "GradEdit", "edit_grads",
           "own_value", "edited_parameter", "call_with_parameters", "PASSES_THROUGH",
           "traced_message", "TracedMessage", "PROXY_IN_TEXT",
           "stop", "stops_disabled", "forward_pre_hooks", "forward_hooks", "leaf_paths",
           "HookedRoot",
           "ROOT_HOOKS_ATTR", "begin_part", "SharedRecorder", "PartRecorder",
           "emit_if_tracing", "flatten_tensors", "outputs_loss", "clone_inputs", "children", "leaves",
           "named_leaves", "map_leaves", "map_tensors",
           "EagerScope", "EagerKeys", "RegionForward", "RegionForwards", "REGIONS_ATTR", "EAGER_OP",
           "EAGER_MODULE"]

# Generated code names a function after its module: publish the node functions here, so
# code, pickles and dumped folders say fxdebug.runtime.capture wherever they are defined.
for _node_function in (begin_run, capture, capture_stats, record_grads, edit_grads, stop,
                       begin_part, own_value, edited_parameter, call_with_parameters,
                       traced_message, forward_pre_hooks, forward_hooks):
    _node_function.__module__ = __name__
del _node_function
