"""What one node does to storage: which inputs its output may share, which one it writes.

The rules every storage question in fxdebug asks (captures that must copy,
functionalization, in-place lowering, lint): torch.nn's own modules and
torch's functions by name, everything else (a leaf module, a module with
hooks, a ``torch.fx.wrap``'d function) assumed to return a view of its
inputs and to write to them, since fx never saw its body. fxdebug's own
nodes (captures, gradient hooks, ``begin_run``) only read.
:class:`fxdebug.passes.aliasing.AliasAnalysis` joins them over a graph.
"""

from __future__ import annotations

import functools
import inspect
import operator

import torch
import torch.fx as fx

from .. import runtime
from ..base import torch_compat
from ..runtime.inplace_ops import INPLACE_OPERATORS
from .keys import short_name

__all__ = ["is_torch_callable", "is_plain_torch_module", "signature_of", "is_fxdebug_read",
           "module_of", "Submodules", "opaque_writes", "inplace_requested", "mutated_argument",
           "alias_inputs"]

# Functions fxdebug's inserted nodes call that only read their arguments.
_FXDEBUG_READS = (runtime.begin_run, runtime.capture, runtime.capture_stats,
                  runtime.record_grads, runtime.edit_grads, runtime.stop, runtime.begin_part)

# Ops that return a view of (or the very same tensor as) their first argument.
_VIEW_NAMES = frozenset("""
getitem view view_as reshape reshape_as flatten unflatten squeeze unsqueeze transpose t T
permute expand expand_as narrow select split split_with_sizes tensor_split chunk unbind
movedim moveaxis as_strided contiguous detach alias real imag diagonal unfold swapaxes
swapdims view_as_real view_as_complex hsplit vsplit dsplit to type type_as float double half
bfloat16 int long bool cpu cuda requires_grad_ dropout alpha_dropout feature_alpha_dropout
dropout1d dropout2d dropout3d broadcast_to atleast_1d atleast_2d atleast_3d data mT mH H
getattr identity
""".split())

# torch.nn module types that return a view of their input (or the input itself).
_ALIASING_MODULES = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten,
                     *torch_compat.DROPOUT_TYPES)


def is_torch_callable(target) -> bool:
    """Whether ``target`` is torch's or Python's own (its body does what torch says).

    >>> import operator
    >>> is_torch_callable(torch.relu), is_torch_callable(operator.add), is_torch_callable(print), is_torch_callable(len)
    (True, True, True, True)
    >>> is_torch_callable(lambda x: x)
    False
    """
    module = getattr(target, "__module__", None) or ""
    return module in ("_operator", "operator", "builtins") or module == "torch" or module.startswith("torch.")


def is_plain_torch_module(module) -> bool:
    """A module of torch.nn's own code, without hooks (its call does what torch's code says).

    >>> class Mine(torch.nn.Linear):
    ...     pass
    >>> lin = torch.nn.Linear(2, 2)
    >>> is_plain_torch_module(lin), is_plain_torch_module(Mine(2, 2))
    (True, False)
    >>> _ = lin.register_forward_hook(lambda *args: None); is_plain_torch_module(lin)
    False
    """
    if not isinstance(module, torch.nn.Module) or "forward" in vars(module):
        return False
    return type(module).__module__.startswith("torch.nn.modules") and \
        not torch_compat.has_module_hooks(module)


def _has_hooks(module: torch.nn.Module) -> bool:
    return torch_compat.has_module_hooks(module, backward=False)


@functools.lru_cache(maxsize=None)
def signature_of(target):
    try:
        return inspect.signature(target)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None


def is_fxdebug_read(node: fx.Node) -> bool:
    """Whether ``node`` is one of fxdebug's own reading nodes (capture, gradient hook, ...).

    >>> import torch, fxdebug
    >>> gm = fxdebug.instrument(torch.nn.Sequential(torch.nn.ReLU()))
    >>> [n.name for n in gm.graph.nodes if is_fxdebug_read(n)]
    ['begin_run', 'capture_0']
    """
    return node.op == "call_function" and node.target in _FXDEBUG_READS


def module_of(node: fx.Node, root: torch.nn.Module | Submodules | None):
    if root is None:
        return None
    try:
        return root.get_submodule(str(node.target))
    except AttributeError:
        return None


class Submodules:
    """``root.get_submodule`` answered from one walk of its modules (for a whole-graph analysis)."""

    def __init__(self, root: torch.nn.Module) -> None:
        self._root = root
        self._modules = dict(root.named_modules(remove_duplicate=False))

    def get_submodule(self, target: str) -> torch.nn.Module:
        module = self._modules.get(target)
        return module if module is not None else self._root.get_submodule(target)


def opaque_writes(node: fx.Node, root: "torch.nn.Module | Submodules | None") -> list[fx.Node]:
    """Inputs of ``node`` that code fx never saw may write in place; ``[]`` for known ops.

    Opaque: a call of a module whose code is not torch.nn's own (a user leaf
    module, an auto-leaf) or that has forward hooks, and a call of a function
    outside torch (a ``torch.fx.wrap``'d function). Their bodies are not in the
    graph, so any tensor they receive may come back changed.

    >>> import torch, fxdebug
    >>> class Leaf(torch.nn.Module):
    ...     def forward(self, x):
    ...         return x.mul_(2)
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), Leaf())
    >>> gm = fxdebug.trace(net, leaf_modules=[Leaf])
    >>> [[i.name for i in opaque_writes(n, gm)] for n in gm.graph.nodes if n.op == "call_module"]
    [[], ['_0']]
    """
    if node.op == "call_function":
        if is_fxdebug_read(node) or is_torch_callable(node.target):
            return []
        return list(node.all_input_nodes)
    if node.op == "call_module":
        module = module_of(node, root)
        if module is not None and type(module).__module__.startswith("torch.nn.modules") \
                and not _has_hooks(module):
            return []
        return list(node.all_input_nodes)
    return []


def inplace_requested(node: fx.Node) -> bool:
    """Whether a ``call_function`` node passes ``inplace=True``, by keyword or by position.

    >>> import torch, fxdebug
    >>> class Net(torch.nn.Module):
    ...     def forward(self, x):
    ...         return torch.nn.functional.relu(x, True)
    >>> relu = [n for n in fxdebug.trace(Net()).graph.nodes if n.op == "call_function"][0]
    >>> inplace_requested(relu)
    True
    """
    if node.op != "call_function":
        return False
    if node.kwargs.get("inplace") is True:
        return True
    if not is_torch_callable(node.target):
        return False
    signature = signature_of(node.target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    try:
        bound = signature.bind_partial(*node.args, **node.kwargs)
    except TypeError:
        return False
    return bound.arguments.get("inplace") is True


def mutated_argument(node: fx.Node, root: "torch.nn.Module | Submodules | None") -> fx.Node | None:
    """The node whose storage ``node`` writes in place, or ``None``."""
    first = node.args[0] if node.args else None
    out = node.kwargs.get("out")
    if isinstance(out, fx.Node):
        return out
    if node.op == "call_function":
        if node.target in INPLACE_OPERATORS or node.target is operator.setitem:
            return first if isinstance(first, fx.Node) else None
        if inplace_requested(node):
            return first if isinstance(first, fx.Node) else None
        name = getattr(node.target, "__name__", "")
        if is_torch_callable(node.target) and name.endswith("_") and not name.startswith("__"):
            return first if isinstance(first, fx.Node) else None  # torch.relu_, F.relu_ ...
    elif node.op == "call_method":
        name = str(node.target)
        if name.endswith("_") and not name.startswith("__"):
            return first if isinstance(first, fx.Node) else None
    elif node.op == "call_module" and root is not None:
        module = module_of(node, root)
        if getattr(module, "inplace", False) is True:
            return first if isinstance(first, fx.Node) else None
    return None


def alias_inputs(node: fx.Node, root: "torch.nn.Module | Submodules | None") -> list[fx.Node]:
    """Inputs whose storage ``node``'s output may share (all of them for code fx never saw).

    >>> import fxdebug
    >>> gm = fxdebug.trace(torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 2)))
    >>> [[i.name for i in alias_inputs(n, gm)] for n in gm.graph.nodes if n.op == "call_module"]
    [['input_1'], []]
    """
    if is_fxdebug_read(node):
        return []
    first = [node.args[0]] if node.args and isinstance(node.args[0], fx.Node) else []
    if mutated_argument(node, root) is not None:
        return first
    if node.op == "call_method":
        return first if str(node.target) in _VIEW_NAMES else []
    if node.op == "call_function":
        if is_torch_callable(node.target):
            return first if short_name("call_function", node.target) in _VIEW_NAMES else []
        return list(node.all_input_nodes)  # a user function: may return any input
    if node.op == "call_module":
        module = module_of(node, root)
        if module is not None and type(module).__module__.startswith("torch.nn.modules") \
                and not isinstance(module, _ALIASING_MODULES):
            return []
        return list(node.all_input_nodes)
    return []
