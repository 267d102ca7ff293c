"""A function compiled by torch.compile, called without dynamo's per-call cost where that is safe.

torch.compile checks its guards on every call, some 40 µs on a CPU: more than
a small reduction takes. :class:`DirectKernel` compiles a function of one
tensor with inductor through a backend that keeps each compiled graph, and
calls the graph directly for inputs of the one form its caller promises (a
dense tensor whose size varies only in dim 0, within a declared range)::

    kernel(values)
      ├─ a direct call is known for this thread count and len(values) is in range
      │     └─ compiled graph(sizes..., values)               (no guard check)
      └─ otherwise: torch.compile's call (guards, compiling when they fail)
            └─ when that call compiled: adopt its graph for direct calls if
                 1. both ends of the range then run through torch.compile
                    without compiling again (one graph covers every size), and
                 2. the graph called directly returns bitwise what
                    torch.compile returned.

Any other input, another thread count, or a graph that fails a check keeps
torch.compile's own call. Inductor bakes the thread count into the code it
generates, so direct calls are kept per ``torch.get_num_threads()``.

>>> kernel = DirectKernel(lambda v: v.sum(1).amax(), rows=(16, 64))
>>> values = torch.arange(32.0 * 8).view(32, 8)
>>> kernel(values).item(), kernel(values).item()      # compiles, then a direct call
(2012.0, 2012.0)
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

__all__ = ["DirectKernel"]


class DirectKernel:
    """``torch.compile(function, dynamic=True, fullgraph=True)``, called directly once checked.

    ``rows``: the (lowest, highest) size of dim 0 that direct calls may take;
    None never calls directly. Inputs must be dense (contiguous) tensors of one
    dtype and device, with the same sizes after dim 0: the caller's promise,
    which the checks above verify once and the direct call does not.
    """

    def __init__(self, function: Callable[[torch.Tensor], torch.Tensor],
                 rows: tuple[int, int] | None):
        self._compiled = torch.compile(function, dynamic=True, fullgraph=True,
                                       backend=self._backend)
        self._rows = rows
        self._graphs: list[tuple[Callable, tuple[int, ...] | None]] = []
        self._direct: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}
        self._refused: dict[int, str] = {}  # thread count -> why its graph is not called directly
        self._lock = threading.Lock()

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        from torch._inductor.compile_fx import compile_fx

        # for a GraphModule compile_fx returns the compiled callable; its annotation also
        # lists what it returns for other inputs (str, list[str], Weights)
        compiled: Callable = compile_fx(gm, example_inputs)  # type: ignore[assignment]
        self._graphs.append((compiled, _argument_recipe(gm)))
        return compiled

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        if self._rows is None:  # never called directly: nothing to adopt, so no lock either
            return self._compiled(values)
        threads = torch.get_num_threads()
        in_range = self._rows[0] <= values.shape[0] <= self._rows[1]
        direct = self._direct.get(threads)
        if direct is not None and in_range:
            return direct(values)
        with self._lock:
            compiled_before = len(self._graphs)
            out = self._compiled(values)
            if in_range and threads not in self._direct and threads not in self._refused \
                    and len(self._graphs) == compiled_before + 1:
                self._adopt(values, out, threads)
        return out

    def _adopt(self, values: torch.Tensor, out: torch.Tensor, threads: int) -> None:
        """Call the graph just compiled directly from now on, if both checks pass."""
        graph, recipe = self._graphs[-1]
        if recipe is None:
            self._refused[threads] = "its arguments are not one tensor and its sizes"
            return
        compiled = len(self._graphs)
        for rows in self._rows:  # type: ignore[union-attr]  # _adopt runs only with a range
            self._compiled(values.new_zeros((rows, *values.shape[1:])))
        if len(self._graphs) != compiled:
            self._refused[threads] = "torch.compile compiled again within the range"
            return

        def direct(tensor: torch.Tensor) -> torch.Tensor:
            return graph(*[tensor if dim < 0 else tensor.shape[dim] for dim in recipe])[0]

        try:
            same = _bitwise_equal(direct(values), out)
        except Exception as error:  # noqa: BLE001 - any failure keeps torch.compile's own call
            self._refused[threads] = f"the direct call failed: {type(error).__name__}: {error}"
            return
        if not same:
            self._refused[threads] = "the direct call returned other values"
            return
        self._direct[threads] = direct


def _argument_recipe(gm: torch.fx.GraphModule) -> tuple[int, ...] | None:
    """Per graph input: -1 for the tensor, else which of its dims a size input is; None if neither."""
    examples = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
    tensors = [example for example in examples if isinstance(example, torch.Tensor)]
    if len(tensors) != 1:
        return None
    sizes = [str(size) for size in tensors[0].shape]
    recipe = []
    for example in examples:
        if isinstance(example, torch.Tensor):
            recipe.append(-1)
        elif isinstance(example, torch.SymInt) and str(example) in sizes:
            recipe.append(sizes.index(str(example)))
        else:
            return None
    return tuple(recipe)


def _bitwise_equal(first: object, second: torch.Tensor) -> bool:
    return (isinstance(first, torch.Tensor) and first.shape == second.shape
            and first.dtype == second.dtype and first.device == second.device
            and bool(((first == second) | (first.isnan() & second.isnan())).all()))
