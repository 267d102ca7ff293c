"""``fxdebug.monitor`` inside a Lightning ``Trainer``: :class:`LightningMonitorCallback`.

::

    trainer = Trainer(max_steps=1000, callbacks=[LightningMonitorCallback(every=50,
                                                                          folder="runs/series")])

    on_train_start            fxdebug.monitor(the LightningModule, or its submodule
                              module="model"), its step count set to trainer.global_step
    on_before_backward        the loss backward runs on, added up over the micro-batches
    on_before_optimizer_step  mon.step(that sum): once per optimizer step (the
                              gradient-accumulation boundary), before gradient clipping
    on_train_end, on_exception, teardown
                              mon.remove(): the module as it was

Monitor step ``s`` is the optimizer step Lightning counts as ``trainer.global_step == s``
while it runs. The loss recorded is the sum of the losses backward ran on since the last
optimizer step: with ``accumulate_grad_batches=n``, Lightning divides each micro-batch's
``training_step`` loss by ``n``, so the sum is their mean. The parameter gradients
(``param_grad``) are read before Lightning clips them (``gradient_clip_val``).

Works with the ``pytorch_lightning`` package and the unified ``lightning`` package: the
callback is an instance of the ``Callback`` class of each one installed. Importing this
module needs one of them: ``pip install 'fxdebug[lightning]'``.
"""

from __future__ import annotations

import torch

from ..errors import FxdebugError
from .training_monitor import Monitor
from .trainer_common import TrainerRun, check_options


def _callback_classes() -> tuple[type, ...]:
    """The ``Callback`` class of each Lightning package installed (each Trainer checks its own)."""
    found = []
    try:
        import pytorch_lightning
        found.append(pytorch_lightning.Callback)
    except ImportError:
        pass
    try:
        import lightning.pytorch
        found.append(lightning.pytorch.Callback)
    except ImportError:
        pass
    if not found:
        raise FxdebugError("fxdebug.monitoring.lightning_callback needs Lightning (pytorch_lightning "
                           "or lightning): pip install 'fxdebug[lightning]'.")
    return tuple(found)


_BASES = _callback_classes()

__all__ = ["LightningMonitorCallback"]

_WHERE = "LightningMonitorCallback"


class LightningMonitorCallback(*_BASES):  # type: ignore[misc]
    """A Lightning ``Callback`` that runs :func:`fxdebug.monitor` while the Trainer trains.

    ``module``: the attribute path of the submodule to monitor (``"model"`` for
    ``self.model``), for a ``training_step`` that calls it rather than ``self(...)``; None:
    the LightningModule itself. The other keyword arguments are ``fxdebug.monitor``'s
    (``every``, ``folder``, ...). ``monitor`` is the run's :class:`~fxdebug.monitoring.Monitor`
    (None outside training); ``reports`` keeps what its ``step()`` returned when not None
    (also logged at WARNING on the ``fxdebug.monitor`` logger).

    >>> callback = LightningMonitorCallback(module="model", every=50)  # Trainer(callbacks=[...])
    >>> callback
    <LightningMonitorCallback module='model', every=50, not training>
    >>> LightningMonitorCallback(evry=50)
    Traceback (most recent call last):
    ...
    fxdebug.errors.FxdebugError: LightningMonitorCallback: unknown option evry= (did you mean ...
    """

    def __init__(self, module: str | None = None, **options) -> None:
        super().__init__()
        if module is not None and not isinstance(module, str):
            raise FxdebugError(f"{_WHERE}: module= is the attribute path of a submodule of the "
                               f"LightningModule (a str like 'model' or 'net.encoder'), or None "
                               f"for the LightningModule itself; got {type(module).__name__}.")
        self.module = module
        self.options = check_options(options, _WHERE)
        self.reports: list = []
        self.monitor: Monitor | None = None
        self._run: TrainerRun | None = None
        self._loss: torch.Tensor | None = None

    def _target(self, pl_module: torch.nn.Module) -> torch.nn.Module:
        if self.module is None:
            return pl_module
        try:
            return pl_module.get_submodule(self.module)
        except AttributeError as exc:
            children = [name for name, _ in pl_module.named_children()]
            raise FxdebugError(f"{_WHERE}: module={self.module!r} is not a submodule of "
                               f"{type(pl_module).__name__}; its submodules are "
                               f"{children}.") from exc

    def on_train_start(self, trainer, pl_module) -> None:
        self.remove()
        target = self._target(pl_module)
        if self.module is None:
            children = [name for name, _ in target.named_children()]
            hint = (f"training_step must call the LightningModule's forward (self(...)), or pass "
                    f"module= naming the submodule it calls: one of {children}.")
        else:
            hint = f"training_step must call self.{self.module}(...)."
        self._run = TrainerRun(target, self.options, trainer.global_step, _WHERE, hint)
        self.monitor = self._run.monitor
        self._loss = None

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if self._run is not None and isinstance(loss, torch.Tensor):
            loss = loss.detach()
            self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        run = self._run
        if run is None:
            return
        loss, self._loss = self._loss, None
        report = run.step(loss)
        if report is not None:
            self.reports.append(report)

    def on_train_end(self, trainer, pl_module) -> None:
        self.remove()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.remove()

    def teardown(self, trainer, pl_module, stage) -> None:
        self.remove()

    def remove(self) -> None:
        """Detach the monitor (the module as it was); safe to call twice."""
        run, self._run, self.monitor, self._loss = self._run, None, None, None
        if run is not None:
            run.remove()

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in
                            ([("module", self.module)] if self.module else [])
                            + list(self.options.items()))
        state = "training" if self._run is not None else "not training"
        return f"<{_WHERE} {options + ', ' if options else ''}{state}>"
