"""Turn an exception raised under symbolic tracing into a TraceFailure that says what to do."""

from __future__ import annotations

import inspect
import linecache
import re

import torch
import torch.fx as fx

from ..errors import TraceFailure
from .locations import is_user_file, user_location_in_traceback
from ..base.formatting import format_location

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
    (r"fxdebug: torch.inference_mode\(\) inside forward",
     "torch.inference_mode() inside forward, which a torch.fx graph cannot hold",
     "context"),
    (r"fxdebug: the custom autograd Function",
     "a custom torch.autograd.Function called on a traced value (a torch.fx graph would keep "
     "its forward and drop its backward)",
     "context"),
    (r"fxdebug: forward stores a traced value on the module",
     "a traced value stored on the module in forward (torch.fx would leave a Proxy there)",
     "attribute"),
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


def _flag_arguments(model: torch.nn.Module) -> dict[str, object]:
    """Arguments of the root forward that have a non-tensor default: flags, not inputs."""
    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return {}
    return {p.name: p.default for p in parameters
            if p.default is not inspect.Parameter.empty and p.default is not None
            and not isinstance(p.default, torch.Tensor)}


def _condition_arguments(condition: fx.Node) -> tuple[list[str], bool]:
    """(placeholders ``condition`` depends on, whether a tensor operation lies on the way).

    Only Python operators (``not``, ``==``, ``and``...) count as not touching a tensor.
    """
    names, tensor_op, stack, seen = [], False, [condition], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            names.append(str(node.target).lstrip("*"))
            continue
        if node.op != "call_function" or getattr(node.target, "__module__", None) not in (
                "_operator", "operator", "builtins"):
            tensor_op = True
        stack.extend(node.all_input_nodes)
    return sorted(names), tensor_op


def _tensor_branch_fix(model: torch.nn.Module) -> str:
    advice = ("the statement depends on tensor values, which one graph cannot follow: move it "
              "into a submodule (auto_leaf then runs that submodule as a leaf, eagerly) or into a "
              "function wrapped with torch.fx.wrap, or replace the branch with torch.where")
    if next(model.children(), None) is not None:
        advice += ("; or call fxdebug.instrument(model) as it is: it runs the root forward "
                   "eagerly and instruments its submodules (partial instrumentation)")
    return advice


def _root_branch_fix(model: torch.nn.Module, condition: fx.Node | None) -> str:
    """Advice for a failure in the root forward; concrete_args only for flag arguments.

    ``concrete_args`` fixes an argument to one value: right for a flag, wrong for a
    tensor (the model would return the same output for every input).
    """
    flags = _flag_arguments(model)
    if condition is not None:
        names, tensor_op = _condition_arguments(condition)
        if names and not tensor_op and all(name in flags for name in names):
            example = ", ".join(f"{name!r}: {flags[name]!r}" for name in names)
            return (f"the branch depends only on the flag argument(s) {', '.join(names)}: fix "
                    f"them with fxdebug.trace(model, concrete_args={{{example}}}) (one graph "
                    f"per value)")
        return _tensor_branch_fix(model)
    advice = _tensor_branch_fix(model)
    if flags:
        example = ", ".join(f"{name!r}: {value!r}" for name, value in list(flags.items())[:2])
        advice += (f"; if it uses a flag argument rather than a tensor, fix the flag with "
                   f"concrete_args={{{example}}}")
    return advice


def _eager_fix(model: torch.nn.Module, code: str) -> str:
    advice = "move the statement into a submodule (auto_leaf then runs that submodule eagerly)"
    if code == "attribute":
        advice += ", or return the value instead of storing it on self"
    if next(model.children(), None) is not None:
        advice += ("; or call fxdebug.instrument(model) as it is: it runs the root forward "
                   "eagerly and instruments its submodules")
    return advice


def _not_in_the_model_fix(model: torch.nn.Module) -> str:
    """The fix where torch.fx failed in no line of the model (its own machinery refused the
    forward, e.g. a decorated forward whose code object it cannot rebuild)."""
    advice = ("the failure is inside torch.fx, not in a line of the model: trace it with "
              "torch.export instead, fxdebug.trace(model, *inputs, frontend='export')")
    if next(model.children(), None) is not None:
        advice += ("; or call fxdebug.instrument(model) as it is: it runs the root forward "
                   "eagerly and instruments its submodules")
    return advice


def explain_failure(exc: BaseException, model: torch.nn.Module, scope: tuple[str, ...],
                    auto_leaves: tuple[tuple[str, str], ...],
                    condition: fx.Node | None = None) -> TraceFailure:
    """Build the TraceFailure for ``exc`` raised while tracing ``model``.

    ``scope`` is the stack of module paths being traced when it was raised
    (empty: the root's own ``forward``); ``condition`` the traced value a failed
    ``if``/``for`` was on, when known.
    """
    module_path = scope[-1] if scope else ""
    try:
        module_type = type(model.get_submodule(module_path)).__name__
    except AttributeError:
        module_type = "?"
    where = (getattr(exc, "fxdebug_location", None)  # set where no traceback names the line
             or user_location_in_traceback(exc.__traceback__))
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
        fixes.append(_root_branch_fix(model, condition if code == "control" else None))
    if code in ("context", "attribute") and not module_path:
        fixes.append(_eager_fix(model, code))
    if code == "other" and not module_path:
        fixes.append("or rewrite the statement with tensor operations" if statement else
                     _not_in_the_model_fix(model))
    fixes = [f[3:] if f.startswith("or ") else f for f in fixes]
    fix = "; or ".join(fixes) if fixes else (
        "rewrite the statement with tensor operations" if statement else
        _not_in_the_model_fix(model))
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
