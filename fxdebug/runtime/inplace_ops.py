"""The one table of in-place operators, shared by the tracer, the passes, the lint and the runtime.

Python's augmented assignments (``x += y``) reach a traced graph as
``operator.iadd`` and friends; a method whose name ends in one underscore
(``x.relu_()``) writes its tensor in place too::

    INPLACE_OPERATORS[operator.iadd]   -> operator.add       (its out-of-place twin)
    OPERATOR_SYMBOLS[operator.iadd]    -> "+"                 (x += y, for messages)
    writes_in_place(node)              -> True for x += y, x[i] = v, x.relu_()

>>> import operator
>>> INPLACE_OPERATORS[operator.iand], OPERATOR_SYMBOLS[operator.imatmul]
(<built-in function and_>, '@')
"""

from __future__ import annotations

import operator

import torch.fx as fx

__all__ = ["INPLACE_OPERATORS", "INPLACE_NAMES", "OPERATOR_SYMBOLS", "writes_in_place",
           "is_inplace_method"]

_PAIRS = (("iadd", "add", "+"), ("iand", "and_", "&"), ("ifloordiv", "floordiv", "//"),
          ("ilshift", "lshift", "<<"), ("imod", "mod", "%"), ("imul", "mul", "*"),
          ("imatmul", "matmul", "@"), ("ior", "or_", "|"), ("ipow", "pow", "**"),
          ("irshift", "rshift", ">>"), ("isub", "sub", "-"), ("itruediv", "truediv", "/"),
          ("ixor", "xor", "^"))

INPLACE_OPERATORS = {getattr(operator, inplace): getattr(operator, plain)
                     for inplace, plain, _ in _PAIRS}
"""Every in-place operator of the ``operator`` module, mapped to its out-of-place twin."""

INPLACE_NAMES = tuple(inplace for inplace, _, _ in _PAIRS)
"""Their names (``"iadd"``, ...), in the table's order."""

OPERATOR_SYMBOLS = {getattr(operator, inplace): symbol for inplace, _, symbol in _PAIRS}
"""The Python operator of each (``operator.iadd`` -> ``"+"``, written ``x += y``)."""


def is_inplace_method(name: str) -> bool:
    """A Tensor method that writes its tensor: one trailing underscore (``relu_``, not ``__add__``).

    >>> is_inplace_method("relu_"), is_inplace_method("__iadd__"), is_inplace_method("relu")
    (True, False, False)
    """
    return name.endswith("_") and not name.endswith("__")


def writes_in_place(node: fx.Node) -> bool:
    """Whether a graph node writes one of its arguments in place (``+=``, ``x[i] = v``, ``x.relu_()``).

    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> writes_in_place(graph.call_function(operator.iadd, (x, 1))), writes_in_place(x)
    (True, False)
    """
    if node.op == "call_method":
        return isinstance(node.target, str) and is_inplace_method(node.target)
    if node.op != "call_function" or node.target is operator.setitem:
        return node.op == "call_function"
    try:
        return node.target in INPLACE_OPERATORS
    except TypeError:  # an unhashable target is no operator
        return False
