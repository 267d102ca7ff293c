"""Assertions for test suites: ``fxdebug.testing.assert_equivalent``.

>>> import torch, fxdebug
>>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
>>> _ = fxdebug.testing.assert_equivalent(model, fxdebug.trace(model), torch.randn(2, 3))
"""

from __future__ import annotations

import torch

from .equivalence.equivalence import EquivalenceReport, check_equivalence

__all__ = ["assert_equivalent"]


def assert_equivalent(reference: torch.nn.Module, candidate: torch.nn.Module, *inputs,
                      **options) -> EquivalenceReport:
    """Raise ``AssertionError`` unless ``candidate`` computes what ``reference`` does on ``inputs``.

    The message is :meth:`EquivalenceReport.table`: the outputs that differ,
    the first divergent node with its source line, and every node out of
    tolerance. ``options`` are those of :func:`fxdebug.check_equivalence`
    (``rtol``, ``atol``, ``grads``, ``train``, ``equal_nan``, ``localize``).
    Returns the report when the modules agree.

    Example::

        >>> import torch, fxdebug
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
        >>> gm = fxdebug.trace(model)
        >>> relu = [n for n in gm.graph.nodes if n.op == "call_module"][1]
        >>> relu.op, relu.target = "call_function", torch.tanh
        >>> _ = gm.recompile()
        >>> try:
        ...     fxdebug.testing.assert_equivalent(model, gm, torch.randn(2, 3))
        ... except AssertionError as error:
        ...     print([line for line in str(error).splitlines() if line.startswith("first")][0]
        ...           .split(" (")[0])
        first divergence: 1
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this one
    report = check_equivalence(reference, candidate, *inputs, **options)
    if not report.ok:
        raise AssertionError(report.table())
    return report
