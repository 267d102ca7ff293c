"""``torch.compile``'s internals: the module it wraps, dynamo's backends by name, inductor
with a mode's options, and why and where dynamo broke a graph.

Importing this module loads neither dynamo nor inductor; a function loads them when
called (``compiled_inner`` never does).
"""

from __future__ import annotations

import sys
import threading
import traceback
import warnings
from typing import Any

import torch

from ..torch_version import torch_version

__all__ = ["compiled_backend", "compiled_inner", "compiled_in_place", "dynamo_frame_id",
           "dynamo_traces_class_descriptors", "compile_like", "graph_break_reason", "inductor_backend", "inside_compiled_module",
           "load_inductor", "lookup_backend", "run_eagerly_from_compiled_code", "skip_frame"]

_inductor_lock = threading.Lock()


def dynamo_traces_class_descriptors() -> bool:
    """Whether dynamo traces a module whose class carries an attribute it does not know (a
    descriptor that finds a child module, say).

    torch 2.14 does; before it dynamo refuses one (torch.export's strict mode on 2.9.1:
    "Unsupported nn.Module attribute type"), and such a class must leave its children to
    ``nn.Module.__getattr__``. Decided by the torch version: no private name is read.

    >>> dynamo_traces_class_descriptors() == (torch_version() >= (2, 14))
    True
    """
    return torch_version() >= (2, 14)


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


def compiled_backend(module) -> tuple[object, str] | None:
    """``(backend, name)`` that ``torch.compile`` gave the module it returned, else None.

    ``backend`` is the callable dynamo hands each graph (for inductor, one that
    carries the mode and options the user passed), ``name`` its name
    (``"inductor"``, ``"aot_eager"``, or a function's ``__name__``).

    Private: ``OptimizedModule.dynamo_ctx.callback`` and the chain of
    ``_torchdynamo_orig_backend`` down to the backend (what
    ``torch._dynamo.eval_frame.innermost_backend`` walks; older releases name
    the link ``_torchdynamo_orig_callable``), ``compiler_name`` on torch's
    own backend wrappers. Checked on torch 2.14.1; not run on 2.9.1, whose
    release may name a link differently (then a wrapper of dynamo's own comes
    back, which compiles as the backend it wraps does). Fallback:
    None (the caller uses ``torch.compile``'s default, ``"inductor"``, and says so).

    >>> compiled_backend(torch.nn.ReLU()) is None
    True
    """
    if compiled_inner(module) is None:
        return None
    backend = getattr(getattr(module, "dynamo_ctx", None), "callback", None)
    name = None
    for _ in range(32):  # a chain of wrappers, never a cycle; bounded all the same
        name = name or getattr(backend, "compiler_name", None)
        inner = getattr(backend, "_torchdynamo_orig_backend", None) or getattr(
            backend, "_torchdynamo_orig_callable", None)
        if inner is None:
            break
        backend = inner
    if not callable(backend):
        return None
    name = name or getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None)
    return backend, str(name or type(backend).__name__)


def load_inductor() -> None:
    """Import inductor's compiler once, without the warnings torch raises about its own code.

    Private: ``torch._inductor.compile_fx``, what ``torch.compile``'s inductor
    backend imports on its first compile (checked on torch 2.9.1, 2.11.0 and
    2.14.1). On torch 2.11 that import raises 14 DeprecationWarnings
    (``torch/utils/mkldnn.py`` uses its own deprecated ``torch.jit.script_method``;
    none on 2.9.1 or 2.14.1): fxdebug's stats kernel would show them to a user who
    never asked for inductor, or fail under ``-W error``. So DeprecationWarnings
    raised inside torch's modules are ignored during this import; any other
    warning shows as usual. Fallback: nothing to do where the module is missing
    (``torch.compile`` then fails on its own terms).

    >>> load_inductor()
    >>> "torch._inductor.compile_fx" in sys.modules
    True
    """
    if "torch._inductor.compile_fx" in sys.modules:
        return
    with _inductor_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        try:
            import torch._inductor.compile_fx  # noqa: F401
        except ImportError:  # pragma: no cover - a torch without it
            pass


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
    if name == "inductor":
        load_inductor()
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
    load_inductor()
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


def run_eagerly_from_compiled_code(function):
    """Have dynamo run ``function`` eagerly, with every function it calls, where compiled code
    calls it (after a graph break): no graph of its own, no guards on its arguments, so no
    compile per new argument shape; returns ``function``. A plain call is untouched (no
    wrapper), and dynamo still inlines ``function`` while it traces its caller.

    Private: ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` with
    ``_FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)`` on the function's code, what
    ``torch._dynamo.eval_frame.skip_code`` does for one frame (checked on torch 2.9.1 and
    2.14.1; it loads no dynamo). Fallback: nothing is set, and dynamo compiles the frame as any
    other (the same result, compiled anew for each new guard).

    >>> def hooks(value): return value
    >>> run_eagerly_from_compiled_code(hooks) is hooks
    True
    """
    return _skip_own_frame(function, "SKIP")


def compiled_in_place(module) -> bool:
    """Whether ``module.compile()`` compiled ``module`` in place (its calls run under dynamo).

    Private: ``nn.Module._compiled_call_impl``, which ``nn.Module.compile`` sets (checked on
    torch 2.9.1 and 2.14.1). Fallback: False.

    >>> compiled_in_place(torch.nn.ReLU())
    False
    """
    return module.__dict__.get("_compiled_call_impl") is not None


def inside_compiled_module() -> bool:
    """Whether the calling code runs inside a call that ``torch.compile`` compiles (a module or
    function it returned, ``module.compile()``): dynamo's frame callback is set.

    Private: ``torch._C._dynamo.eval_frame.get_eval_frame_callback`` (checked on torch 2.9.1
    and 2.14.1: inside a compiled call, in a frame dynamo skips, it is dynamo's callback; None
    or False elsewhere). Fallback: False.

    >>> inside_compiled_module()
    False
    """
    try:
        from torch._C._dynamo.eval_frame import get_eval_frame_callback
    except ImportError:  # pragma: no cover - a torch without it
        return False
    return get_eval_frame_callback() not in (None, False)


def skip_frame(function):
    """Have dynamo run ``function``'s own frame eagerly but compile the frames it calls, as
    ``torch.compiler.disable(recursive=False)`` does, without loading dynamo: a forward wrapper
    that chooses between compiled graphs without being one; returns ``function``. A plain call
    is untouched.

    Private: ``torch._C._dynamo.eval_frame.set_code_exec_strategy`` with
    ``_FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT)`` on the function's code
    (checked on torch 2.9.1 and 2.14.1). Fallback: nothing is set (dynamo traces the wrapper
    too).

    >>> def wrapper(x): return x + 1
    >>> skip_frame(wrapper) is wrapper
    True
    """
    return _skip_own_frame(function, "DEFAULT")


def _skip_own_frame(function, callees: str):
    """``function``'s own frame run eagerly under dynamo, the frames it calls as ``callees``
    (``"SKIP"``: eagerly too; ``"DEFAULT"``: compiled): ``set_code_exec_strategy`` on its
    code (2.9.1, 2.14.1); nothing set on a torch without it. Returns ``function``."""
    try:
        from torch._C._dynamo.eval_frame import (_FrameAction, _FrameExecStrategy,
                                                 set_code_exec_strategy)
    except ImportError:  # pragma: no cover - a torch without them
        return function
    set_code_exec_strategy(function.__code__, _FrameExecStrategy(
        _FrameAction.SKIP, getattr(_FrameAction, callees)))
    return function


def compile_like(compiled, module: torch.nn.Module) -> Any:
    """``module`` compiled as ``compiled`` (a module ``torch.compile`` returned) is: the same
    backend, mode, options, ``fullgraph`` and ``dynamic``.

    Private: ``OptimizedModule(module, compiled.dynamo_ctx)``, how ``torch.compile`` makes its
    module (checked on torch 2.9.1 and 2.14.1). Fallback: ``torch.compile(module,
    backend=...)`` with the backend :func:`compiled_backend` finds (inductor where it finds none).

    >>> net = torch.compile(torch.nn.ReLU(), backend="eager")
    >>> compile_like(net, torch.nn.Tanh())(torch.zeros(1))
    tensor([0.])
    """
    context = getattr(compiled, "dynamo_ctx", None)
    if context is not None:
        try:
            return type(compiled)(module, context)
        except TypeError:  # a release whose wrapper takes other arguments
            pass
    found = compiled_backend(compiled)
    backend: Any = found[0] if found is not None else "inductor"
    return torch.compile(module, backend=backend)
