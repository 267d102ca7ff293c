"""module.py's text, written from a :class:`~fxdebug.dumping.plan.ModulePlan`, and where each node sits.

Every statement of ``forward`` ends with ``# [node key] user/file.py:line``;
:func:`module_text` also says on which line of module.py each node sits (what
``breakpoints.json`` and ``fxdebug debug --break`` use).
"""

from __future__ import annotations

import dataclasses
from importlib import resources

from .literals import literal
from .plan import PICKLED_FILE, Line, ModulePlan

__all__ = ["ModuleText", "module_text", "template"]

_COMMENT_COLUMN = 60


def template(name: str) -> str:
    """The text of ``fxdebug/dumping/templates/NAME`` (package data), for ``str.format``.

    >>> "{cls}" in template("package_init.py.tmpl")
    True
    """
    return resources.files(__package__).joinpath("templates", name).read_text(encoding="utf-8")


@dataclasses.dataclass(frozen=True)
class ModuleText:
    text: str
    forward_line: int              # the line of ``def forward``
    nodes: dict[str, dict]         # node key -> {line, node, op, source, inputs}


def _comment(line: Line) -> str:
    node = line.node
    if node is None:  # torch.fx's own input flattening
        return "# [inputs]"
    parts = [f"# [{node.key}]"]
    if node.fx_op != "output" and node.source:
        parts.append(node.source)
    if node.inserted_by:
        parts.append(f"(inserted by {node.inserted_by})")
    return " ".join(parts)


def _pad(statement: str, comment: str, indent: str) -> str:
    text = f"{indent}{statement}"
    return f"{text.ljust(_COMMENT_COLUMN)}  {comment}" if len(text) < _COMMENT_COLUMN else f"{text}  {comment}"


def module_text(plan: ModulePlan) -> ModuleText:
    """module.py: the imports, the submodules built in ``__init__``, forward, ``load()``."""
    weights = plan.weights
    head = template("module_head.py.tmpl").format(
        cls=plan.cls, imports=plan.imports.text() + ("\n\n\n" + plan.script if plan.script else ""),
        wrap="".join(f'\ntorch.fx.wrap("{name}")\n' for name in plan.wrapped),
        frozen=literal(tuple(weights.frozen)), tied=literal(weights.tied), training=plan.training,
        training_exceptions=literal(plan.training_exceptions))
    if plan.pickled is not None:
        head += template("pickled_loader.py.tmpl").format(pickled_file=PICKLED_FILE,
                                                          sha256=plan.pickled.sha256)
    out = head.rstrip("\n").split("\n") + ["", "", f"class {plan.cls}(torch.nn.Module):",
                                           "    def __init__(self):", "        super().__init__()"]
    if plan.pickled is not None:
        out.append("        pickled = _pickled_modules()")
    out += [f"        {line}" for line in plan.init_lines]
    out += ["", f"    {plan.signature}"]
    forward_line = len(out)
    nodes: dict[str, dict] = {}
    for line in plan.lines:
        out.append(_pad(line.statement, _comment(line), "        "))
        node = line.node
        if node is not None and node.fx_op != "placeholder" and node.key not in nodes:
            nodes[node.key] = {"line": len(out), "node": node.name, "op": node.op,
                               "source": node.source or "no source line", "inputs": node.inputs}
    text = "\n".join(out) + "\n" + template("module_tail.py.tmpl").format(cls=plan.cls)
    return ModuleText(text, forward_line, nodes)
