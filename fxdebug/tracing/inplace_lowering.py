"""``x += y`` made ``x + y`` where nobody can tell the difference, as part of tracing.

fxdebug traces ``x += y`` as ``operator.iadd`` because in place it is what
eager runs: a view of the input or a tensor autograd saved is written
through. Most ``+=`` in models write a tensor nothing else will ever read
(resnet's ``out = self.bn2(out); out += identity``), and there a pass written
for ``torch.fx.symbolic_trace`` expects ``operator.add``. Such an
``operator.iadd`` (``isub``, ``imul``, ``itruediv``) becomes ``operator.add``
(``sub``, ``mul``, ``truediv``) when all of these are proven, before any run:

1. ``x`` is a new tensor that aliases nothing: the output of a torch.nn
   Conv / ConvTranspose / Linear / BatchNorm / LayerNorm / GroupNorm without
   forward hooks, or of an out-of-place ``+ - * / @``, ``torch.add`` ...
   ``torch.cat`` (an earlier lowered ``+=`` included). Never a model input, a
   parameter or buffer, a view, a module that may return its input, or code
   fx cannot see (leaf modules, wrapped functions);
2. the ``+=`` is ``x``'s only user: nothing read ``x`` before (nor saved it
   for backward) and nothing reads the old ``x`` after;
3. what made ``x`` does not save its output for backward (none of the
   producers above does; ``relu``, ``sigmoid``, ``exp`` do, and
   ``y = relu(a); y += 1`` stays in place, as does autograd's error);
4. ``x + y`` has ``x``'s dtype and shape (:mod:`~fxdebug.tracing.value_facts`):
   ``y`` a Python number and ``x`` floating point, or ``y`` a tensor
   provably of ``x``'s dtype and shape (never inside an autocast block).

The node keeps its name and key (``layer1.0.iadd``) and source line; its
``meta["fxdebug_lowered_from"]`` says ``"operator.iadd"``. Outputs and
gradients are bitwise those of eager (the same kernel, out of place).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.inplace_ops import INPLACE_OPERATORS
from .alias_rules import is_plain_torch_module
from .value_facts import ValueFacts

__all__ = ["lower_inplace_operators", "LOWERED_OPERATORS", "META_LOWERED_FROM"]

META_LOWERED_FROM = "fxdebug_lowered_from"

LOWERED_OPERATORS = {op: INPLACE_OPERATORS[op]
                     for op in (operator.iadd, operator.isub, operator.imul, operator.itruediv)}

# New tensors, aliasing nothing, whose backward does not need the output itself.
_FRESH_MODULES = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                  nn.ConvTranspose3d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
                  nn.LayerNorm, nn.GroupNorm)
_FRESH_FUNCTIONS = (operator.add, operator.sub, operator.mul, operator.truediv, operator.matmul,
                    operator.neg, torch.add, torch.sub, torch.mul, torch.div, torch.matmul,
                    torch.mm, torch.bmm, torch.cat, torch.stack, F.linear, F.conv1d, F.conv2d,
                    F.conv3d)


def _is_fresh(node: fx.Node, root: nn.Module) -> bool:
    """``node`` returns a new tensor that aliases nothing, and no backward saved it."""
    if node.op == "call_module":
        try:
            module = root.get_submodule(str(node.target))
        except AttributeError:
            return False
        return type(module) in _FRESH_MODULES and is_plain_torch_module(module)
    if node.op == "call_function":
        return node.target in _FRESH_FUNCTIONS and "out" not in node.kwargs
    return False


def _lowerable(node: fx.Node, root: nn.Module, facts: ValueFacts) -> bool:
    if node.op != "call_function" or node.target not in LOWERED_OPERATORS \
            or len(node.args) != 2 or node.kwargs:
        return False
    left, right = node.args
    return (isinstance(left, fx.Node) and list(left.users) == [node]
            and _is_fresh(left, root)
            and facts.binary_keeps_left(LOWERED_OPERATORS[node.target], left, right))


def lower_inplace_operators(graph: fx.Graph, root: nn.Module) -> list[fx.Node]:
    """Turn each ``x += y`` (and ``-=``, ``*=``, ``/=``) that nothing can observe out of place.

    ``root`` holds the modules ``call_module`` nodes name. Returns the lowered
    nodes, in graph order; call ``recompile()`` on the GraphModule after.

    >>> import torch, fxdebug
    >>> class Net(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.lin = torch.nn.Linear(3, 3)
    ...     def forward(self, x):
    ...         y = self.lin(x)
    ...         y += 1              # nothing else sees y: x + 1 computes the same
    ...         z = torch.relu(y)
    ...         z += 1              # relu's backward needs z: stays in place
    ...         return z
    >>> gm = fxdebug.trace(Net())   # fxdebug.trace lowers already
    >>> [(n.name, n.target.__name__, n.meta.get("fxdebug_lowered_from"))
    ...  for n in gm.graph.nodes if n.op == "call_function"]
    [('iadd', 'add', 'operator.iadd'), ('relu', 'relu', None), ('iadd_1', 'iadd', None)]
    """
    last = next((node for node in reversed(graph.nodes)
                 if node.op == "call_function" and node.target in LOWERED_OPERATORS), None)
    if last is None:
        return []  # no in-place operator: no facts to compute
    facts = ValueFacts(graph, root)
    lowered = []
    for node in graph.nodes:
        if _lowerable(node, root, facts):
            node.meta[META_LOWERED_FROM] = f"operator.{node.target.__name__}"
            node.target = LOWERED_OPERATORS[node.target]
            lowered.append(node)
        if node is last:
            break
        facts.visit(node)
    return lowered
