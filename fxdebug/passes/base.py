"""Pass and PassResult: the unit of graph rewriting, built on torch's pass infrastructure.

An fxdebug pass is a ``torch.fx.passes.infra.pass_base.PassBase``: it runs in
torch's own ``PassManager`` as it does in :class:`fxdebug.PassManager`, and
:class:`PassResult` *is* torch's ``PassResult`` (``graph_module``,
``modified``). Write ``run(gm) -> bool`` ("did it change the graph"); torch's
``call(gm) -> PassResult`` is derived from it. Any other ``PassBase`` and any
function ``gm -> PassResult | gm | None`` is a pass too, through :func:`as_pass`.

:func:`run_passes` is the one pass runner: calling a pass, ``instrument()``,
``fxdebug.PassManager`` and ``fxdebug check`` all run passes through it, so a
failing pass is named the same way everywhere::

    run_passes(gm, passes, after_each=None)
      └─ for each pass
           ├─ pass.apply(gm)
           │    ├─ requires(gm)         torch's PassBase protocol
           │    ├─ call(gm) -> run(gm)  the rewrite, in place
           │    └─ ensures(gm)
           ├─ graph.lint()            skipped after one of fxdebug's own passes that
           │                          changed nothing (the graph linted already)
           ├─ after_each(pass, result)  the caller's step: recompile, snapshot, check
           └─ an exception: a note naming the pass, the node key and the user's
              file:line where known, and the passes before it
    pass(gm)                            run_passes(gm, [pass]), recompiled when modified
"""

from __future__ import annotations

import re
from typing import Callable, Iterable, Sequence

import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from ..errors import FxdebugError
from ..runtime.inplace_ops import INPLACE_OPERATORS
from ..tracing.keys import META_SOURCE, node_key
from ..base.formatting import format_location

__all__ = ["Pass", "PassResult", "as_pass", "FunctionPass", "graph_source", "unchanged_message",
           "run_passes", "pass_failure_note"]


def graph_source(gm: fx.GraphModule) -> str:
    """The code ``gm.recompile()`` would generate for the graph as it is now, without compiling it.

    >>> import torch, fxdebug
    >>> print(graph_source(fxdebug.trace(torch.nn.ReLU())).strip().splitlines()[-1])
    return relu
    """
    return gm.graph.python_code(root_module="self").src


def unchanged_message(pass_name: str, gm: fx.GraphModule) -> str:
    """Why a pass that changed nothing may have missed what it looks for (for a warning).

    Where writing in place can matter, fxdebug traces ``x += y`` as
    ``operator.iadd`` (as eager runs it) where ``torch.fx.symbolic_trace``
    gives ``operator.add``: a pass written against plain fx that matches
    ``operator.add`` finds nothing there. (A ``+=`` nothing can observe is
    traced as ``operator.add``, see :mod:`fxdebug.tracing.inplace_lowering`.)

    >>> import torch, fxdebug
    >>> class Residual(torch.nn.Module):
    ...     def forward(self, x):
    ...         y = x * 2
    ...         y += x
    ...         return y
    >>> print(unchanged_message("fuse-add", fxdebug.trace(Residual())).split(". ")[0])
    pass 'fuse-add' changed nothing in the graph
    """
    message = f"pass {pass_name!r} changed nothing in the graph."
    inplace = [node for node in gm.graph.nodes
               if node.op == "call_function" and node.target in INPLACE_OPERATORS]
    if inplace:
        first = inplace[0]
        names = sorted(dict.fromkeys(node.target.__name__ for node in inplace))
        message += (f" Note: fxdebug keeps augmented assignments in place ({len(inplace)} "
                    f"node(s): operator.{', operator.'.join(names)}; first {node_key(first)!r} "
                    f"at {format_location(first.meta.get(META_SOURCE))}) where the write can "
                    f"matter, where "
                    f"torch.fx.symbolic_trace gives operator.add and friends. A pass that "
                    f"matches operator.add should match operator.iadd too, or run after "
                    f"fxdebug.passes.Functionalize(), which rewrites them out of place where "
                    f"that computes the same values.")
    return message


class Pass(PassBase):
    """Base class: set ``name`` and implement ``run(gm) -> bool`` (modified).

    Calling the pass runs it, lints the graph and recompiles the module
    when it changed; :meth:`apply` leaves both to the caller::

        >>> import torch, fxdebug
        >>> class DropNothing(fxdebug.passes.Pass):
        ...     name = "drop-nothing"
        ...     def run(self, gm):
        ...         return False
        >>> gm = fxdebug.trace(torch.nn.ReLU())
        >>> DropNothing()(gm).modified
        False
        >>> from torch.fx.passes.infra.pass_manager import PassManager
        >>> PassManager([DropNothing()])(gm).modified       # torch's own manager runs it too
        False
    """

    name: str = "pass"

    def run(self, gm: fx.GraphModule) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement run(gm) -> bool")

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        """torch's ``PassBase.call``: ``run`` the pass, as a ``PassResult``."""
        modified = self.run(graph_module)
        if not isinstance(modified, bool):
            raise TypeError(f"pass {self.name!r} ({type(self).__name__}.run) returned "
                            f"{modified!r}; it must return True or False (graph modified).")
        return PassResult(graph_module, modified)

    def apply(self, gm: fx.GraphModule) -> PassResult:
        """Run the pass (``requires``, ``call``, ``ensures``) without linting or recompiling."""
        self.requires(gm)
        result = self.call(gm)
        if not isinstance(result, PassResult):
            raise TypeError(f"pass {self.name!r} returned {type(result).__name__}; a pass must "
                            f"return a PassResult(graph_module, modified).")
        self.ensures(result.graph_module)
        return result

    def __call__(self, graph_module: fx.GraphModule) -> PassResult:
        return run_passes(graph_module, [self], after_each=_recompile_modified)

    def __repr__(self) -> str:
        return f"<Pass {self.name}>"


class FunctionPass(Pass):
    """Wraps a function ``gm -> gm | None | PassResult`` as a Pass named after it."""

    def __init__(self, fn: Callable, name: str | None = None) -> None:
        self.fn = fn
        self.name: str = name or str(getattr(fn, "__name__", type(fn).__name__))

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        before = graph_source(graph_module)
        result = self.fn(graph_module)
        if isinstance(result, PassResult):
            return result
        if result is None:
            out = graph_module
        elif isinstance(result, fx.GraphModule):
            out = result
        else:
            raise TypeError(f"pass {self.name!r} returned {type(result).__name__}; a pass "
                            f"function must return a GraphModule, None or a PassResult.")
        return PassResult(out, out is not graph_module or graph_source(out) != before)


class _ForeignPass(Pass):
    """Another library's ``PassBase`` (torch's own passes), named after its class."""

    def __init__(self, inner: PassBase) -> None:
        self.inner = inner
        self.name = type(inner).__name__

    def apply(self, gm: fx.GraphModule) -> PassResult:
        before = graph_source(gm)
        result = self.inner(gm)
        if result is None:  # torch allows it: the module was edited in place
            return PassResult(gm, graph_source(gm) != before)
        return PassResult(result.graph_module, result.modified)

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        return self.apply(graph_module)


def as_pass(obj) -> Pass:
    """Return ``obj`` as a Pass: fxdebug passes as they are, a torch ``PassBase`` or a function wrapped.

    >>> as_pass(lambda gm: gm).name
    '<lambda>'
    """
    if isinstance(obj, Pass):
        return obj
    if isinstance(obj, type) and issubclass(obj, PassBase):
        raise TypeError(f"got the class {obj.__name__}; pass an instance: {obj.__name__}(...)")
    if isinstance(obj, PassBase):
        return _ForeignPass(obj)
    if callable(obj):
        return FunctionPass(obj)
    raise TypeError(f"{obj!r} is not a pass: use a fxdebug.passes.Pass, a torch PassBase or a "
                    f"function gm -> gm.")


def _recompile_modified(step: Pass, result: PassResult) -> None:
    if result.modified:
        result.graph_module.recompile()


def run_passes(gm: fx.GraphModule, passes: Iterable,
               after_each: Callable[[Pass, PassResult], None] | None = None) -> PassResult:
    """Run ``passes`` in order on ``gm``: the one pass runner (``modified``: any pass changed it).

    After each pass the graph is linted and ``after_each(pass, result)`` runs
    (a recompile, a snapshot, an equivalence check). An exception raised there
    or by the pass goes on with one note, :func:`pass_failure_note`, unless it
    names its pass already (``exc.pass_name``). Recompiling is the caller's:
    once at the end, or in ``after_each``.

    >>> import torch, fxdebug
    >>> def explode(gm):
    ...     raise ValueError("cannot rewrite node '0'")
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> try:
    ...     run_passes(gm, [fxdebug.passes.Capture(), explode])
    ... except ValueError as error:
    ...     print(error.__notes__[0])  # doctest: +ELLIPSIS
    fxdebug: pass 'explode' failed at node '0' (after 'capture')...
    """
    ran: list[str] = []
    modified = False
    linted: fx.Graph | None = None  # the graph as the last lint saw it (unchanged since)
    for step in passes:
        step = as_pass(step)
        try:
            result = step.apply(gm)
            gm = result.graph_module
            if result.modified or gm.graph is not linted or not _exact_modified(step):
                gm.graph.lint()
                linted = gm.graph
            if after_each is not None:
                after_each(step, result)
        except Exception as exc:
            if getattr(exc, "pass_name", None) != step.name:
                exc.add_note(pass_failure_note(exc, step.name, gm, ran))
            raise
        ran.append(step.name)
        modified = modified or result.modified
    return PassResult(gm, modified)


def _exact_modified(step: Pass) -> bool:
    """Whether ``step``'s own class says its ``modified`` is exact (``exact_modified = True``
    in its class body: fxdebug's capture, grads and eager_regions passes; a subclass says it
    again or is linted), so a graph it reports unchanged is the graph linted before it."""
    cls = type(step)
    return (vars(cls).get("exact_modified") is True and cls.apply is Pass.apply
            and cls.call is Pass.call)


def pass_failure_note(exc: BaseException, pass_name: str, gm: fx.GraphModule,
                      earlier: Sequence[str] = ()) -> str:
    """The one note on an exception a pass raised: the pass, the node key and the user's
    file:line where known, the passes that ran before it.

    The node is the one the exception carries (``exc.node``, ``exc.key``) or, for
    an error that is not fxdebug's own, the first node of ``gm`` its message names.

    >>> import torch, fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> pass_failure_note(KeyError("no such node"), "drop-relu", gm)
    "fxdebug: pass 'drop-relu' failed (as the first pass)."
    """
    node = _failing_node(exc, gm)
    where = "" if node is None else f" at node {node_key(node)!r}"
    before = f"after {', '.join(map(repr, earlier))}" if earlier else "as the first pass"
    source = None if node is None else node.meta.get(META_SOURCE)
    line = "" if source is None else f"; the node comes from {format_location(source)}"
    return f"fxdebug: pass {pass_name!r} failed{where} ({before}){line}."


def _failing_node(exc: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The node ``exc`` carries, else the first node its message quotes (by key or name),
    else the first node it names bare (by name: a bare word that is a key may be prose)."""
    carried = getattr(exc, "node", None)
    if isinstance(carried, fx.Node):
        return carried
    by_key = {node_key(node): node for node in gm.graph.nodes}
    key = getattr(exc, "key", None)
    if isinstance(key, str):
        return by_key.get(key)
    if isinstance(exc, FxdebugError):  # says where itself; the keys it names may be hints
        return None
    by_name = {node.name: node for node in gm.graph.nodes if node.op != "output"}
    message = str(exc)
    for word in re.findall(r"""['"]([^'"\s]+)['"]""", message):
        found = by_key.get(word) or by_name.get(word)
        if found is not None:
            return found
    for word in re.findall(r"[A-Za-z_][\w.]*", message):
        if word in by_name:
            return by_name[word]
    return None
