"""``forward`` of module.py: fx's generated code, one statement a line, and the imports it needs.

fx's generated code is re-laid out: one statement a line (fx frees values
after their last use; the dump keeps them, so pdb can print any of them), and
every global it calls imported by name (functions of the script being run are
copied as source). Each statement keeps the node it belongs to; module_text.py
writes it with ``# [node key] user/file.py:line``.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import re
import types

import torch.fx as fx

from ..errors import FxdebugError
from ..base import torch_compat
from ..base.formatting import format_location
from ..tracing.keys import META_SOURCE, node_key
from .literals import Imports, importable
from .script_source import ScriptSource, is_script_object

__all__ = ["Statement", "Forward", "forward_code", "node_where"]

_DELETION = re.compile(r"^(?:[A-Za-z_]\w* = )+None$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def node_where(node: fx.Node) -> str:
    """The user's ``file:line`` of ``node`` (portable: relative where it can be)."""
    source = node.meta.get(META_SOURCE)
    return format_location(source, portable=True) if source else "no source line"


@dataclasses.dataclass(frozen=True)
class Statement:
    text: str               # one statement of forward, without indentation
    node: fx.Node | None    # the node it belongs to (None: torch.fx's own input flattening)


@dataclasses.dataclass(frozen=True)
class Forward:
    statements: list[Statement]
    signature: str          # "def forward(self, x):"
    wrapped: list[str]      # global names fx.wrap must know
    script: ScriptSource    # functions copied from __main__
    imports: Imports        # what forward and the copied functions need


def forward_code(gm: fx.GraphModule, class_name: str) -> Forward:
    """forward's statements, each with its node, and the imports they need.

    ``class_name``: the name module.py gives the module (a copied function may not take it).

    >>> import torch, fxdebug
    >>> forward = forward_code(fxdebug.trace(torch.nn.ReLU()), "ReLU")
    >>> forward.signature, [s.text for s in forward.statements]
    ('def forward(self, input : torch.Tensor) -> torch.Tensor:', ['input_1 = input', 'relu = torch.nn.functional.relu(input_1, inplace = False)', 'return relu'])
    """
    imports = Imports()
    code = gm.graph.python_code(root_module="self")
    src_lines = code.src.split("\n")
    def_index = torch_compat.def_line(code.src)
    if not src_lines[def_index].startswith("def forward"):
        raise FxdebugError("fxdebug.dump does not understand the code torch.fx generated for this "
                           "graph (no 'def forward' where expected); please report it with the model.")
    wrapped = re.findall(r'wrap\("(\w+)"\)', "\n".join(src_lines[:def_index]))
    nodes = list(gm.graph.nodes)
    lines_to_nodes = torch_compat.lineno_map(code)
    lines: list[Statement] = []
    for offset, raw in enumerate(src_lines[def_index + 1:], start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        index = lines_to_nodes.get(offset)
        node = nodes[index] if index is not None and 0 <= index < len(nodes) else None
        parts = text.split(";  ")
        lines.append(Statement(parts[0], node))
        for part in parts[1:]:
            if not _DELETION.match(part):  # fx frees values after their last use: the dump
                lines.append(Statement(part, node))  # keeps them, so pdb can print any of them
    specs = torch_compat.pytree_specs(gm.graph)
    if specs is not None:  # fx flattens the inputs and rebuilds the output with torch's private
        in_spec, out_spec = specs  # pytree: module.py does it in plain Python
        lines = _plain_pytree(lines, in_spec, out_spec, imports)
    body = "\n".join([src_lines[def_index]] + [line.text for line in lines])
    used = dict.fromkeys(_IDENTIFIER.findall(body))
    script = ScriptSource(reserved=(class_name,))
    renamed: dict[str, str] = {}
    builtins = torch_compat.custom_builtin_imports()
    for name, obj in code.globals.items():
        if name not in used or name == "wrap":
            continue
        if name in builtins:
            imports.lines[builtins[name]] = None
            continue
        if isinstance(obj, types.ModuleType):
            imports.lines[f"import {obj.__name__}" + ("" if name == obj.__name__ else f" as {name}")] = None
            continue
        found = importable(obj)
        if isinstance(found, str):
            user = next((n for n in nodes if n.target is obj), None)
            where = (f"node {node_key(user)!r} ({node_where(user)})" if user is not None
                     else "the graph")
            if is_script_object(obj):  # a notebook's or script's function: copy its source
                alias = obj.__name__
                while alias in used or alias in code.globals:  # a node of forward has its name
                    alias = f"script_{alias}"
                script.add(alias, obj, where)
                renamed[name] = alias  # fx calls it __main___NAME: mangled inside a class
                continue
            raise FxdebugError(
                f"cannot dump: {where} calls {getattr(obj, '__qualname__', name)}, which {found}. "
                f"module.py imports every function the graph calls; move it to the top level of "
                f"an importable module (and torch.fx.wrap it there if it must stay one node), "
                f"then trace and dump again.")
        imports.add_object(name, *found)
    for old, new in renamed.items():
        pattern = re.compile(rf"\b{re.escape(old)}\b")
        lines = [Statement(pattern.sub(new, line.text), line.node) for line in lines]
    wrapped = [renamed.get(w, w) for w in wrapped if w in used]
    return Forward(lines, src_lines[def_index], wrapped, script, Imports.merged(imports, script.imports))


_FLATTEN = re.compile(r"^(?P<targets>.*?)\s*=\s*fx_pytree\.tree_flatten_spec\((?P<value>.*), self\._in_spec\)$")
_UNFLATTEN = re.compile(r"^return pytree\.tree_unflatten\((?P<leaves>.*), self\._out_spec\)$")


def _plain_pytree(lines: list[Statement], in_spec, out_spec, imports: Imports) -> list[Statement]:
    """fx's ``fx_pytree.tree_flatten_spec(...)`` and ``pytree.tree_unflatten(...)`` lines
    written as plain Python: one ``leaf = value['key'][0]`` a line, a literal output."""
    plain: list[Statement] = []
    for line in lines:
        text, node = line.text, line.node
        flatten, unflatten = _FLATTEN.match(text), _UNFLATTEN.match(text)
        if flatten:
            targets = [t.strip() for t in flatten["targets"].split(",") if t.strip()]
            values = _leaf_expressions(ast.parse(flatten["value"], mode="eval").body, in_spec)
            if len(values) != len(targets):
                raise FxdebugError(f"fxdebug.dump: the input specification has {len(values)} "
                                   f"leaves, forward {len(targets)} inputs; please report it "
                                   f"with the model.")
            plain += [Statement(f"{target} = {value}", node) for target, value in zip(targets, values)
                      if target != value]
        elif unflatten:
            leaves = ast.parse(unflatten["leaves"], mode="eval").body
            items = iter(ast.unparse(leaf) for leaf in getattr(leaves, "elts", [leaves]))
            plain.append(Statement(f"return {_rebuilt(out_spec, items, imports)}", node))
        else:
            plain.append(line)
    return plain


def _unsupported(kind) -> FxdebugError:
    return FxdebugError(f"cannot dump: forward takes or returns a {kind.__module__}.{kind.__qualname__} "
                        f"that torch's pytree opens; module.py writes tuples, lists, dicts, "
                        f"namedtuples and OrderedDicts as plain Python, not this. Return or take "
                        f"one of those instead, then trace and dump again.")


def _leaf_expressions(value: ast.expr, spec) -> list[str]:
    """Python expressions of the leaves of ``value`` (the code fx flattens) under ``spec``."""
    parts = torch_compat.treespec_parts(spec)
    if parts is None:
        return [ast.unparse(value)]
    kind, context, children = parts
    if kind is type(None):
        return []
    if isinstance(value, (ast.List, ast.Tuple)) and kind in (list, tuple) \
            and len(value.elts) == len(children):
        pairs = list(zip(value.elts, children))
    elif isinstance(value, ast.Dict) and kind is dict and list(context) == [
            key.value if isinstance(key, ast.Constant) else None for key in value.keys]:
        pairs = list(zip(value.values, children))
    elif issubclass(kind, (list, tuple)):
        pairs = [(ast.Subscript(value, ast.Constant(index)), child) for index, child in enumerate(children)]
    elif issubclass(kind, dict):
        pairs = [(ast.Subscript(value, ast.Constant(key)), child) for key, child in zip(context, children)]
    else:
        raise _unsupported(kind)
    return [leaf for item, child in pairs for leaf in _leaf_expressions(item, child)]


def _rebuilt(spec, leaves, imports: Imports) -> str:
    """The Python expression that builds the output ``spec`` describes from ``leaves``."""
    parts = torch_compat.treespec_parts(spec)
    if parts is None:
        return next(leaves)
    kind, context, children = parts
    if kind is type(None):
        return "None"
    items = [_rebuilt(child, leaves, imports) for child in children]
    if kind is tuple:
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if kind is list:
        return "[" + ", ".join(items) + "]"
    pairs = "{" + ", ".join(f"{key!r}: {item}" for key, item in zip(context, items)) + "}"
    if kind is dict:
        return pairs
    namedtuple = issubclass(kind, tuple) and hasattr(kind, "_fields")
    found = importable(kind)
    if not (namedtuple or kind is collections.OrderedDict) or isinstance(found, str):
        raise _unsupported(kind)
    alias = re.sub(r"\W", "_", f"{found[0]}_{found[1]}")
    imports.add_object(alias, *found)
    return f"{alias}({', '.join(items)})" if namedtuple else f"{alias}({pairs})"
