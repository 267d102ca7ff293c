"""Run modules several times under identical conditions, and leave them as they were.

Every run starts from the same random-number state (so dropout draws the same
masks in every run), the same buffers (BatchNorm running statistics are put
back before each run and at the end) and fresh copies of the inputs (a model
that writes to its input cannot change what the next run sees). Training
flags are set for the runs and restored, module by module, afterwards.
"""

from __future__ import annotations

from typing import Iterable

import torch

from ..runtime import clone_inputs, flatten_tensors

__all__ = ["ControlledRuns"]


class ControlledRuns:
    """Context manager: ``runs.run(fn)`` calls ``fn(*inputs)`` on fresh copies of ``inputs``.

    Args:
        modules: every module that will be run (their submodules included).
        inputs: the positional inputs, copied for each run.
        train: ``True``/``False`` sets every module to training / eval mode for
            the runs; ``None`` leaves the modes as they are.

    >>> lin = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    >>> with ControlledRuns([lin], (torch.ones(1, 2),), train=True) as runs:
    ...     torch.equal(runs.run(lin), runs.run(lin))
    True
    """

    def __init__(self, modules: Iterable[torch.nn.Module], inputs: tuple, train: bool | None):
        self.modules = list(modules)
        self.inputs = inputs
        self.train = train
        self._flags: list[tuple[torch.nn.Module, bool]] = []
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._devices: list[int] = []
        self._cpu_state = torch.empty(0, dtype=torch.uint8)  # taken in __enter__
        self._cuda_states: list[torch.Tensor] = []

    def __enter__(self) -> "ControlledRuns":
        seen: dict[int, None] = {}
        buffers_seen: dict[int, None] = {}
        devices: dict[int, None] = {}
        for root in self.modules:
            for module in root.modules():
                if id(module) not in seen:
                    seen[id(module)] = None
                    self._flags.append((module, module.training))
            for buffer in root.buffers():
                if id(buffer) not in buffers_seen:
                    buffers_seen[id(buffer)] = None
                    self._buffers.append((buffer, buffer.detach().clone()))
            for parameter in root.parameters():
                if parameter.is_cuda:
                    devices[parameter.device.index or 0] = None
        for _, tensor in flatten_tensors(self.inputs):
            if tensor.is_cuda:
                devices[tensor.device.index or 0] = None
        self._devices = sorted(devices)
        self._cpu_state = torch.get_rng_state()
        self._cuda_states = [torch.cuda.get_rng_state(device) for device in self._devices]
        if self.train is not None:
            for root in self.modules:
                root.train(self.train)
        return self

    def _restore_buffers(self) -> None:
        with torch.no_grad():
            for buffer, saved in self._buffers:
                buffer.copy_(saved)

    def run(self, fn, grad: bool = False):
        """Call ``fn`` (a module) on fresh copies of the inputs, from the saved RNG and buffers."""
        self._restore_buffers()
        args = clone_inputs(self.inputs)
        with torch.random.fork_rng(devices=self._devices):
            torch.set_rng_state(self._cpu_state)
            for device, state in zip(self._devices, self._cuda_states):
                torch.cuda.set_rng_state(state, device)
            with torch.set_grad_enabled(grad):
                return fn(*args)

    def __exit__(self, *exc_info) -> None:
        self._restore_buffers()
        for module, training in self._flags:
            module.training = training
