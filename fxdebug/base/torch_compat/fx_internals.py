"""What torch.fx keeps private on a Graph and a GraphModule: generated code, its line map,
the code generator, the tracer class, and the guards symbolic tracing inserts.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.fx as fx

__all__ = ["ASSERT_IS_NONE", "CODE_ATTR", "CODE_ONLY_MODULE", "GRAPH_MODULE_HOOK_ATTRS",
           "GRAPH_MODULE_SHARED_ATTRS", "copy_codegen", "custom_builtin_imports", "def_line",
           "generated_code", "graph_tracer_cls", "keep_first_output", "lineno_map",
           "pytree_specs", "set_graph_tracer_cls"]

CODE_ONLY_MODULE: type = getattr(fx.graph_module, "_CodeOnlyModule", fx.GraphModule)
"""What ``torch.load`` re-traces a saved GraphModule into (2.9.1, 2.14.1); GraphModule if gone."""


def lineno_map(code_owner) -> dict[int, int | None]:
    r"""``{line of the generated forward: node index}`` of a GraphModule or ``PythonCode``.

    Lines count from the ``def forward`` line (0). Reads the private ``_lineno_map``
    that torch.fx sets on both (checked on 2.9.1 and 2.14.1); ``{}`` where it is gone
    (errors then name no node, nothing else changes).

    >>> gm = fx.symbolic_trace(torch.nn.ReLU())
    >>> lines, names = gm.code.split("\n"), [node.name for node in gm.graph.nodes]
    >>> [(names[index], lines[def_line(gm.code) + line].strip()[:16])
    ...  for line, index in lineno_map(gm).items() if index is not None][:2]
    [('input_1', 'input_1 = input'), ('relu', 'relu = torch.nn.')]
    """
    return dict(getattr(code_owner, "_lineno_map", None) or {})


def def_line(code: str) -> int:
    r"""Index of the ``def forward`` line in generated code (public text; no private offset).

    torch 2.14 keeps it as ``PythonCode._prologue_start``; 2.9 has no such field.

    >>> def_line("import torch\n\ndef forward(self, x):\n    return x")
    2
    """
    for index, line in enumerate(code.split("\n")):
        if line.startswith("def forward"):
            return index
    return 0


def pytree_specs(graph: fx.Graph):
    """``(in_spec, out_spec)`` of a graph whose code flattens pytree inputs, else None.

    torch.fx's ``_PyTreeCodeGen`` holds them in ``pytree_info`` (2.9.1, 2.14.1); the
    check is on that public attribute, not the private class.

    >>> pytree_specs(fx.symbolic_trace(torch.nn.ReLU()).graph) is None
    True
    """
    info = getattr(getattr(graph, "_codegen", None), "pytree_info", None)
    if info is None:
        return None
    return info.in_spec, info.out_spec


def keep_first_output(graph: fx.Graph) -> bool:
    """A graph whose code returns a pair ``(output, extras)`` through a pytree (what
    ``torch.export`` makes of a forward returning that pair): return ``output`` alone, with
    its own structure; False (nothing changed) where the graph has no such pair.

    Replaces the out_spec in torch.fx's ``pytree_info`` (a NamedTuple, 2.9.1 and 2.14.1)
    with its first child; the caller recompiles.

    >>> keep_first_output(fx.symbolic_trace(torch.nn.ReLU()).graph)
    False
    """
    codegen: Any = getattr(graph, "_codegen", None)
    info: Any = getattr(codegen, "pytree_info", None)
    spec = getattr(info, "out_spec", None)
    if codegen is None or info is None or spec is None or getattr(spec, "num_children", 0) != 2:
        return False
    child = spec.child(0) if hasattr(spec, "child") else spec.children_specs[0]
    output = next(node for node in reversed(graph.nodes) if node.op == "output")
    flat = output.args[0]
    if not isinstance(flat, (tuple, list)) or len(flat) != spec.num_leaves:
        return False
    output.args = (tuple(flat[:child.num_leaves]),)
    codegen.pytree_info = info._replace(out_spec=child)
    return True


def custom_builtin_imports() -> dict[str, str]:
    """``{name: import line}`` of what torch.fx's generated code uses without importing
    (``inf``, ``nan``, ``device``, ``torch``...): ``torch.fx.graph._custom_builtins``
    (2.9.1, 2.14.1); the known ones where it is gone.

    >>> custom_builtin_imports()["inf"]
    'from math import inf'
    """
    builtins = getattr(fx.graph, "_custom_builtins", None)
    if builtins is None:
        return {"inf": "from math import inf", "nan": "from math import nan",
                "NoneType": "NoneType = type(None)", "torch": "import torch",
                "device": "from torch import device", "fx_pytree": "import torch.fx._pytree as fx_pytree",
                "pytree": "import torch.utils._pytree as pytree"}
    return {name: builtin.import_str for name, builtin in builtins.items()}


ASSERT_IS_NONE = getattr(sys.modules.get("torch.fx._symbolic_trace"), "_assert_is_none", None)
"""The guard ``symbolic_trace(concrete_args={"x": None})`` inserts (``torch.fx._symbolic_trace.
_assert_is_none``, 2.9.1 and 2.14.1); None where it is gone (then no node matches it)."""


def copy_codegen(source: fx.Graph, target: fx.Graph) -> None:
    """Give ``target`` the code generator of ``source`` (pytree in/out handling included).

    Reads ``source._codegen`` (2.9.1, 2.14.1) and sets it with the public ``set_codegen``.

    >>> source, target = fx.symbolic_trace(torch.nn.ReLU()).graph, fx.Graph()
    >>> copy_codegen(source, target)
    """
    codegen = getattr(source, "_codegen", None)
    if codegen is not None:
        target.set_codegen(codegen)


def graph_tracer_cls(graph: fx.Graph):
    """The tracer class a graph was made with (``graph._tracer_cls``, 2.9.1 and 2.14.1; None
    where it is gone), what ``fx.Graph(tracer_cls=...)`` takes.

    >>> graph_tracer_cls(fx.symbolic_trace(torch.nn.ReLU()).graph) is fx.Tracer
    True
    """
    return getattr(graph, "_tracer_cls", None)


def set_graph_tracer_cls(graph: fx.Graph, tracer_cls) -> None:
    """Set the tracer class ``torch.load`` re-traces a pickled GraphModule with
    (``graph._tracer_cls``, 2.9.1 and 2.14.1); None re-traces with ``fx.Tracer``.

    >>> graph = fx.Graph(); set_graph_tracer_cls(graph, None); graph_tracer_cls(graph) is None
    True
    """
    graph._tracer_cls = tracer_cls


GRAPH_MODULE_SHARED_ATTRS = ("_graph", "_code", "_lineno_map", "_prologue_start", "_tracer_cls")
"""What a GraphModule keeps of its graph and generated code in its ``__dict__`` (2.9.1 has no
``_prologue_start``; 2.14.1 has them all): a copy may share them, read only."""

GRAPH_MODULE_HOOK_ATTRS = ("_backward_pre_hooks", "_backward_hooks", "_forward_hooks",
                           "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                           "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs")
"""The hook registries of a module's ``__dict__`` (2.9.1, 2.14.1) that
``GraphModule.__deepcopy__`` does not copy."""

CODE_ATTR = "_code"
"""Where a GraphModule keeps its generated code, what ``gm.code``, ``print(gm)`` and
``to_folder`` read (2.9.1, 2.14.1); fxdebug's DebugGraphModule generates it on first read."""


def generated_code(gm: torch.nn.Module) -> str:
    """The code generated for ``gm`` so far, without generating it ("" when none yet).

    >>> generated_code(fx.symbolic_trace(torch.nn.ReLU())).strip().startswith("def forward")
    True
    """
    return vars(gm).get(CODE_ATTR, "")
