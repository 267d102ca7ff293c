"""Every private torch name fxdebug uses, in one place, each with a public fallback.

fxdebug supports every torch release of the last year (``torch>=2.9``). A
private name (``torch._dynamo``, ``torch.fx.graph_module._forward_from_src``,
``grad_fn._saved_*``, ...) may change in any release, so the rest of the
package never touches one: it calls the functions of this package, by topic::

    fxdebug/base/torch_compat/
      ├─ __init__.py          re-exports every name below; require_torch, torch_version
      ├─ pytree.py            torch.utils._pytree: flatten, unflatten, key paths
      ├─ fx_internals.py      Graph/GraphModule: generated code, line map, codegen, tracer
      ├─ export_nodes.py      grad-mode and autocast nodes, torch.export's guard call
      ├─ module_internals.py  nn.Module: parameter/buffer/child registries, hooks, dropout
      ├─ autograd.py          version counters, a grad_fn's saved tensors and their hooks
      ├─ dtensor.py           tensor parallelism: the layout a ParallelStyle hook gives
      ├─ sharding.py          FSDP2's class swap, torch.distributed's hooks, a plain module copy
      ├─ ops.py               torch.ops overloads, dispatch mode, _foreach kernels, tolerances
      └─ dynamo.py            torch.compile: wrapped module, backends, inductor, graph breaks

The rule: private torch names live only here. Each name says which private
name it reads, the torch versions it was checked on, and what it does when
that name is missing (a public way to the same result, or a clear "needs
torch X" error, :func:`require_torch`); ``tests/test_private_torch.py`` fails
on a private torch name anywhere else in the package, and on one here
without its versions. Import the names from this package
(``from fxdebug.base.torch_compat import tree_leaves``), not from its modules.

>>> torch_version() >= MINIMUM_TORCH
True
"""

from __future__ import annotations

from ..torch_version import MINIMUM_TORCH, require_torch, torch_version  # re-exported

require_torch(MINIMUM_TORCH, "fxdebug")  # before any private name below can fail on an old torch

from .autograd import (add_tensor_hook, at_backward_end, read_version,  # noqa: E402
                       saved_tensor_has_unpack_hooks, saved_tensor_names, tensor_version,
                       tensor_versions)
from .dtensor import (ParallelLayout, distribute_module_applied,  # noqa: E402
                      parallel_output_layout)
from .dynamo import (compile_like, compiled_backend, compiled_in_place, compiled_inner,  # noqa: E402
                     dynamo_frame_id, dynamo_traces_class_descriptors, graph_break_reason, inductor_backend,
                     inside_compiled_module, load_inductor, lookup_backend,
                     run_eagerly_from_compiled_code, skip_frame)
from .export_nodes import (AUTOCAST_NODE_FUNCTIONS, ENTER_AUTOCAST, EXIT_AUTOCAST,  # noqa: E402
                           SET_GRAD_ENABLED, autocast_arguments, is_autocast_function,
                           is_export_guard_call, is_tensor_metadata_assert)
from .fx_internals import (ASSERT_IS_NONE, CODE_ATTR, CODE_ONLY_MODULE,  # noqa: E402
                           GRAPH_MODULE_HOOK_ATTRS, GRAPH_MODULE_SHARED_ATTRS, copy_codegen,
                           custom_builtin_imports, def_line, generated_code, graph_tracer_cls,
                           keep_first_output, lineno_map, pytree_specs,
                           set_graph_tracer_cls)
from .module_internals import (BUFFERS_ATTR, CHILDREN_ATTR, DROPOUT_TYPES,  # noqa: E402
                               PARAMETERS_ATTR, forward_hooks_readable, global_module_hook_names,
                               global_module_hooks_owner, has_module_hooks, is_persistent_buffer,
                               hook_registrations, hook_registries, run_forward_hooks, run_forward_pre_hooks,
                               own_buffers, own_children, own_parameters,
                               parameters_and_buffers, set_child, share_parameters,
                               set_own_buffer)
from .ops import (TorchDispatchMode, assert_close_tolerances, flatten_dense,  # noqa: E402
                  foreach_copy_, foreach_norm, is_op_overload, is_op_packet, op_schema)
from .sharding import (SHARDING_FLAGS, class_before_sharding, module_shell,  # noqa: E402
                       registered_by_torch_distributed)
from .pytree import (tree_flatten, tree_flatten_with_path, tree_is_leaf,  # noqa: E402
                     tree_leaves, tree_unflatten, treespec_parts)

__all__ = [
    # torch_version
    "MINIMUM_TORCH", "require_torch", "torch_version",
    # autograd
    "add_tensor_hook", "at_backward_end", "read_version", "saved_tensor_has_unpack_hooks",
    "saved_tensor_names",
    "tensor_version", "tensor_versions",
    # dtensor
    "ParallelLayout", "distribute_module_applied", "parallel_output_layout",
    # dynamo
    "compile_like", "compiled_backend", "compiled_in_place", "compiled_inner", "dynamo_frame_id",
    "dynamo_traces_class_descriptors",
    "graph_break_reason", "inductor_backend", "inside_compiled_module", "load_inductor",
    "lookup_backend", "run_eagerly_from_compiled_code", "skip_frame",
    # export_nodes
    "AUTOCAST_NODE_FUNCTIONS", "ENTER_AUTOCAST", "EXIT_AUTOCAST", "SET_GRAD_ENABLED",
    "autocast_arguments", "is_autocast_function", "is_export_guard_call",
    "is_tensor_metadata_assert",
    # fx_internals
    "ASSERT_IS_NONE", "CODE_ATTR", "CODE_ONLY_MODULE", "GRAPH_MODULE_HOOK_ATTRS",
    "GRAPH_MODULE_SHARED_ATTRS", "copy_codegen", "custom_builtin_imports", "def_line",
    "generated_code", "graph_tracer_cls", "keep_first_output", "lineno_map", "pytree_specs",
    "set_graph_tracer_cls",
    # module_internals
    "share_parameters", "BUFFERS_ATTR", "CHILDREN_ATTR", "DROPOUT_TYPES", "PARAMETERS_ATTR",
    "global_module_hook_names", "global_module_hooks_owner", "has_module_hooks",
    "forward_hooks_readable", "hook_registrations", "hook_registries",
    "run_forward_pre_hooks", "run_forward_hooks",
    "is_persistent_buffer", "own_buffers", "own_children", "own_parameters",
    "parameters_and_buffers", "set_child",
    "set_own_buffer",
    # ops
    "TorchDispatchMode", "assert_close_tolerances", "flatten_dense", "foreach_copy_", "foreach_norm",
    "is_op_overload", "is_op_packet", "op_schema",
    # sharding
    "SHARDING_FLAGS", "class_before_sharding", "module_shell", "registered_by_torch_distributed",
    # pytree
    "tree_flatten", "tree_flatten_with_path", "tree_is_leaf", "tree_leaves",
    "tree_unflatten", "treespec_parts",
]
