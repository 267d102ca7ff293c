"""Turn an exception raised under symbolic tracing into a TraceFailure that says what to do."""

from __future__ import annotations

import inspect
import linecache
import re

import torch

from ..errors import TraceFailure
from .locations import format_location, is_user_file, user_location_in_traceback

__all__ = ["explain_failure"]

# (pattern on "ExceptionType: message", kind, what to do about it)
_KINDS = (
    (r"symbolically traced variables cannot be used as inputs to control flow",
     "control flow on a traced value (an `if`, `while`, `assert` or `bool()` on a tensor)",
     "control"),
    (r"Proxy object cannot be iterated|object is not iterable|cannot unpack non-iterable Proxy",
     "iteration over a traced value (a for loop or unpacking of a tensor or its shape)",
     "control"),
    (r"cannot be interpreted as an integer|__index__|int\(\) argument must be|"
     r"must be real number, not Proxy|float\(\) argument must be|object cannot be converted to",
     "a traced value used as a Python number (int(), range(), an index or a shape)",
     "number"),
    (r"is not supported in symbolic tracing by default",
     "an untraceable builtin called on a traced value (such as len())",
     "builtin"),
    (r"is not installed as a submodule",
     "a module that is not registered as a submodule (created inside forward?)",
     "unregistered"),
)


def _classify(exc: BaseException) -> tuple[str, str]:
    text = f"{type(exc).__name__}: {exc}"
    for pattern, kind, code in _KINDS:
        if re.search(pattern, text):
            return kind, code
    return f"an operation that symbolic tracing does not support ({type(exc).__name__}: {exc})", "other"


def _failing_function(exc: BaseException) -> str | None:
    """Name of the user function holding the failing statement, unless it is a forward."""
    tb = exc.__traceback__
    name = None
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):
            name = tb.tb_frame.f_code.co_name
        tb = tb.tb_next
    if name in (None, "forward", "<module>", "<lambda>"):
        return None
    return name


def _root_branch_fix(model: torch.nn.Module) -> str:
    """Advice for a branch in the root forward: concrete_args only helps for flag arguments."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        parameters = []
    flags = [p.name for p in parameters if p.default is not inspect.Parameter.empty]
    advice = ("if the branch depends on tensor values, move it into a submodule (which "
              "auto_leaf then keeps as a leaf), use torch.where, or call it through a "
              "function wrapped with torch.fx.wrap")
    if flags:
        example = ", ".join(f"{name!r}: ..." for name in flags[:2])
        advice += (f"; if it depends on a flag argument, fix the flag with "
                   f"concrete_args={{{example}}}")
    else:
        advice += "; if it depends on a non-tensor argument, fix it with concrete_args={name: value}"
    return advice


def explain_failure(exc: BaseException, model: torch.nn.Module, scope: tuple[str, ...],
                    auto_leaves: tuple[tuple[str, str], ...]) -> TraceFailure:
    """Build the TraceFailure for ``exc`` raised while tracing ``model``.

    ``scope`` is the stack of module paths being traced when it was raised
    (empty: the root's own ``forward``).
    """
    module_path = scope[-1] if scope else ""
    try:
        module_type = type(model.get_submodule(module_path)).__name__
    except AttributeError:
        module_type = "?"
    where = user_location_in_traceback(exc.__traceback__)
    location = format_location(where) if where else None
    statement = linecache.getline(where[0], where[1]).strip() if where else ""
    kind, code = _classify(exc)
    function = _failing_function(exc)

    fixes = []
    if code == "unregistered":
        fixes.append("create the module in __init__ so it is a registered submodule")
    if module_path:
        fixes.append(f"make it a leaf: fxdebug.trace(model, leaf_modules=[{module_path!r}]) "
                     f"(it runs eagerly; its module calls and ops are still captured)")
    if function and code in ("control", "number", "builtin", "other"):
        fixes.append(f"or call torch.fx.wrap({function!r}) at the top level of the file that "
                     f"defines {function}() so it runs as one opaque node")
    if code == "builtin":
        match = re.search(r"'(\w+)' is not supported", str(exc))
        builtin = match.group(1) if match else "len"
        fixes.append(f"or call torch.fx.wrap({builtin!r}) at the top level of that file")
    if code in ("control", "number") and not module_path:
        fixes.append(_root_branch_fix(model))
    if code == "other" and not module_path:
        fixes.append("or rewrite the statement with tensor operations")
    fixes = [f[3:] if f.startswith("or ") else f for f in fixes]
    fix = "; or ".join(fixes) if fixes else "rewrite the statement with tensor operations"
    fix = fix[0].upper() + fix[1:] + "."

    who = f"module {module_path!r} ({module_type})" if module_path else f"the root module ({type(model).__name__})"
    at = f" at {location}" if location else ""
    code_text = f" `{statement}`" if statement else ""
    already = ""
    if auto_leaves:
        already = " Already traced as leaves: " + ", ".join(path for path, _ in auto_leaves) + "."
    message = (f"fxdebug could not trace {who}{at}{code_text}: {kind}. Fix: {fix}{already}")
    return TraceFailure(message, module_path=module_path, module_type=module_type,
                        location=location, kind=kind.split(" (")[0], fix=fix,
                        auto_leaves=auto_leaves)
