"""``trace()``: one entry point for the three front ends.

Call tree::

    trace(model, *inputs, frontend="fx")    a transaction: a failure puts the model back
      ├─ unwrap_compiled(model)                       torch.compile(m) given: m, one warning
      ├─ "fx":     fx_tracer.trace_fx(model)          symbolic tracing, auto-leaf
      ├─ "export": export.export_trace(model, *inputs)
      └─ "auto":   fx, else export, else partial.build_partial_model(model)
"""

from __future__ import annotations

import warnings
from typing import Iterable, Literal, overload

import torch
import torch.fx as fx

from .errors import EagerFallbackWarning, TraceFailure
from .base.torch_compat import compiled_inner
from .tracing.export import export_trace
from .tracing.pipelining import refuse_pipelining
from .tracing.unsupported import why_not_export
from .tracing.fx_tracer import trace_fx
from .tracing.graph_module import keyed_copy
from .tracing.keys import META_KEY
from .tracing.locations import caller_stacklevel
from .tracing.transaction import ModelSnapshot, model_transaction
from .partial.trace_parts import build_partial_model
from .partial.report import is_partial

__all__ = ["trace", "trace_in_transaction", "keyed_module", "unwrap_compiled"]

_FRONTENDS = ("fx", "export", "auto")


@overload
def trace(model: torch.nn.Module, *inputs: object, leaf_modules: Iterable = (),
          concrete_args: dict | None = None, auto_leaf: bool = True,
          frontend: Literal["fx", "export"] = "fx") -> fx.GraphModule: ...


@overload
def trace(model: torch.nn.Module, *inputs: object, leaf_modules: Iterable = (),
          concrete_args: dict | None = None, auto_leaf: bool = True,
          frontend: str = "auto") -> torch.nn.Module: ...


def trace(model: torch.nn.Module, *inputs: object, leaf_modules: Iterable = (),
          concrete_args: dict | None = None, auto_leaf: bool = True,
          frontend: str = "fx") -> torch.nn.Module:
    """Trace ``model`` into a GraphModule with stable keys and source lines.

    Args:
        model: the module to trace; it is not modified and shares its
            parameters with the result.
        inputs: positional inputs; needed by ``frontend="export"``
            (and by ``"auto"`` to try export).
        leaf_modules: module paths (``"layer1.0"``) or classes to keep as
            single ``call_module`` nodes instead of tracing through them.
        concrete_args: forwarded to ``torch.fx.Tracer.trace`` to fix
            arguments that control flow depends on.
        auto_leaf: when tracing fails inside a submodule, retry with that
            submodule as a leaf. The modules this turned into leaves are
            listed in a warning and in ``gm.meta["fxdebug_auto_leaves"]``.
        frontend: ``"fx"`` (symbolic tracing), ``"export"`` (``torch.export``
            on the example inputs; keys still module paths, see
            :mod:`fxdebug.tracing.export`) or ``"auto"``: fx, else export,
            else the model split into traced parts and eager glue (see
            :mod:`fxdebug.partial`). ``gm.meta["fxdebug_frontend"]`` says which
            was used and ``gm.meta["fxdebug_frontend_notes"]`` why the others
            were not (a partially traced model has them in
            ``model.fxdebug_partial``).

    Returns:
        With ``frontend="fx"`` or ``"export"``: a ``torch.fx.GraphModule``; every
        node has ``node.meta["fxdebug_key"]`` and ``node.meta["fxdebug_source"]``
        (user ``(filename, lineno)``). With ``frontend="auto"``: that, or, when
        neither fx nor export works, the partially traced model (an
        ``nn.Module`` that is not a GraphModule, see
        :func:`fxdebug.partial.is_partial`; pass it to ``instrument``). The
        annotation says so: ``GraphModule`` for fx and export, ``nn.Module``
        for ``"auto"``.

        A module returned by ``torch.compile`` is traced through: the module
        it compiles is traced, and the result runs eagerly (one
        :class:`~fxdebug.errors.EagerFallbackWarning` says so).

    Raises:
        TraceFailure: naming the module, the user's ``file:line``, the kind of
            failure and the fix.

    Example::

        >>> import torch, torchvision, fxdebug
        >>> gm = fxdebug.trace(torchvision.models.resnet18())
        >>> [n.meta["fxdebug_key"] for n in gm.graph.nodes][5:9]
        ['layer1.0.conv1', 'layer1.0.bn1', 'layer1.0.relu', 'layer1.0.conv2']
    """
    refuse_pipelining(model, "fxdebug.trace")
    with model_transaction(model, "fxdebug.trace") as snapshot:  # a failure: the model put back
        return trace_in_transaction(model, snapshot, inputs, leaf_modules, concrete_args,
                                    auto_leaf, frontend)


@overload
def trace_in_transaction(model: torch.nn.Module, snapshot: ModelSnapshot | None,
                         inputs: tuple = (), leaf_modules: Iterable = (),
                         concrete_args: dict | None = None, auto_leaf: bool = True,
                         frontend: Literal["fx", "export"] = "fx") -> fx.GraphModule: ...


@overload
def trace_in_transaction(model: torch.nn.Module, snapshot: ModelSnapshot | None,
                         inputs: tuple = (), leaf_modules: Iterable = (),
                         concrete_args: dict | None = None, auto_leaf: bool = True,
                         frontend: str = "auto") -> torch.nn.Module: ...


def trace_in_transaction(model: torch.nn.Module, snapshot: ModelSnapshot | None,
                         inputs: tuple = (), leaf_modules: Iterable = (),
                         concrete_args: dict | None = None, auto_leaf: bool = True,
                         frontend: str = "fx") -> torch.nn.Module:
    """:func:`trace` inside an open :func:`~fxdebug.tracing.transaction.model_transaction`.

    ``snapshot``: the transaction's, taken with nothing run on ``model`` since
    (or None): the fx front end puts the model back to it after tracing rather
    than taking a snapshot of its own (on a model of 400 modules a snapshot
    costs some 10 ms, a quarter of a trace).

    >>> import torch
    >>> from fxdebug.tracing.transaction import model_transaction
    >>> net = torch.nn.Sequential(torch.nn.ReLU())
    >>> with model_transaction(net, "an example") as snapshot:
    ...     gm = trace_in_transaction(net, snapshot)
    >>> [n.meta["fxdebug_key"] for n in gm.graph.nodes]
    ['input', '0', 'output']
    """
    inner = unwrap_compiled(model, "fxdebug.trace")
    if inner is not model:
        model, snapshot = inner, None  # the snapshot is the wrapper's
    if is_partial(model):
        raise TraceFailure(
            f"fxdebug cannot trace {type(model).__name__} as one graph: it is the part-by-part "
            f"model fxdebug made because the root cannot be traced. Fix: work on its traced "
            f"parts, fxdebug.traced_parts(model) (their inputs: fxdebug.part_inputs(model, "
            f"*inputs)), or pass the original model with frontend='export'.",
            module_path="", module_type=type(model).__name__, location=None,
            kind="a partially traced model", fix="use fxdebug.traced_parts(model)")
    if frontend not in _FRONTENDS:
        raise ValueError(f"frontend={frontend!r}: use 'fx' (symbolic tracing), 'export' "
                         f"(torch.export on example inputs) or 'auto' (fx, then export, then "
                         f"the traceable parts).")
    if frontend == "export":
        return export_trace(model, *inputs)
    if frontend == "auto":
        return _trace_auto(model, inputs, leaf_modules, concrete_args, auto_leaf, snapshot)
    return trace_fx(model, leaf_modules, concrete_args, auto_leaf, snapshot=snapshot)


def unwrap_compiled(model: torch.nn.Module, caller: str) -> torch.nn.Module:
    """The module inside ``torch.compile(module)`` (with one warning line), else ``model``.

    fx cannot trace the wrapper torch.compile returns, and a graph fxdebug
    rewrites is not the graph dynamo compiled: fxdebug works on the module
    inside, whose result runs eagerly until it is compiled again.

    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     inner = unwrap_compiled(torch.compile(torch.nn.ReLU()), "fxdebug.trace")
    >>> inner, caught[0].category.__name__
    (ReLU(), 'EagerFallbackWarning')
    """
    inner = compiled_inner(model)
    if inner is None:
        return model
    then = (f"compile the result again (torch.compile({caller}(model)) records what the "
            f"compiled code computes), or record compiled graphs with torch.compile(model, "
            f"backend=fxdebug.backend(inner=...))" if caller == "fxdebug.instrument" else
            "compile the result again if it must run compiled; fxdebug.backend(inner=...) "
            "records what compiled graphs compute")
    warnings.warn(f"{caller} got a torch.compile'd module: it works on the module inside "
                  f"({type(inner).__name__}, OptimizedModule._orig_mod) and returns an eager "
                  f"module; {then}.", EagerFallbackWarning, stacklevel=caller_stacklevel())
    return inner


def _trace_auto(model, inputs, leaf_modules, concrete_args, auto_leaf, snapshot):
    """fx, else export, else partial; the result says which and why."""
    notes: list[str] = []
    try:
        gm = trace_fx(model, leaf_modules, concrete_args, auto_leaf, snapshot=snapshot)
    except TraceFailure as failure:
        fx_failure = failure
        notes.append(f"fx: {' '.join(str(failure).split())}")
    else:
        gm.meta["fxdebug_frontend_notes"] = notes
        return gm
    sharded = why_not_export(model)
    if sharded:
        notes.append(f"export: {sharded}")
    elif inputs:
        try:
            gm = export_trace(model, *inputs)
        except TraceFailure as failure:
            notes.append(f"export: {' '.join(str(failure).split())}")
        else:
            gm.meta["fxdebug_frontend_notes"] = notes
            warnings.warn(f"fxdebug.trace(frontend='auto') used torch.export for "
                          f"{type(model).__name__}: symbolic tracing failed ({fx_failure.kind} at "
                          f"{fx_failure.location}).", EagerFallbackWarning,
                          stacklevel=caller_stacklevel())
            return gm
    else:
        notes.append("export: not tried, no example inputs (pass them: "
                     "fxdebug.trace(model, *inputs, frontend='auto'))")
    if next(model.children(), None) is None:
        raise fx_failure  # no submodules, no parts
    return build_partial_model(model, fx_failure, leaf_modules, notes[1:])  # it notes fx_failure itself


def keyed_module(model: torch.nn.Module) -> fx.GraphModule:
    """``model`` as a keyed GraphModule to run and read, never an edited user graph.

    A GraphModule whose nodes all have keys comes back as it is (callers only
    read it); another GraphModule as a keyed copy sharing its parameters; any
    other module traced with :func:`trace`.

    >>> import torch
    >>> plain = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    >>> keyed = keyed_module(plain)
    >>> keyed is plain, "fxdebug_key" in next(iter(plain.graph.nodes)).meta
    (False, False)
    """
    if isinstance(model, fx.GraphModule):
        if all(META_KEY in node.meta for node in model.graph.nodes):
            return model
        return keyed_copy(model)
    return trace(model)

