"""Functionalize: rewrite in-place ops to out-of-place ones, so autograd's saved values survive.

Before (seed 003)::

    sigmoid = torch.sigmoid(fc)
    lt = sigmoid < 0.5
    masked_fill_ = sigmoid.masked_fill_(lt, 0.0)     # SigmoidBackward needs sigmoid
    return sigmoid

After ``Functionalize()``::

    sigmoid = torch.sigmoid(fc)
    lt = sigmoid < 0.5
    masked_fill_ = sigmoid.masked_fill(lt, 0.0)
    return masked_fill_

Each rewritten node keeps its name, key and source line; later uses of the
written value read the new node instead. What it rewrites:

* ``x.op_(...)`` -> ``x.op(...)`` (``zero_`` -> ``torch.zeros_like``,
  ``fill_(v)`` -> ``torch.full_like``); ``torch.relu_`` -> ``torch.relu``;
* ``x += y`` (``operator.iadd`` and friends) -> ``x + y``;
* ``F.relu(x, inplace=True)`` -> ``inplace=False``; ``ReLU(inplace=True)``
  and other in-place modules -> a copy with ``inplace=False`` (registered on
  the GraphModule; your model's modules are never changed); ``out=`` dropped;
* ``x[i] = v`` -> ``x = x.clone(); x[i] = v`` (the write lands on a fresh copy);
* ``Embedding(max_norm=...)`` and other writes to model inputs, parameters or
  buffers stay (they are visible outside the forward), but nodes that read the
  value before the write read a clone, so what they saved survives.

A write it cannot rewrite without changing the numbers (through a view that is
used afterwards, through ``.data`` / ``.detach()``, random fills such as
``normal_``) is left as it is, listed in ``pass.not_rewritten`` and named in a
warning, one line per op. fxdebug's own nodes (captures, gradient hooks) only
read, so ``Functionalize`` after ``Capture`` rewrites what it rewrites alone.
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import warnings

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..errors import FidelityWarning
from ..base.formatting import format_location
from ..runtime.inplace_ops import INPLACE_OPERATORS
from ..tracing.alias_rules import inplace_requested, mutated_argument, signature_of
from ..tracing.keys import META_KEY, META_PASS, META_RETURNS, META_SOURCE, node_key, op_name
from ..tracing.locations import caller_stacklevel
from .aliasing import AliasAnalysis
from .base import Pass

__all__ = ["Functionalize", "Unrewritten"]

# Tensor methods ending in "_" that are not data writes, or whose out-of-place
# twin means something else (bernoulli_(p) vs bernoulli()) or draws other numbers.
_KEEP_METHODS = frozenset("""
requires_grad_ share_memory_ retain_grad_ set_ resize_ resize_as_ detach_ bernoulli_
normal_ uniform_ random_ cauchy_ exponential_ geometric_ log_normal_ copy_ map_ apply_
fill_diagonal_ record_stream_
""".split())




@dataclasses.dataclass(frozen=True)
class Unrewritten:
    """An in-place node :class:`Functionalize` left as it is, and why."""

    key: str
    op: str
    location: str
    reason: str

    def __str__(self) -> str:
        return f"{self.key} ({self.op}, {self.location}): {self.reason}"


def _positions(graph: fx.Graph) -> dict[fx.Node, int]:
    return {node: index for index, node in enumerate(graph.nodes)}


def _embedding(gm: fx.GraphModule, node: fx.Node):
    if node.op != "call_module":
        return None
    try:
        module = gm.get_submodule(str(node.target))
    except AttributeError:
        return None
    if isinstance(module, torch.nn.Embedding) and module.max_norm is not None:
        return module
    return None


def _is_write(gm: fx.GraphModule, node: fx.Node) -> bool:
    if _embedding(gm, node) is not None:
        return True
    if node.op == "call_method" and node.target in ("requires_grad_", "share_memory_"):
        return False
    return mutated_argument(node, gm) is not None


def _alias_name(node: fx.Node) -> str | None:
    if node.op == "call_function" and node.target is getattr and node.args[1:2] == ("data",):
        return ".data"
    if (node.op == "call_method" and node.target == "detach") or (
            node.op == "call_function" and node.target is torch.detach):
        return ".detach()"
    return None


class Functionalize(Pass):
    """Rewrite in-place ops out of place where that computes the same numbers.

    After it, backward no longer fails with "modified by an inplace operation"
    for the rewritten writes, and the forward computes the same values.

    Attributes (after running):
        rewritten: ``(key, before, after)`` for each rewritten node.
        not_rewritten: :class:`Unrewritten` records, also given in a warning.

    Example::

        >>> import torch, fxdebug
        >>> class Net(torch.nn.Module):
        ...     def forward(self, x):
        ...         y = torch.relu(x * 2)
        ...         y += 1                      # ReluBackward needs y
        ...         return y
        >>> gm = fxdebug.trace(Net())
        >>> functionalize = fxdebug.passes.Functionalize()
        >>> functionalize(gm).modified
        True
        >>> functionalize.rewritten
        [('iadd', 'operator.iadd', 'operator.add')]
        >>> x = torch.randn(3, requires_grad=True)
        >>> gm(x).sum().backward()              # fine now
    """

    name = "functionalize"

    def __init__(self) -> None:
        self.rewritten: list[tuple[str, str, str]] = []
        self.not_rewritten: list[Unrewritten] = []

    def run(self, gm: fx.GraphModule) -> bool:
        self.rewritten = []
        self.not_rewritten = []
        self._module_copies: dict[str, str] = {}
        for node in list(gm.graph.nodes):
            if node.graph is not gm.graph or not _is_write(gm, node):
                continue
            before = op_name(node, gm)
            reason = self._rewrite(gm, node)
            if reason is None:
                after = op_name(node, gm)
                if node.op == "call_module":
                    after = f"{after}(inplace=False)"
                elif node.target is operator.setitem:
                    after = "Tensor.clone + operator.setitem"
                self.rewritten.append((node_key(node), before, after))
            elif reason:
                source = node.meta.get(META_SOURCE)
                self.not_rewritten.append(Unrewritten(node_key(node), before,
                                                      format_location(source), reason))
        if self.not_rewritten:
            listed = "".join(f"\n  {item}" for item in self.not_rewritten)
            warnings.warn(f"Functionalize left {len(self.not_rewritten)} in-place op(s) as they "
                          f"are, one per line:{listed}", FidelityWarning,
                          stacklevel=caller_stacklevel())
        return bool(self.rewritten)

    # -- one write ---------------------------------------------------------------------------
    def _rewrite(self, gm: fx.GraphModule, node: fx.Node) -> str | None:
        """Rewrite ``node``; return None when done, "" when nothing was needed, else why not."""
        embedding = _embedding(gm, node)
        if embedding is not None:
            return self._protect_readers_of_parameter(gm, node, f"{node.target}.weight")
        target = mutated_argument(node, gm)
        if target is None:  # _is_write saw a write, but not into which argument
            return (f"writes in place, but fxdebug cannot tell which argument "
                    f"{node_key(node)!r} writes; compute the new value out of place.")
        aliases = AliasAnalysis(gm)
        position = _positions(gm.graph)
        members = aliases.members(target)
        external = [m for m in members if m.op in ("placeholder", "get_attr")]
        if external:
            return self._protect_readers(gm, node, target, external[0], aliases, position)
        for member in members:
            if member is target or member is node or position[member] > position[node]:
                continue
            if any(position[user] > position[node] for user in member.users):
                via = next((_alias_name(m) for m in members if _alias_name(m)), None)
                if via is not None:
                    return (f"writes through {via}, which shares storage with "
                            f"{node_key(member)!r}, used after the write; autograd does not see "
                            f"such writes as changes of {node_key(member)!r}. Compute the new "
                            f"value out of place.")
                return (f"writes into {node_key(member)!r} through a view, and "
                        f"{node_key(member)!r} is used after the write; rewrite it by hand "
                        f"(e.g. torch.where or index_put on a clone).")
        replacement = self._out_of_place(gm, node, target)
        if isinstance(replacement, str):
            return replacement
        later = [user for user in list(target.users) if user is not node
                 and user is not replacement and position.get(user, -1) > position[node]]
        for user in later:
            user.replace_input_with(target, replacement)
        _retarget_returns(gm.graph, position, node, {target.name: replacement.name,
                                                     node.name: replacement.name})
        return None

    def _out_of_place(self, gm: fx.GraphModule, node: fx.Node, target: fx.Node):
        """Turn ``node`` into its out-of-place form; return the node holding the new value."""
        if "out" in node.kwargs:
            node.kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
            return node
        if node.op == "call_method":
            name = str(node.target)
            if name == "zero_":
                node.op, node.target = "call_function", torch.zeros_like
                node.args = node.args[:1]
                return node
            if name == "fill_" and len(node.args) == 2 and isinstance(node.args[1], (int, float,
                                                                                      bool)):
                node.op, node.target = "call_function", torch.full_like
                return node
            if name in _KEEP_METHODS or not hasattr(torch.Tensor, name[:-1]):
                return f"Tensor.{name} has no out-of-place form that computes the same values."
            node.target = name[:-1]
            return node
        if node.op == "call_module":
            return self._module_copy(gm, node)
        if node.target is operator.setitem:
            with gm.graph.inserting_before(node):
                clone = gm.graph.call_method("clone", (target,))
            clone.meta[META_KEY] = f"{node_key(node)}:clone"
            clone.meta[META_PASS] = self.name
            clone.meta[META_SOURCE] = node.meta.get(META_SOURCE)
            node.args = (clone,) + tuple(node.args[1:])
            return clone
        if node.target in INPLACE_OPERATORS:
            node.target = INPLACE_OPERATORS[node.target]
            return node
        if inplace_requested(node):
            signature = signature_of(node.target)
            bound = signature.bind_partial(*node.args, **node.kwargs)
            del bound.arguments["inplace"]
            node.args, node.kwargs = tuple(bound.args), {**bound.kwargs, "inplace": False}
            return node
        name = getattr(node.target, "__name__", "")
        for namespace in (torch, F, torch.special):
            if getattr(namespace, name, None) is node.target and callable(
                    getattr(namespace, name[:-1], None)):
                node.target = getattr(namespace, name[:-1])
                return node
        return f"{op_name(node, gm)} has no out-of-place form known to fxdebug."

    def _module_copy(self, gm: fx.GraphModule, node: fx.Node):
        module = gm.get_submodule(str(node.target))
        if any(True for _ in module.parameters()) or any(True for _ in module.buffers()):
            return (f"{type(module).__name__}(inplace=True) has parameters or buffers; construct "
                    f"it with inplace=False.")
        if node.target not in self._module_copies:
            fresh = copy.deepcopy(module)
            setattr(fresh, "inplace", False)  # nn.ReLU(inplace=True) and the like
            parent_path, _, last = str(node.target).rpartition(".")
            parent = gm.get_submodule(parent_path) if parent_path else gm
            if parent is not gm and type(parent) is not torch.nn.Module:
                # a model's own container (not one fx made): leave it alone, use the root
                parent_path, last = "", "fxdebug_" + str(node.target).replace(".", "_")
                parent = gm
            base = f"{last}_outofplace"
            name, index = base, 0
            while hasattr(parent, name):
                index += 1
                name = f"{base}_{index}"
            path = f"{parent_path}.{name}" if parent_path else name
            gm.add_submodule(path, fresh)
            self._module_copies[str(node.target)] = path
        node.target = self._module_copies[str(node.target)]
        return node

    # -- writes that must stay: protect what was read before -----------------------------
    def _protect_readers(self, gm, node, target, external, aliases, position) -> str:
        kind = "model input" if external.op == "placeholder" else "parameter or buffer"
        what = f"writes to the {kind} {node_key(external)!r}, which is visible outside the forward"
        if target is not external:
            return f"{what} (through a view); clone it first by hand."
        protected = self._clone_for_readers(gm, node, target, aliases, position)
        if protected is None:
            return f"{what}; a node read it before the write through a view, rewrite it by hand."
        return ""  # nothing to report: the write stays, and nothing saved before it is hit

    def _protect_readers_of_parameter(self, gm, node, attribute: str) -> str:
        position = _positions(gm.graph)
        aliases = AliasAnalysis(gm)
        reads = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target == attribute
                 and position[n] < position[node]]
        for read in reads:
            if self._clone_for_readers(gm, node, read, aliases, position) is None:
                return (f"{attribute} is read through a view before the renormalising call; "
                        f"clone it by hand ({attribute}.clone()).")
        return ""

    def _clone_for_readers(self, gm, node, value, aliases, position):
        """Make the users of ``value`` placed before ``node`` read a clone; None if unsafe."""
        readers = [user for user in value.users if position[user] < position[node]]
        if not readers:
            return False
        shared = aliases.members(value)
        if any(reader in shared for reader in readers):
            return None  # a view read before the write sees the write later on
        with gm.graph.inserting_after(value):
            clone = gm.graph.call_method("clone", (value,))
        clone.meta[META_KEY] = f"{node_key(value)}:clone"
        clone.meta[META_PASS] = self.name
        clone.meta[META_SOURCE] = value.meta.get(META_SOURCE)
        for reader in readers:
            reader.replace_input_with(value, clone)
        self.rewritten.append((node_key(value), op_name(value, gm), "clone for earlier readers"))
        return True


def _retarget_returns(graph: fx.Graph, position, node: fx.Node, renames: dict[str, str]) -> None:
    """Module outputs recorded at or after ``node`` that named the written value: name the new one."""
    for other in graph.nodes:
        returns = other.meta.get(META_RETURNS)
        if not returns or position.get(other, len(position)) < position[node]:
            continue
        other.meta[META_RETURNS] = [type(ret)(ret.key, ret.module_type,
                                              tuple((sub, renames.get(name, name))
                                                    for sub, name in ret.items), ret.source)
                                    for ret in returns]
