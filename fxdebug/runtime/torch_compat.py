"""Every private torch name fxdebug uses, in one place, each with a public fallback.

fxdebug supports every torch release of the last year (``torch>=2.9``). A
private name (``torch._dynamo``, ``torch.fx.graph_module._forward_from_src``,
``grad_fn._saved_*``, ...) may change in any release, so the rest of the
package never touches one: it calls the functions below. Each says which
private name it reads, the torch versions it was checked on, and what it
does when that name is missing (a public way to the same result, or a
clear "needs torch X" error); ``tests/test_layout.py`` fails on a private
``torch._*`` name anywhere else in the package.

Compiled models (``torch.compile``)::

    compiled_inner(module)          OptimizedModule._orig_mod: the module torch.compile wraps
    lookup_backend(name)            torch._dynamo.lookup_backend: a backend name -> callable
    inductor_backend(mode)          torch._inductor.compile_fx with list_mode_options(mode)
    graph_break_reason(gm)          gm.compile_subgraph_reason: why dynamo ended a graph
    dynamo_frame_id(gm)             gm.meta["dynamo_compile_id"].frame_id

>>> torch_version() >= (2, 9)
True
"""

from __future__ import annotations

import sys
import traceback

import torch

__all__ = ["torch_version", "compiled_inner", "lookup_backend", "inductor_backend",
           "graph_break_reason", "dynamo_frame_id"]


def torch_version() -> tuple[int, int]:
    """``(major, minor)`` of the running torch (public ``torch.__version__``).

    >>> isinstance(torch_version()[1], int)
    True
    """
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def compiled_inner(module) -> torch.nn.Module | None:
    """The module ``torch.compile`` wrapped, if ``module`` is what it returned; else None.

    Private: ``torch._dynamo.eval_frame.OptimizedModule`` and its ``_orig_mod``
    (checked on torch 2.9.1 and 2.14.1; torch's own docs name ``_orig_mod``
    for state dicts). Fallback: a module whose class is named
    ``OptimizedModule`` and that holds a module in ``_orig_mod``. Never
    imports dynamo (a module compiled by torch.compile has loaded it).

    >>> compiled_inner(torch.nn.ReLU()) is None
    True
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    if wrapper is not None:
        if not isinstance(module, wrapper):
            return None
    elif type(module).__name__ != "OptimizedModule":
        return None
    inner = module.__dict__.get("_modules", {}).get("_orig_mod")
    return inner if isinstance(inner, torch.nn.Module) else None


def lookup_backend(name: str):
    """The dynamo backend callable ``(gm, example_inputs) -> callable`` registered as ``name``.

    Private: ``torch._dynamo.lookup_backend`` (checked on torch 2.9.1 and
    2.14.1; raises for an unknown name). Fallback: a backend that hands the
    graph to ``torch.compile(gm, backend=name)`` (public; dynamo traces the
    graph once more). Names: public ``torch.compiler.list_backends()``.

    >>> callable(lookup_backend("eager"))
    True
    """
    try:
        from torch._dynamo import lookup_backend as lookup
    except ImportError:  # pragma: no cover - a torch without it
        if name not in torch.compiler.list_backends(exclude_tags=()):
            raise ValueError(f"unknown dynamo backend {name!r}") from None

        def by_name(gm, example_inputs):
            return torch.compile(gm, backend=name)
        return by_name
    return lookup(name)


def inductor_backend(mode: str):
    """A dynamo backend: inductor with the options of ``torch.compile(..., mode=mode)``.

    Private: ``torch._inductor.list_mode_options`` and
    ``torch._inductor.compile_fx.compile_fx(gm, example_inputs,
    config_patches=...)`` (checked on torch 2.9.1 and 2.14.1). Fallback:
    ``torch.compile(gm, backend="inductor", mode=mode)`` on the graph (public;
    dynamo traces the graph once more).

    >>> callable(inductor_backend("max-autotune"))
    True
    """
    try:
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx
    except ImportError:  # pragma: no cover - a torch without them
        def by_mode(gm, example_inputs):
            return torch.compile(gm, backend="inductor", mode=mode)
        return by_mode
    options = list_mode_options(mode)

    def inductor_with_mode(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches=options)
    return inductor_with_mode


def graph_break_reason(gm) -> tuple[str, list[traceback.FrameSummary]] | None:
    """Why dynamo ended the graph ``gm`` at a graph break: ``(reason, user stack)``, else None.

    Private: the ``compile_subgraph_reason`` dynamo sets on each graph it
    hands a backend (a ``GraphCompileReason``: ``reason``, ``user_stack``,
    ``graph_break``), what ``torch._dynamo.explain`` reads (checked on torch
    2.9.1 and 2.14.1). Fallback: None (the graph is counted, its break
    reason is unknown).

    >>> graph_break_reason(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    True
    """
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is None or not getattr(reason, "graph_break", False):
        return None
    return str(getattr(reason, "reason", "")), list(getattr(reason, "user_stack", None) or ())


def dynamo_frame_id(gm) -> int | None:
    """The id of the Python frame dynamo captured ``gm`` from (None when unknown).

    Private: ``gm.meta["dynamo_compile_id"].frame_id`` (checked on torch 2.9.1
    and 2.14.1). Fallback: None (every graph counts as the start of a run).

    >>> dynamo_frame_id(torch.fx.symbolic_trace(torch.nn.ReLU())) is None
    True
    """
    compile_id = getattr(gm, "meta", {}).get("dynamo_compile_id")
    return getattr(compile_id, "frame_id", None)
