"""Pass and PassResult: the unit of graph rewriting.

A pass takes a GraphModule, rewrites its graph in place, and says whether it
changed anything. Plain functions ``gm -> gm`` (or ``gm -> None``) are passes
too, through :func:`as_pass`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch.fx as fx

__all__ = ["Pass", "PassResult", "as_pass", "FunctionPass"]


class PassResult(NamedTuple):
    """What a pass returns: the (possibly new) GraphModule and whether it changed."""

    graph_module: fx.GraphModule
    modified: bool


class Pass:
    """Base class: set ``name`` and implement ``run(gm) -> bool`` (modified).

    Calling the pass runs it, lints the graph and recompiles the module::

        >>> import torch, fxdebug
        >>> class DropNothing(fxdebug.passes.Pass):
        ...     name = "drop-nothing"
        ...     def run(self, gm):
        ...         return False
        >>> gm = fxdebug.trace(torch.nn.ReLU())
        >>> DropNothing()(gm).modified
        False
    """

    name: str = "pass"

    def run(self, gm: fx.GraphModule) -> bool:
        raise NotImplementedError(f"{type(self).__name__} must implement run(gm) -> bool")

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        modified = self.run(gm)
        if not isinstance(modified, bool):
            raise TypeError(f"pass {self.name!r} ({type(self).__name__}.run) returned "
                            f"{modified!r}; it must return True or False (graph modified).")
        if modified:
            gm.graph.lint()
            gm.recompile()
        return PassResult(gm, modified)

    def __repr__(self) -> str:
        return f"<Pass {self.name}>"


class FunctionPass(Pass):
    """Wraps a function ``gm -> gm | None | PassResult`` as a Pass named after it."""

    def __init__(self, fn: Callable, name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        before = gm.code
        result = self.fn(gm)
        if isinstance(result, PassResult):
            out = result.graph_module
        elif result is None:
            out = gm
        elif isinstance(result, fx.GraphModule):
            out = result
        else:
            raise TypeError(f"pass {self.name!r} returned {type(result).__name__}; a pass "
                            f"function must return a GraphModule, None or a PassResult.")
        out.graph.lint()
        out.recompile()
        return PassResult(out, out is not gm or out.code != before)


def as_pass(obj) -> Pass:
    """Return ``obj`` as a Pass: Pass instances as they are, callables wrapped.

    >>> as_pass(lambda gm: gm).name
    '<lambda>'
    """
    if isinstance(obj, Pass):
        return obj
    if isinstance(obj, type) and issubclass(obj, Pass):
        raise TypeError(f"got the class {obj.__name__}; pass an instance: {obj.__name__}(...)")
    if callable(obj):
        return FunctionPass(obj)
    raise TypeError(f"{obj!r} is not a pass: use a fxdebug.passes.Pass or a function gm -> gm.")
