"""One training step's numbers: the loss, the parameter gradients and chosen node values.

The step is run as fxdebug measures it: forward through the graph (an
``fx.Interpreter`` that keeps the values of the nodes asked for), the loss, and
``torch.autograd.grad`` for the parameters (and for the kept values, where asked),
so no ``.grad`` of the user's model is touched. The same step runs on a float64
copy of the graph (:func:`float64_copy`), the reference every error is measured
against::

    reference = run_step(float64_copy(gm), inputs64, loss, ...)   float64
    float32   = run_step(gm, inputs, loss, ...)                   the model as it is
    candidate = run_step(fake_precision(gm, keys, dtype), ...)    nodes rounded
    errors(candidate, reference) -> loss error, gradient error (relative)
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..base import torch_compat
from ..errors import FxdebugError
from ..runtime.values import map_tensors, outputs_loss

__all__ = ["Step", "run_step", "float64_copy", "as_float64", "relative_error", "step_errors",
           "default_loss"]


@dataclasses.dataclass
class Step:
    """What one step gave: the loss, the parameter gradients (in parameter order), the
    values of the watched nodes and, where asked, the gradients flowing into them."""

    loss: torch.Tensor
    grads: list[torch.Tensor]
    values: dict[str, torch.Tensor]
    value_grads: dict[str, torch.Tensor]


class _Watch(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, names: Sequence[str]) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.names = set(names)
        self.values: dict[str, torch.Tensor] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.values[n.name] = out
        return out


def default_loss(output: Any) -> torch.Tensor:
    """The loss when none is given: the output's ``loss`` where it has one (Hugging Face
    models called with labels), else the sum of every floating output tensor.

    >>> default_loss({"loss": torch.tensor(2.0), "logits": torch.ones(3)})
    tensor(2.)
    """
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    found = outputs_loss(output)
    if found is None:
        raise FxdebugError("fxdebug.precision_sensitivity: the model's output has no floating "
                           "tensor that requires grad, so there is no loss to differentiate; "
                           "pass loss=lambda out: ... (a scalar).")
    return found


def run_step(gm: fx.GraphModule, inputs: tuple, loss: Callable[[Any], torch.Tensor],
             params: Sequence[torch.Tensor], watch: Sequence[str] = (),
             grads_of: Sequence[str] = (), context: Callable[[], Any] | None = None) -> Step:
    """Forward ``gm`` on ``inputs`` (under ``context()`` where given), ``loss(output)``, and
    the gradients of the loss for ``params`` and for the watched nodes named in ``grads_of``."""
    interpreter = _Watch(gm, watch)
    with torch.enable_grad():
        with (context() if context is not None else _nothing()):
            output = interpreter.run(*inputs)  # the graph's own input / output processing
            value = loss(output)
        if not (isinstance(value, torch.Tensor) and value.numel() == 1):
            raise FxdebugError(f"fxdebug.precision_sensitivity: loss(output) gave "
                               f"{type(value).__name__}, not a scalar tensor; pass a loss that "
                               f"returns one (e.g. lambda out: out.logits.square().mean()).")
        watched = [name for name in grads_of if name in interpreter.values
                   and interpreter.values[name].requires_grad]
        wrt = list(params) + [interpreter.values[name] for name in watched]
        found = torch.autograd.grad(value.reshape(()), wrt, allow_unused=True) if wrt else ()
    grads = [torch.zeros_like(t) if g is None else g.detach() for t, g in zip(wrt, found)]
    return Step(value.detach().reshape(()), grads[:len(params)],
                {name: v.detach() for name, v in interpreter.values.items()},
                dict(zip(watched, grads[len(params):])))


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def as_float64(value: Any) -> Any:
    """``value`` with every floating tensor in float64 (other leaves as they are).

    >>> as_float64((torch.ones(1), 3))[0].dtype
    torch.float64
    """
    return map_tensors(lambda t: t.detach().double() if t.is_floating_point() else t, value)


def float64_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A float64 copy of ``gm``: parameters and buffers copied in float64, dtype arguments
    ``torch.float32`` made ``torch.float64``, and torch.export's dtype assertions dropped.

    >>> import fxdebug
    >>> float64_copy(fxdebug.trace(torch.nn.Linear(2, 2))).weight.dtype
    torch.float64
    """
    copied = copy.deepcopy(gm).to(torch.float64)
    graph = copied.graph

    def widen(arg: Any) -> Any:
        return torch.float64 if arg is torch.float32 else arg

    for node in list(graph.nodes):
        if torch_compat.is_tensor_metadata_assert(node):
            graph.erase_node(node)
            continue
        node.args = fx.node.map_aggregate(node.args, widen)
        node.kwargs = fx.node.map_aggregate(node.kwargs, widen)
    copied.recompile()
    return copied


def relative_error(value: torch.Tensor | Sequence[torch.Tensor],
                   reference: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """``||value - reference|| / ||reference||`` in float64 over one tensor or a list of
    them (``||value - reference||`` where the reference is zero; ``inf`` where not finite).

    >>> round(relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.5])), 6)
    0.185695
    """
    values = [value] if isinstance(value, torch.Tensor) else list(value)
    references = [reference] if isinstance(reference, torch.Tensor) else list(reference)
    difference = sum((float(torch.linalg.vector_norm(v.double() - r.double())) ** 2
                      for v, r in zip(values, references)), 0.0)
    norm = sum((float(torch.linalg.vector_norm(r.double())) ** 2 for r in references), 0.0)
    if difference != difference or difference == float("inf"):
        return float("inf")
    return (difference / norm) ** 0.5 if norm > 0 else difference ** 0.5


def step_errors(step: Step, reference: Step) -> dict[str, float]:
    """``{"loss": ..., "grad": ...}``: the step's relative errors against the reference."""
    return {"loss": relative_error(step.loss, reference.loss),
            "grad": relative_error(step.grads, reference.grads)}
