"""What the trainer callbacks share: their options, and one training run's monitor.

:mod:`fxdebug.monitoring.hf_callback` (a Hugging Face ``Trainer``) and
:mod:`fxdebug.monitoring.lightning_callback` (a Lightning ``Trainer``) take
:func:`fxdebug.monitor`'s keyword arguments (:func:`check_options`), attach a monitor when
training starts (:class:`TrainerRun`), call its ``step()`` once per optimizer step, keep what
it returns and detach it when training ends.

>>> check_options({"every": 10, "stats": ["rms"]}, "MyCallback")
{'every': 10, 'stats': ['rms']}
"""

from __future__ import annotations

import difflib
import inspect
import logging
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import FxdebugError
from .training_monitor import Monitor, _check_steps, monitor
from .sinks import check_stats, check_writer

__all__ = ["check_options", "TrainerRun", "log"]

log = logging.getLogger("fxdebug.monitor")


def _option_names() -> list[str]:
    return [name for name in inspect.signature(monitor).parameters if name != "model"]


def check_options(options: dict, where: str) -> dict:
    """``options`` if they are :func:`fxdebug.monitor`'s keyword arguments with good values.

    ``where`` names the callback in the error. The model is not an option: the trainer
    gives it.

    >>> check_options({"evry": 10}, "MyCallback")
    Traceback (most recent call last):
    ...
    fxdebug.errors.FxdebugError: MyCallback: unknown option evry= (did you mean every=?); ...
    """
    names = _option_names()
    if "model" in options:
        raise FxdebugError(f"{where}: model= is not an option: the trainer's model is monitored "
                           f"when training starts. The options are fxdebug.monitor's: "
                           f"{', '.join(names)}.")
    for name in options:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f" (did you mean {close[0]}=?)" if close else ""
            raise FxdebugError(f"{where}: unknown option {name}={hint}; the options are "
                               f"fxdebug.monitor's keyword arguments: {', '.join(names)}.")
    defaults = {name: p.default for name, p in inspect.signature(monitor).parameters.items()}
    value = {**defaults, **options}.get
    _check_steps(value("every"), value("start"), value("end"))
    check_writer(value("writer"))
    check_stats(value("stats"))
    if value("callback") is not None and not callable(value("callback")):
        raise FxdebugError(f"{where}: callback= must be callable (fn(step, values)), got "
                           f"{type(value('callback')).__name__}.")
    return dict(options)


class TrainerRun:
    """A monitor attached to ``model`` for one training run, as a trainer callback holds it.

    ``first_step`` is the trainer's step count when training starts (a resumed run's), so
    that monitor steps are the trainer's optimizer steps. A forward hook on ``model``
    counts its forwards under grad (and hands each one's keyword arguments and output to
    ``on_output``); a logged step none of whose forwards ran raises, with ``hint`` saying
    what to pass. ``remove()`` leaves ``model`` as it was.

    >>> net = torch.nn.Linear(2, 2)
    >>> run = TrainerRun(net, {"every": 1}, 0, "MyCallback", "check training_step")
    >>> net(torch.ones(1, 2)).sum().backward()
    >>> run.step(None), run.monitor.steps
    (None, 1)
    >>> run.remove(); "forward" in vars(net), len(net._forward_hooks)
    (False, 0)
    """

    def __init__(self, model: torch.nn.Module, options: dict, first_step: int, where: str,
                 hint: str, on_output: Callable | None = None) -> None:
        self.where, self.hint = where, hint
        self.monitor = Monitor(model, **options)
        self.model = model
        self.forwards = 0  # forwards under grad since the last step
        self._on_output = on_output
        self._handle: RemovableHandle | None = None
        try:
            self.monitor.steps = first_step
            self._handle = model.register_forward_hook(self._seen, with_kwargs=True)
        except BaseException:
            self.monitor.remove()
            raise

    def _seen(self, module, args, kwargs, output) -> None:
        if not torch.is_grad_enabled():  # an evaluation: not part of the step
            return
        self.forwards += 1
        if self._on_output is not None:
            self._on_output(kwargs, output)

    def step(self, loss: torch.Tensor | None):
        """``monitor.step(loss)``; what it returns, logged at WARNING when not None."""
        mon = self.monitor
        if mon.logged and self.forwards == 0:
            raise FxdebugError(
                f"{self.where}: step {mon.steps} is a logged step but it recorded nothing: the "
                f"monitored module ({type(self.model).__name__}) did not run a forward under "
                f"grad since the last optimizer step. {self.hint}")
        self.forwards = 0
        step: Callable[..., object] = mon.step  # None, or a report to keep
        report = step(loss)
        if report is not None:
            log.warning("%s", report)
        return report

    def remove(self) -> None:
        """Detach the monitor and the forward hook; safe to call twice."""
        handle = self._handle
        if handle is not None:
            handle.remove()
            self._handle = None
        self.monitor.remove()
