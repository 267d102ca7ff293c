"""Run ``torch.compile(model)`` for fxdebug and leave the user's dynamo caches as they were.

Call tree::

    watched_run(model, runs, backend)       one compiled run; the graphs it ran, in order
      ├─ entry_point()                       a function whose code object is fxdebug's own
      │                                      (it calls model(*args)): dynamo's cache entries
      │                                      for the top frame go there, and die with it
      ├─ watching(backend)                   one WatchingBackend per backend for the process:
      │    └─ compile: inner(gm, inputs)     the backend under test compiles the graph; the
      │                                      reason dynamo ended it is noted (graph breaks)
      └─ Session                             each compiled graph, when it runs, notes itself
                                             (and, for keeping(), a copy of its inputs)
    keeping()                                the backend that keeps each graph, keyed, and
                                             runs it eagerly (check_compiled's localization)

fxdebug never calls ``torch._dynamo.reset()``: a function the user compiled
before stays compiled. Dynamo keys its cache entries by the code object of a
frame and guards each by the backend that compiled it (torch 2.9.1 and
2.14.1: a cache entry compiled by another backend is never reused), so:

* the frame dynamo starts at is fxdebug's own function, made anew for every
  run: its entries go when the run ends;
* a frame inside the model that dynamo compiles on its own (after a graph
  break) gets an entry for fxdebug's backend next to the user's, which stay
  valid. fxdebug uses one backend object per backend name or function for the
  whole process, so the next check reuses that entry instead of adding one
  (a code object holds at most ``torch._dynamo.config.recompile_limit``
  entries, 8 by default). Those entries live as long as the model.

The graphs a run executed are noted when they run, not when they compile, so
a check that reuses compiled frames reports them all the same.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import traceback
import types
from typing import Any, Callable

import torch
import torch.fx as fx

from ..runtime import clone_inputs
from ..base.torch_compat import graph_break_reason
from ..equivalence.controlled_run import ControlledRuns
from .dynamo_graphs import key_dynamo_graph

__all__ = ["GraphRun", "WatchingBackend", "watching", "keeping", "entry_point", "watched_run"]


@dataclasses.dataclass(eq=False)
class GraphRun:
    """A graph dynamo compiled: why it ended (``reason``, None when not at a graph break),
    its keyed GraphModule (keeping() only) and the inputs of its first call in a run."""

    reason: tuple[str, list[traceback.FrameSummary]] | None
    gm: fx.GraphModule | None = None
    inputs: tuple | None = None


class _Session:
    def __init__(self, keep_inputs: bool) -> None:
        self.keep_inputs = keep_inputs
        self.ran: dict[int, GraphRun] = {}  # by id of the compiled graph, in order of first run

    def note(self, graph: GraphRun, args) -> None:
        if id(graph) not in self.ran:
            inputs = clone_inputs(tuple(args)) if self.keep_inputs else None
            self.ran[id(graph)] = dataclasses.replace(graph, inputs=inputs)


_ACTIVE = threading.local()


class WatchingBackend:
    """A dynamo backend: ``inner`` compiles each graph; each compiled graph notes when it runs.

    ``inner`` None keeps the graph (keyed, :func:`key_dynamo_graph`) and runs it eagerly.
    Use one per backend for the process (:func:`watching`): dynamo guards its
    cache entries by the backend object.

    >>> be = WatchingBackend(None)
    >>> torch.compile(lambda x: x + 1, backend=be)(torch.ones(1)).tolist()
    [2.0]
    """

    def __init__(self, inner: Callable | None) -> None:
        self.inner = inner

    def __call__(self, gm: fx.GraphModule, example_inputs):
        graph = GraphRun(graph_break_reason(gm))
        if self.inner is None:
            graph.gm = key_dynamo_graph(gm)
            compiled = gm.forward
        else:
            compiled = self.inner(gm, example_inputs)

        def run(*args):
            session = getattr(_ACTIVE, "session", None)
            if session is not None:
                session.note(graph, args)
            return compiled(*args)
        return run


_LOCK = threading.Lock()
_BACKENDS: dict[Any, tuple[Any, WatchingBackend]] = {}


def watching(key, inner: Callable | None) -> WatchingBackend:
    """The process's one WatchingBackend for ``key`` (a backend name and mode, or the function).

    >>> first = watching(("an example", None), lambda gm, example_inputs: gm.forward)
    >>> watching(("an example", None), print) is first   # the first one made for the key
    True
    """
    with _LOCK:
        found = _BACKENDS.get(_hashable(key))
        if found is None:
            found = (key, WatchingBackend(inner))  # the key kept alive: its ids are never reused
            _BACKENDS[_hashable(key)] = found
        return found[1]


def _hashable(key):
    if inspect.ismethod(key):  # obj.method is a new object at every access: key its parts
        return ("method", id(key.__self__), id(key.__func__))
    return ("id", id(key)) if callable(key) else key


def keeping() -> WatchingBackend:
    """The backend that keeps each graph, keyed, and runs it as dynamo captured it.

    >>> keeping() is keeping(), keeping().inner is None
    (True, True)
    """
    return watching(("fxdebug-keep", None), None)


def _call_model(fn, *args):
    return fn(*args)


def entry_point() -> Callable:
    """``fn(model, *args) -> model(*args)``, a function with a code object of its own.

    The model is an argument, as in ``torch.compile(model)``: dynamo names the
    graph's lifted parameters the same way (``l_fn_modules_0_parameters_weight_``).

    >>> f = entry_point()
    >>> f(torch.nn.Identity(), 3), f.__code__ is entry_point().__code__
    (3, False)
    """
    code = _call_model.__code__.replace(co_name="fxdebug_compiled_run")
    return types.FunctionType(code, _call_model.__globals__, "fxdebug_compiled_run")


def watched_run(model: torch.nn.Module, runs: ControlledRuns, backend: WatchingBackend,
                grad: bool = False, keep_inputs: bool = False) -> tuple[Any, list[GraphRun]]:
    """``torch.compile(model, backend=backend)`` run once by ``runs``: its outputs and the graphs
    it ran, in the order they first ran (with ``keep_inputs``, the inputs of that first call).

    >>> from fxdebug.equivalence.controlled_run import ControlledRuns
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    >>> with ControlledRuns([model], (torch.ones(1, 2),), train=None) as runs:
    ...     out, graphs = watched_run(model, runs, keeping(), keep_inputs=True)
    >>> keys = [node.meta["fxdebug_key"] for node in graphs[0].gm.graph.nodes]
    >>> len(graphs), graphs[0].reason, keys[-3:]
    (1, None, ['0', '1', 'output'])
    """
    session = _Session(keep_inputs)
    outer = getattr(_ACTIVE, "session", None)
    _ACTIVE.session = session
    try:
        compiled = torch.compile(entry_point(), backend=backend)
        out = runs.run(functools.partial(compiled, model), grad=grad)
    finally:
        _ACTIVE.session = outer
    return out, list(session.ran.values())
