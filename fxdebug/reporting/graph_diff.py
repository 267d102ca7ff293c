"""``diff(before, after)``: what a pass did to a graph, as rows and as a code diff.

Nodes are matched by name, and where a pass replaced a node (recorded with
:func:`fxdebug.passes.inherit_key`) by provenance. Each row is marked::

    +  added          -  removed          ~  changed (target, args or kwargs)

Underneath are plain data objects (:class:`GraphDiff`, :class:`DiffRow`,
:class:`~fxdebug.reporting.node_table.NodeView`) that tests and tools can read.

Example::

    >>> import operator, torch, fxdebug
    >>> class Sub(torch.nn.Module):
    ...     def forward(self, x, y):
    ...         return x - y
    >>> before = fxdebug.trace(Sub())
    >>> after = fxdebug.trace(Sub())
    >>> sub = [n for n in after.graph.nodes if n.target is operator.sub][0]
    >>> sub.args = (sub.args[1], sub.args[0]); _ = after.recompile()
    >>> d = fxdebug.diff(before, after)
    >>> [(row.mark, row.key, row.changes) for row in d.changed]
    [('~', 'sub', ('args (x, y) -> (y, x)',))]
"""

from __future__ import annotations

import dataclasses
import difflib
import weakref

import torch.fx as fx

from ..errors import FxdebugError, GraphChangedError
from ..passes.base import graph_source
from ..base.fit_to_width import fit_table, table_width
from ..base.report import Report
from ..tracing.keys import META_PROVENANCE
from .html import diff_html
from .node_table import COLUMNS, NodeView, node_views

__all__ = ["diff", "GraphDiff", "DiffRow", "GraphSnapshot", "snapshot"]

# Columns of GraphDiff.table a narrow terminal gives up first.
DIFF_DROP = ("kwargs", "name", "opcode", "pass", "args")

_COMPARED = ("opcode", "target", "args", "kwargs")


@dataclasses.dataclass(frozen=True)
class GraphSnapshot:
    """A graph frozen as text: its node views, provenance by name, and its generated code.

    The code of a snapshot that :func:`diff` takes of a GraphModule is generated
    when first read (``code_diff()``), from the module, after checking that its
    graph still shows the same nodes (generating the code of a large graph takes
    longer than comparing it). :func:`snapshot` freezes the code at once.
    """

    name: str
    frozen_code: str | None
    views: tuple[NodeView, ...]
    provenance: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: weakref.ref | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def code(self) -> str:
        """The generated code of the graph as it was when the snapshot was taken."""
        if self.frozen_code is None:
            gm = self.source() if self.source is not None else None
            if gm is None or tuple(node_views(gm)) != self.views:
                raise GraphChangedError(
                    f"the code of {self.name or 'the graph'} cannot be shown: its GraphModule "
                    f"{'was deleted' if gm is None else 'changed'} after fxdebug.diff() compared "
                    f"it. Call diff() again, or pass fxdebug.reporting.snapshot(gm) to diff() "
                    f"to freeze the code before the module changes.")
            code = graph_source(gm)
            object.__setattr__(self, "frozen_code", code)
            return code
        return self.frozen_code

    def table(self) -> str:
        return fit_table([view.row() for view in self.views], COLUMNS)

    def __repr__(self) -> str:
        """One line: the name and the size (``table()`` and ``code`` hold the graph).

        >>> import torch
        >>> snapshot(torch.fx.symbolic_trace(torch.nn.ReLU()), "relu")
        <GraphSnapshot 'relu': 3 nodes>
        """
        return f"<GraphSnapshot {self.name!r}: {len(self.views)} nodes>"


def snapshot(gm: fx.GraphModule, name: str = "", *inputs, lazy_code: bool = False
             ) -> GraphSnapshot:
    """Freeze ``gm`` now (later edits to it do not change the snapshot).

    ``lazy_code=True`` generates the code when first read (see :class:`GraphSnapshot`).

    >>> import torch
    >>> gm = torch.fx.symbolic_trace(torch.nn.ReLU())
    >>> shot = snapshot(gm, "relu")
    >>> [view.key for view in shot.views], "functional.relu" in shot.code
    (['input_1', 'relu', 'output'], True)
    """
    provenance = tuple((node.name, tuple(old for old, _ in node.meta.get(META_PROVENANCE, ())))
                       for node in gm.graph.nodes if node.meta.get(META_PROVENANCE))
    views = tuple(node_views(gm, *inputs))
    if lazy_code and not inputs:
        return GraphSnapshot(name, None, views, provenance, weakref.ref(gm))
    return GraphSnapshot(name, graph_source(gm), views, provenance)


@dataclasses.dataclass(frozen=True)
class DiffRow:
    """One node in a diff: ``mark`` is ``+``, ``-``, ``~`` or ``" "`` (unchanged)."""

    mark: str
    before: NodeView | None
    after: NodeView | None
    changes: tuple[str, ...] = ()

    @property
    def view(self) -> NodeView:
        view = self.after if self.after is not None else self.before
        if view is None:
            raise FxdebugError("a DiffRow needs the node before or after the pass (both are None)")
        return view

    @property
    def key(self) -> str:
        return self.view.key


@dataclasses.dataclass(frozen=True, repr=False)
class GraphDiff(Report):
    """Rows in graph order (removed nodes where they stood) and both graphs' snapshots.

    A :class:`~fxdebug.base.report.Report` without a verdict: ``repr`` is one
    line (``<GraphDiff 12 nodes: +4 -0 ~1>``), ``to_dict()`` lists the keys added,
    removed and changed.
    """

    rows: tuple[DiffRow, ...]
    before: GraphSnapshot
    after: GraphSnapshot

    @property
    def before_code(self) -> str:
        return self.before.code

    @property
    def after_code(self) -> str:
        return self.after.code

    @property
    def added(self) -> list[DiffRow]:
        return [row for row in self.rows if row.mark == "+"]

    @property
    def removed(self) -> list[DiffRow]:
        return [row for row in self.rows if row.mark == "-"]

    @property
    def changed(self) -> list[DiffRow]:
        return [row for row in self.rows if row.mark == "~"]

    def __bool__(self) -> bool:
        return any(row.mark != " " for row in self.rows)

    def summary(self) -> str:
        return f"+{len(self.added)} -{len(self.removed)} ~{len(self.changed)}"

    def _size(self) -> str:
        return f"{len(self.rows)} nodes"

    def _finding(self) -> str:
        return self.summary()

    def _fields(self) -> dict:
        return {"added": [row.key for row in self.added],
                "removed": [row.key for row in self.removed],
                "changed": {row.key: list(row.changes) for row in self.changed}}

    def table(self, wide: bool | None = None, unchanged: bool = False) -> str:
        """The rows in the tabular format; ``~`` rows say what changed.

        Fitted to the terminal unless ``wide=True`` (see :mod:`fxdebug.base.fit_to_width`).
        """
        rows = [[row.mark, row.view.key, row.view.opcode, row.view.name, row.view.target,
                 row.view.args, row.view.kwargs, row.view.pass_name, "; ".join(row.changes)]
                for row in self.rows if unchanged or row.mark != " "]
        if not rows:
            return f"no change ({len(self.rows)} nodes)"
        headers = ["", "key", "opcode", "name", "target", "args", "kwargs", "pass", "changed"]
        return fit_table(rows, headers, width=table_width(wide), drop=DIFF_DROP,
                         truncate=("key", "target", "args", "changed")) + f"\n{self.summary()}"

    def _repr_html_(self) -> str:
        """The diff as HTML for Jupyter: + / - / ~ rows coloured, and the code diff."""
        return diff_html(self)

    def code_diff(self, context: int = 3) -> str:
        """Unified diff of the generated code (empty when the code is the same)."""
        return "".join(difflib.unified_diff(self.before_code.splitlines(keepends=True),
                                            self.after_code.splitlines(keepends=True),
                                            fromfile="before", tofile="after", n=context))


def _as_snapshot(graph_or_snapshot, role: str) -> GraphSnapshot:
    if isinstance(graph_or_snapshot, GraphSnapshot):
        return graph_or_snapshot
    if isinstance(graph_or_snapshot, fx.GraphModule):
        return snapshot(graph_or_snapshot, role, lazy_code=True)
    raise TypeError(f"diff: {role} must be a torch.fx.GraphModule or a GraphSnapshot, got "
                    f"{type(graph_or_snapshot).__name__}.")


def diff(before, after) -> GraphDiff:
    """Compare two GraphModules (or snapshots of them), node by node.

    Args:
        before / after: ``torch.fx.GraphModule`` or :class:`GraphSnapshot`.
            Snapshot ``before`` first if a pass edits the module in place.

    Returns:
        A :class:`GraphDiff`: ``print(d.table())``, ``print(d.code_diff())``.
    """
    old, new = _as_snapshot(before, "before"), _as_snapshot(after, "after")
    old_by_name = {view.name: view for view in old.views}
    old_order = {view.name: index for index, view in enumerate(old.views)}
    replaced = dict(new.provenance)
    new_names = {view.name for view in new.views}
    matched: dict[str, str] = {}  # new name -> old name
    for view in new.views:
        if view.name in old_by_name:
            matched[view.name] = view.name
    taken = set(matched.values())
    for view in new.views:
        if view.name in matched:
            continue
        for old_name in reversed(replaced.get(view.name, ())):
            if old_name in old_by_name and old_name not in taken and old_name not in new_names:
                matched[view.name] = old_name
                taken.add(old_name)
                break
    renamed = {new_name: old_name for new_name, old_name in matched.items() if new_name != old_name}

    def as_before(view: NodeView, field: str) -> str:
        """The field's text with replaced nodes called by their old names (node names only,
        never text inside a string: the arguments were rendered in pieces)."""
        text = getattr(view, field)
        if field not in ("args", "kwargs") or not renamed:
            return text
        parts = view.args_parts if field == "args" else view.kwargs_parts
        if "".join(parts) != text:  # a view built by hand, without pieces: compare as is
            return text
        return "".join(renamed.get(part, part) if index % 2 else part  # odd: a node's name
                       for index, part in enumerate(parts))

    rows: list[DiffRow] = []
    emitted: set[str] = set()
    cursor = 0  # old views before it were all emitted or matched: each is looked at once

    def flush_removed(up_to: int) -> None:
        nonlocal cursor
        while cursor < up_to:
            old_view = old.views[cursor]
            cursor += 1
            if old_view.name not in taken and old_view.name not in emitted:
                emitted.add(old_view.name)
                rows.append(DiffRow("-", old_view, None))

    for view in new.views:
        found = matched.get(view.name)
        if found is None:
            rows.append(DiffRow("+", None, view))
            continue
        old_name = found
        flush_removed(old_order[old_name])
        previous = old_by_name[old_name]
        changes = tuple(f"{field} {getattr(previous, field)} -> {getattr(view, field)}"
                        for field in _COMPARED
                        if getattr(previous, field) != as_before(view, field))
        if old_name != view.name:
            changes = (f"replaces {old_name}",) + changes
        rows.append(DiffRow("~" if changes else " ", previous, view, changes))
    flush_removed(len(old.views))
    return GraphDiff(tuple(rows), old, new)
