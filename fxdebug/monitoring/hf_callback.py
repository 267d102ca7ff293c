"""``fxdebug.monitor`` inside a Hugging Face ``Trainer``: :class:`HFMonitorCallback`.

::

    trainer = transformers.Trainer(model, args, train_dataset=data,
                                   callbacks=[HFMonitorCallback(every=50, folder="runs/series")])

    on_train_begin            fxdebug.monitor(the Trainer's model, **options), its step count
                              set to state.global_step (a resumed run counts on)
    each training forward     the model output's .loss kept (when the model computed one)
    on_pre_optimizer_step     mon.step(the step's loss): once per optimizer step (at the
                              gradient-accumulation boundary), after gradient clipping
    on_train_end              mon.remove(): the model as it was

Monitor step ``s`` is the optimizer step the Trainer counts as ``state.global_step == s``
while it runs (``global_step`` becomes ``s + 1`` once the optimizer has stepped). The loss
recorded is the one the Trainer computes from the model's ``.loss``: the sum over the
step's micro-batches of each one's loss divided by their number, or undivided where the
Trainer passed ``num_items_in_batch`` (the model then normalized it over the whole step).

A mixed-precision Trainer (``bf16=True``, ``fp16=True``) runs the model under accelerate's
autocast by wrapping its ``forward``; the monitor's logged steps run an instrumented copy that
wrapper does not reach, so the callback runs them under the same autocast (and float32
outputs), as the other steps.

Importing this module needs transformers (and its Trainer accelerate):
``pip install 'fxdebug[hf]'``.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..errors import FidelityWarning, FxdebugError

try:
    from transformers import TrainerCallback
except ImportError as _missing:
    raise FxdebugError("fxdebug.monitoring.hf_callback needs transformers (and accelerate, which "
                       "its Trainer uses): pip install 'fxdebug[hf]'.") from _missing

from .training_monitor import Monitor
from .trainer_common import TrainerRun, check_options

__all__ = ["HFMonitorCallback"]

_WHERE = "HFMonitorCallback"


class HFMonitorCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that runs :func:`fxdebug.monitor` while the Trainer
    trains; the keyword arguments are ``fxdebug.monitor``'s (``every``, ``folder``, ...).

    ``monitor`` is the run's :class:`~fxdebug.monitoring.Monitor` (None outside training);
    ``reports`` keeps what its ``step()`` returned when not None (also logged at WARNING on
    the ``fxdebug.monitor`` logger). When ``train()`` raises, the Trainer calls no callback:
    call ``remove()`` to detach (the next ``train()`` does it too).

    >>> callback = HFMonitorCallback(every=50, stats=["rms"])  # Trainer(..., callbacks=[callback])
    >>> callback
    <HFMonitorCallback every=50, stats=['rms'], not training>
    >>> HFMonitorCallback(every=0)
    Traceback (most recent call last):
    ...
    fxdebug.errors.FxdebugError: fxdebug.monitor: every= must be a positive int ...
    """

    def __init__(self, **options) -> None:
        self.options = check_options(options, _WHERE)
        self.reports: list = []
        self.monitor: Monitor | None = None
        self._run: TrainerRun | None = None
        self._losses: list[tuple[torch.Tensor, bool]] = []  # (loss, normalized over the step)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.remove()  # a train() that raised left its monitor attached
        if model is None:
            raise FxdebugError(f"{_WHERE}: on_train_begin was called without the model; it "
                               f"goes in transformers.Trainer(callbacks=[...]).")
        with warnings.catch_warnings():
            if "_original_forward" in vars(model):  # accelerate's autocast: applied below
                warnings.filterwarnings("ignore", category=FidelityWarning,
                                        message="fxdebug.monitor: .* replaced on the instance")
            self._run = TrainerRun(
                model, self.options, state.global_step, _WHERE,
                "The Trainer calls the model it was given; a compute_loss of your own must "
                "call that model too.", on_output=self._keep_loss)
        self.monitor = self._run.monitor
        _logged_steps_in_mixed_precision(model, self.monitor)

    def _keep_loss(self, kwargs: dict, output) -> None:
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, torch.Tensor):
            self._losses.append((loss.detach(), kwargs.get("num_items_in_batch") is not None))

    def _step_loss(self, args, forwards: int) -> torch.Tensor | None:
        """The loss the Trainer computed for this step (None where a forward gave none)."""
        losses, self._losses = self._losses, []
        if not losses or len(losses) != forwards:
            return None
        total = None
        for loss, normalized in losses:
            loss = loss.mean()  # several GPUs in one process (DataParallel): their mean
            if normalized:
                if args.average_tokens_across_devices and args.world_size > 1:
                    loss = loss * args.world_size  # as the Trainer scales it
            else:
                loss = loss / forwards
            total = loss if total is None else total + loss
        return total

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        run = self._run
        if run is None:
            return
        report = run.step(self._step_loss(args, run.forwards))
        if report is not None:
            self.reports.append(report)

    def on_train_end(self, args, state, control, **kwargs):
        self.remove()

    def remove(self) -> None:
        """Detach the monitor (the model as it was); safe to call twice."""
        run, self._run, self.monitor, self._losses = self._run, None, None, []
        if run is not None:
            run.remove()

    def __repr__(self) -> str:
        options = ", ".join(f"{name}={value!r}" for name, value in self.options.items())
        state = "training" if self._run is not None else "not training"
        return f"<{_WHERE} {options + ', ' if options else ''}{state}>"


def _logged_steps_in_mixed_precision(model: torch.nn.Module, mon) -> None:
    """Where accelerate wrapped ``model.forward`` in its mixed-precision autocast (it keeps the
    forward it wrapped as ``_original_forward``), wrap the monitor's logged forwards alike.

    ``mon.remove()`` puts accelerate's forward back, and this wrapper with it.
    """
    if "_original_forward" not in vars(model) or "forward" not in vars(model):
        return
    from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

    monitored = model.forward  # the monitor's: the model's own off-steps, its copy on logged ones
    mixed = convert_outputs_to_fp32(get_mixed_precision_context_manager(True)(monitored))

    @functools.wraps(monitored)
    def forward(*args, **kwargs):
        if mon.logged and torch.is_grad_enabled():
            return mixed(*args, **kwargs)
        return monitored(*args, **kwargs)

    model.forward = forward
