"""module.py's text: the imports, the submodules and ``forward``, one statement a line.

fx's generated code is re-laid out: one statement a line (fx frees values
after their last use; the dump keeps them, so pdb can print any of them),
each ending with ``# [node key] user/file.py:line``, and every global it
calls imported by name. :func:`module_py` also says on which line of module.py
each node sits (what ``breakpoints.json`` and ``fxdebug debug --break`` use).
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import keyword
import re
import types
from importlib import resources

import torch
import torch.fx as fx

from ..errors import FxdebugError
from ..runtime import Recorder, torch_compat
from ..runtime.formatting import format_location
from ..tracing.keys import META_PASS, META_SOURCE, node_key, op_name
from .literals import Imports, importable, literal
from .script_source import ScriptSource, is_script_object
from .structure import Structure

__all__ = ["Forward", "forward_code", "module_py", "class_name", "weights",
           "template", "PICKLED_FILE"]

PICKLED_FILE = "pickled_modules.pt"
_COMMENT_COLUMN = 60
_DELETION = re.compile(r"^(?:[A-Za-z_]\w* = )+None$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


def template(name: str) -> str:
    """The text of ``fxdebug/dumping/templates/NAME`` (package data), for ``str.format``."""
    return resources.files(__package__).joinpath("templates", name).read_text(encoding="utf-8")


def _node_where(node: fx.Node) -> str:
    source = node.meta.get(META_SOURCE)
    return format_location(source, portable=True) if source else "no source line"


@dataclasses.dataclass
class Forward:
    lines: list[tuple[str, fx.Node | None]]   # (statement, node it belongs to)
    signature: str                             # "def forward(self, x):"
    wrapped: list[str]                         # global names fx.wrap must know
    script: ScriptSource                       # functions copied from __main__


def _node_comment(node: fx.Node | None) -> str:
    if node is None:  # torch.fx's own input flattening
        return "# [inputs]"
    parts = [f"# [{node_key(node)}]"]
    if node.op != "output" and node.meta.get(META_SOURCE):
        parts.append(_node_where(node))
    if node.meta.get(META_PASS):
        parts.append(f"(inserted by {node.meta[META_PASS]})")
    return " ".join(parts)


def forward_code(gm: fx.GraphModule, imports: Imports) -> Forward:
    code = gm.graph.python_code(root_module="self")
    src_lines = code.src.split("\n")
    def_index = torch_compat.def_line(code.src)
    if not src_lines[def_index].startswith("def forward"):
        raise FxdebugError("fxdebug.dump does not understand the code torch.fx generated for this "
                           "graph (no 'def forward' where expected); please report it with the model.")
    wrapped = re.findall(r'wrap\("(\w+)"\)', "\n".join(src_lines[:def_index]))
    nodes = list(gm.graph.nodes)
    lines_to_nodes = torch_compat.lineno_map(code)
    lines: list[tuple[str, fx.Node | None]] = []
    for offset, raw in enumerate(src_lines[def_index + 1:], start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        index = lines_to_nodes.get(offset)
        node = nodes[index] if index is not None and 0 <= index < len(nodes) else None
        parts = text.split(";  ")
        lines.append((parts[0], node))
        for part in parts[1:]:
            if not _DELETION.match(part):  # fx frees values after their last use: the dump
                lines.append((part, node))  # keeps them, so pdb can print any of them
    specs = torch_compat.pytree_specs(gm.graph)
    if specs is not None:  # fx flattens the inputs and rebuilds the output with torch's private
        in_spec, out_spec = specs  # pytree: module.py does it in plain Python
        lines = _plain_pytree(lines, in_spec, out_spec, imports)
    body = "\n".join([src_lines[def_index]] + [text for text, _ in lines])
    used = dict.fromkeys(_IDENTIFIER.findall(body))
    script = ScriptSource(imports, reserved=(class_name(gm),))
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
            where = (f"node {node_key(user)!r} ({_node_where(user)})" if user is not None
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
        lines = [(pattern.sub(new, text), node) for text, node in lines]
    wrapped = [renamed.get(w, w) for w in wrapped if w in used]
    return Forward(lines, src_lines[def_index], wrapped, script)


_FLATTEN = re.compile(r"^(?P<targets>.*?)\s*=\s*fx_pytree\.tree_flatten_spec\((?P<value>.*), self\._in_spec\)$")
_UNFLATTEN = re.compile(r"^return pytree\.tree_unflatten\((?P<leaves>.*), self\._out_spec\)$")


def _plain_pytree(lines: list[tuple[str, fx.Node | None]], in_spec, out_spec,
                  imports: Imports) -> list[tuple[str, fx.Node | None]]:
    """fx's ``fx_pytree.tree_flatten_spec(...)`` and ``pytree.tree_unflatten(...)`` lines
    written as plain Python: one ``leaf = value['key'][0]`` a line, a literal output."""
    plain: list[tuple[str, fx.Node | None]] = []
    for text, node in lines:
        flatten, unflatten = _FLATTEN.match(text), _UNFLATTEN.match(text)
        if flatten:
            targets = [t.strip() for t in flatten["targets"].split(",") if t.strip()]
            values = _leaf_expressions(ast.parse(flatten["value"], mode="eval").body, in_spec)
            if len(values) != len(targets):
                raise FxdebugError(f"fxdebug.dump: the input specification has {len(values)} "
                                   f"leaves, forward {len(targets)} inputs; please report it "
                                   f"with the model.")
            plain += [(f"{target} = {value}", node) for target, value in zip(targets, values)
                      if target != value]
        elif unflatten:
            leaves = ast.parse(unflatten["leaves"], mode="eval").body
            items = iter(ast.unparse(leaf) for leaf in getattr(leaves, "elts", [leaves]))
            plain.append((f"return {_rebuilt(out_spec, items, imports)}", node))
        else:
            plain.append((text, node))
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


def weights(gm: fx.GraphModule) -> tuple[dict, dict, list]:
    """(name -> tensor, tied name -> first name, frozen parameter names)."""
    first: dict[int, str] = {}
    weights: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    frozen: list[str] = []
    named = list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in first:
            tied[name] = first[id(tensor)]
            continue
        first[id(tensor)] = name
        data = tensor.detach()
        if data.untyped_storage().nbytes() != data.numel() * data.element_size() or data.storage_offset():
            data = data.clone()  # a view into a larger storage: save only its own elements
        weights[name] = data
        if isinstance(tensor, torch.nn.Parameter) and not tensor.requires_grad:
            frozen.append(name)
    return weights, tied, frozen


def _training_flags(gm: torch.nn.Module) -> tuple[bool, dict[str, bool]]:
    """The root's train/eval state and the modules in the other state (containers fx made
    and the recorder do nothing with it, so they are left out)."""
    exceptions = {name: module.training for name, module in gm.named_modules(remove_duplicate=False)
                  if name and module.training != gm.training
                  and type(module) is not torch.nn.Module and not isinstance(module, Recorder)}
    return gm.training, exceptions


def class_name(gm: fx.GraphModule) -> str:
    name = re.sub(r"\W", "_", type(gm).__name__) or "Dumped"
    if name[0].isdigit() or keyword.iskeyword(name) or name in ("torch", "os", "load", "HERE",
                                                                  "pickled", "Module"):
        name = f"Dumped{name}"
    return name


def _pad(statement: str, comment: str, indent: str) -> str:
    text = f"{indent}{statement}"
    return f"{text.ljust(_COMMENT_COLUMN)}  {comment}" if len(text) < _COMMENT_COLUMN else f"{text}  {comment}"


def module_py(gm: fx.GraphModule, cls: str, imports: Imports, forward: Forward,
               structure: Structure, pickled_sha: str | None, pytree_inputs: bool,
               weight_info: tuple) -> tuple[str, int, dict[str, dict]]:
    """module.py's text, the line of ``def forward`` and, for every node key, its line and inputs.

    ``weight_info``: ``weights(gm)``, which the caller also writes to weights.pt.
    """
    _, tied, frozen = weight_info
    training, training_exceptions = _training_flags(gm)
    extra_attrs: list[str] = []  # pytree_inputs: forward_code flattens them in plain Python
    head = template("module_head.py.tmpl").format(
        cls=cls, imports=imports.text() + ("\n\n\n" + forward.script.text() if forward.script.text() else ""),
        wrap="".join(f'\ntorch.fx.wrap("{name}")\n' for name in forward.wrapped),
        frozen=literal(tuple(frozen)), tied=literal(tied), training=training,
        training_exceptions=literal(training_exceptions))
    if pickled_sha is not None:
        head += template("pickled_loader.py.tmpl").format(pickled_file=PICKLED_FILE,
                                                          sha256=pickled_sha)
    out = head.rstrip("\n").split("\n") + ["", "", f"class {cls}(torch.nn.Module):",
                                           "    def __init__(self):", "        super().__init__()"]
    if pickled_sha is not None:
        out.append("        pickled = _pickled_modules()")
    out += [f"        {line}" for line in structure.lines + extra_attrs]
    out += ["", f"    {forward.signature}"]
    forward_line = len(out)
    node_lines: dict[str, dict] = {}
    modules = dict(gm.named_modules(remove_duplicate=False))  # not get_submodule per node
    for statement, node in forward.lines:
        out.append(_pad(statement, _node_comment(node), "        "))
        if node is not None and node.op != "placeholder" and node_key(node) not in node_lines:
            node_lines[node_key(node)] = {
                "line": len(out), "node": node.name, "op": op_name(node, gm, modules),
                "source": _node_where(node), "inputs": [arg.name for arg in node.all_input_nodes]}
    return "\n".join(out) + "\n" + template("module_tail.py.tmpl").format(cls=cls), forward_line, node_lines
