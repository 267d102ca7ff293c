"""The trainer callbacks run fxdebug.monitor inside a real Hugging Face Trainer and a real
Lightning Trainer (tiny models, random weights, a few steps, gradient accumulation): each logged
step's series equal float64 statistics of forward hooks, retain_grad gradients and parameter
copies taken on the same run; one monitor step per optimizer step, numbered as the trainer's
global step; the loss series is the loss the trainer computed; the model is as it was after."""

from __future__ import annotations

import importlib
import logging
import math
import sys
import warnings

import pytest
import torch

import fxdebug
from fxdebug.errors import FxdebugError

from test_monitor import close, pooled, reference

EVERY = 2


# -- ground truth: hooks and parameter copies on the model being trained ---------------------

class Truth:
    """float64 statistics of the modules' outputs (forward hooks on ``hooked``, or the pairs
    given to ``before_optimizer_step``), their gradients (retain_grad) and the named modules'
    own parameters, gradients and updates, at each optimizer step."""

    def __init__(self, model: torch.nn.Module, names: list[str], hooked: list[str]) -> None:
        self.modules = {name: model.get_submodule(name) for name in names}
        self.hooked = hooked  # the modules whose forward hooks run once per forward
        self.outputs: dict[str, list[torch.Tensor]] = {name: [] for name in hooked}
        self.expected: dict[int, dict[str, dict[str, float]]] = {}
        self.steps: list[int] = []  # the trainer's global step at each optimizer step
        self.copies: dict[str, list[torch.Tensor]] = {}
        self.handles = [self.modules[name].register_forward_hook(self._hook(name))
                        for name in hooked]

    def _hook(self, name):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                output.retain_grad()
                self.outputs[name].append(output)
        return hook

    def before_optimizer_step(self, step: int, outputs=None) -> None:
        """``outputs``: {name: [(output, its gradient) of each micro-batch]} (default: the hooks')."""
        self.steps.append(step)
        if outputs is None:
            outputs = {name: [(o, o.grad) for o in kept] for name, kept in self.outputs.items()}
        self.outputs = {name: [] for name in self.hooked}
        self.copies = {}
        if step % EVERY:
            return
        found = self.expected.setdefault(step, {})
        for name, kept in outputs.items():
            assert len(kept) == 2, f"{name}: {len(kept)} forwards in a step of 2 micro-batches"
            found[f"{name}.out"] = reference(pooled(o for o, _ in kept))
            found[f"{name}.grad"] = reference(pooled(g for _, g in kept))
        for name, module in self.modules.items():
            own = list(module.parameters(recurse=False))
            if own:
                found[f"{name}.param"] = reference(pooled(own))
                found[f"{name}.param_grad"] = reference(pooled(p.grad for p in own))
                self.copies[name] = [p.detach().clone() for p in own]

    def after_optimizer_step(self, step: int) -> None:
        for name, before in self.copies.items():
            own = list(self.modules[name].parameters(recurse=False))
            update = pooled(p - b for p, b in zip(own, before))
            stats = self.expected[step][f"{name}.update"] = reference(update)
            stats["ratio"] = (update.pow(2).mean().sqrt()
                              / pooled(before).pow(2).mean().sqrt()).item()
        self.copies = {}

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def check_series(series, expected, last_step):
    """Every logged step's series equal the float64 reference (the last step has no update)."""
    assert series.steps == sorted(expected), (series.steps, sorted(expected))
    for step, found in expected.items():
        for name, stats in found.items():
            key, _, kind = name.rpartition(".")
            for stat, value in stats.items():
                steps, values = series.get(key, stat, kind=kind)
                if kind == "update" and step == last_step:
                    continue
                assert step in steps, f"{name}.{stat}: step {step} not in the series {steps}"
                got = values[steps.index(step)]
                assert close(got, value, stat, stats), (
                    f"{name}.{stat} at step {step}: series {got!r}, float64 reference {value!r}")


def unpatched(model: torch.nn.Module) -> bool:
    return all("forward" not in vars(m) and not m._forward_hooks and not m._forward_pre_hooks
               for m in model.modules())


# -- Hugging Face Trainer ------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from fxdebug.monitoring.hf_callback import HFMonitorCallback  # noqa: E402

HF_NAMES = ["transformer.h.0.ln_1", "transformer.h.1.mlp.c_fc", "transformer.ln_f", "lm_head"]


class Tokens(torch.utils.data.Dataset):
    def __init__(self, count: int, length: int = 8, vocab: int = 32) -> None:
        self.ids = torch.randint(0, vocab, (count, length),
                                 generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                     use_cache=False, attn_implementation="eager", resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


class TruthCallback(transformers.TrainerCallback):
    """The reference of each optimizer step: the step's micro-batches run again eagerly.

    On a logged step the monitor runs an instrumented copy, inside which the submodules'
    forward hooks do not run; so the inputs of each training forward are kept (a pre-hook on
    the model, put on after the monitor's) and, before the optimizer steps (the parameters as in that forward), the
    model's own class forward runs them again with forward hooks on every submodule, and
    autograd.grad gives the outputs' gradients of the loss the Trainer backpropagated."""

    def __init__(self, model, truth: Truth, monitored: HFMonitorCallback, bf16: bool) -> None:
        self.model, self.truth, self.monitored, self.monitor_steps = model, truth, monitored, []
        self.bf16 = bf16  # the Trainer's mixed precision: its forwards run under autocast
        self.inputs: list[dict] = []
        self.handle = None

    def on_train_begin(self, args, state, control, **kwargs):
        # after the monitor attached: a hook already on the model would be in its copy too
        self.handle = self.model.register_forward_pre_hook(self._keep, with_kwargs=True)

    def _keep(self, module, args, kwargs):
        if torch.is_grad_enabled():
            self.inputs.append(dict(kwargs))

    def replay(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        kept: dict[str, list] = {name: [] for name in HF_NAMES}
        for kwargs in self.inputs:
            outs: list[torch.Tensor] = []
            handles = [self.model.get_submodule(name).register_forward_hook(
                lambda module, args, output: outs.append(output)) for name in HF_NAMES]
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
                    loss = type(self.model).forward(self.model, **kwargs).loss
            finally:
                for handle in handles:
                    handle.remove()
            if kwargs.get("num_items_in_batch") is None:  # the Trainer's scaling of the loss
                loss = loss / len(self.inputs)
            grads = torch.autograd.grad(loss, outs)  # no parameter's .grad is touched
            for name, out, grad in zip(HF_NAMES, outs, grads):
                kept[name].append((out.detach(), grad))
        self.inputs = []
        return kept

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.truth.before_optimizer_step(state.global_step, self.replay())
        self.monitor_steps.append(self.monitored.monitor.steps)  # after the monitor's step()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.truth.after_optimizer_step(state.global_step)


class LossTrainer(transformers.Trainer):
    """The Trainer, keeping the loss its training_step computes (what it adds to the logged loss)."""

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        self.micro_losses.append((self.state.global_step, loss.item()))
        return loss


def hf_train(tmp_path, model, callbacks, max_steps=6, max_grad_norm=1.0, **extra):
    args = transformers.TrainingArguments(**{
        **dict(output_dir=str(tmp_path / "out"), max_steps=max_steps, per_device_train_batch_size=2,
               gradient_accumulation_steps=2, report_to=[], save_strategy="no",
               logging_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=1e-2,
               max_grad_norm=max_grad_norm, seed=0), **extra})
    trainer = LossTrainer(model=model, args=args, train_dataset=Tokens(4 * max_steps),
                          callbacks=callbacks)
    trainer.micro_losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2 is traced part by part: fxdebug says so
        trainer.train()
    return trainer


class FirstForward(transformers.TrainerCallback):
    """The model's forward as the Trainer hands it over (accelerate's where it wrapped it)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.forward = vars(model).get("forward")


@pytest.mark.parametrize("mode", ["num_items_in_batch", "per_batch_mean", "bf16"])
def test_hf_trainer_series_equal_replay_and_parameter_copies(tmp_path, mode):
    model = tiny_gpt2()
    if mode == "per_batch_mean":  # the Trainer then divides each micro-batch's loss by their number
        model.accepts_loss_kwargs = False
    callback = HFMonitorCallback(every=EVERY, folder=tmp_path / "series", select=HF_NAMES)
    truth = Truth(model, HF_NAMES, hooked=[])
    watcher = TruthCallback(model, truth, callback, bf16=mode == "bf16")
    first = FirstForward()
    max_norm = 0.05
    trainer = hf_train(tmp_path, model, [first, callback, watcher], max_grad_norm=max_norm,
                       bf16=mode == "bf16")
    truth.remove()
    watcher.handle.remove()

    assert truth.steps == list(range(6)), truth.steps  # one on_pre_optimizer_step per step
    assert watcher.monitor_steps == [step + 1 for step in truth.steps]
    assert trainer.state.global_step == 6
    assert callback.monitor is None and callback.reports == []
    if mode == "bf16":  # accelerate's autocast wrapper, as the Trainer had put it
        assert first.forward is not None and vars(model).get("forward") is first.forward
        vars(model).pop("forward")
    assert unpatched(model)
    series = fxdebug.load_series(tmp_path / "series")
    check_series(series, truth.expected, last_step=5)

    # the parameter gradients are read after the Trainer clipped them to max_grad_norm
    for step in series.steps:
        norms = [series.get(key, "norm", kind="param_grad")[1][series.steps.index(step)]
                 for key in HF_NAMES]
        assert math.sqrt(sum(n * n for n in norms)) <= max_norm * (1 + 1e-5), norms

    # the loss: the sum of the losses the Trainer's training_step returned in the step
    per_step: dict[int, float] = {}
    for step, loss in trainer.micro_losses:
        per_step[step] = per_step.get(step, 0.0) + loss
    steps, losses = series.get("loss", "mean")
    assert steps == [0, 2, 4]
    for step, loss in zip(steps, losses):
        assert math.isclose(loss, per_step[step], rel_tol=1e-6), (step, loss, per_step[step])
    assert len({round(v, 3) for v in per_step.values()}) > 1  # the loss moved: it is trained


def test_hf_trainer_resumed_from_a_checkpoint_counts_on_from_its_global_step(tmp_path):
    seen: list[int] = []
    options = dict(every=3, callback=lambda step, values: seen.append(step),
                   select="transformer.ln_f")
    model = tiny_gpt2()
    hf_train(tmp_path, model, [HFMonitorCallback(**options)], max_steps=4,
             save_strategy="steps", save_steps=4)
    assert sorted(set(seen)) == [0, 3] and unpatched(model)
    del seen[:]
    model = tiny_gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=7, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, disable_tqdm=True, learning_rate=1e-2, seed=0)
    trainer = LossTrainer(model=model, args=args, train_dataset=Tokens(28),
                          callbacks=[HFMonitorCallback(**options)])
    trainer.micro_losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    assert trainer.state.global_step == 7
    assert sorted(set(seen)) == [6], seen  # steps 4, 5, 6 ran; 6 is logged (every 3 from 0)
    assert unpatched(model)


def test_hf_train_that_raises_is_detached_by_remove_or_the_next_train(tmp_path):
    class Fails(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                raise RuntimeError("planted")

    model = tiny_gpt2()
    callback = HFMonitorCallback(every=1, select="lm_head")
    with pytest.raises(RuntimeError, match="planted"):
        hf_train(tmp_path, model, [callback, Fails()], max_steps=3)
    assert "forward" in vars(model) and callback.monitor is not None  # no callback ran
    callback.remove()
    assert unpatched(model) and callback.monitor is None
    with pytest.raises(RuntimeError, match="planted"):
        hf_train(tmp_path, model, [callback, Fails()], max_steps=3)
    hf_train(tmp_path, model, [callback], max_steps=2)  # its on_train_begin detaches the last
    assert unpatched(model) and callback.monitor is None


def test_hf_callback_options_are_checked():
    with pytest.raises(FxdebugError, match=r"unknown option evry= \(did you mean every=\?\)"):
        HFMonitorCallback(evry=10)
    with pytest.raises(FxdebugError, match="model= is not an option"):
        HFMonitorCallback(model=torch.nn.Linear(2, 2))
    with pytest.raises(FxdebugError, match="end= must be None or an int above start=5"):
        HFMonitorCallback(start=5, end=5)
    with pytest.raises(FxdebugError, match="unknown stat"):
        HFMonitorCallback(stats=["rmss"])
    with pytest.raises(FxdebugError, match="callback= must be callable"):
        HFMonitorCallback(callback="print")


# -- Lightning Trainer -------------------------------------------------------------------------

LIGHTNING = [name for name in ("pytorch_lightning", "lightning.pytorch")
             if importlib.util.find_spec(name.partition(".")[0]) is not None]


def lightning_module(package: str, calls_self: bool):
    pl = importlib.import_module(package)

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8),
                                             torch.nn.GELU(), torch.nn.Linear(8, 1))
            self.losses: list[tuple[int, float]] = []

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self(x) if calls_self else self.model(x)
            loss = (out - y).pow(2).mean()
            self.losses.append((self.trainer.global_step, loss.item()))
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    return Tiny()


def batches(count: int = 24):
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(count * 3, 6, generator=generator)
    data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
    return torch.utils.data.DataLoader(data, batch_size=3)


def lightning_fit(package: str, module, callbacks, tmp_path, max_steps=6, accumulate=2):
    pl = importlib.import_module(package)
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path,
                         accumulate_grad_batches=accumulate, callbacks=callbacks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the dataloader does not have many workers", ...
        trainer.fit(module, batches())
    return trainer


LIGHTNING_NAMES = ["0", "1", "3"]


@pytest.mark.parametrize("package", LIGHTNING)
@pytest.mark.parametrize("calls_self", [True, False], ids=["self(x)", "self.model(x)"])
def test_lightning_series_equal_hooks_and_parameter_copies(tmp_path, package, calls_self):
    from fxdebug.monitoring.lightning_callback import LightningMonitorCallback
    pl = importlib.import_module(package)
    module = lightning_module(package, calls_self)
    callback = LightningMonitorCallback(module="model", every=EVERY, folder=tmp_path / "series")
    truth = Truth(module.model, LIGHTNING_NAMES, hooked=LIGHTNING_NAMES)

    class Watch(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            truth.before_optimizer_step(trainer.global_step)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if truth.copies:  # the optimizer stepped: global_step counts it now
                truth.after_optimizer_step(trainer.global_step - 1)

    trainer = lightning_fit(package, module, [callback, Watch()], tmp_path)
    truth.remove()
    assert truth.steps == list(range(6)) and trainer.global_step == 6
    assert callback.monitor is None and callback.reports == []
    assert unpatched(module)
    series = fxdebug.load_series(tmp_path / "series")
    check_series(series, {step: {f"{k}": v for k, v in found.items()}
                          for step, found in truth.expected.items()}, last_step=5)
    # the loss: the mean of the step's two training_step losses
    per_step: dict[int, list[float]] = {}
    for step, loss in module.losses:
        per_step.setdefault(step, []).append(loss)
    assert all(len(losses) == 2 for losses in per_step.values()), per_step
    steps, losses = series.get("loss", "mean")
    assert steps == [0, 2, 4]
    for step, loss in zip(steps, losses):
        assert math.isclose(loss, sum(per_step[step]) / 2, rel_tol=1e-6), (step, loss)


@pytest.mark.parametrize("package", LIGHTNING)
def test_lightning_forward_never_run_names_module_and_detaches(tmp_path, package):
    from fxdebug.monitoring.lightning_callback import LightningMonitorCallback
    module = lightning_module(package, calls_self=False)  # training_step calls self.model(x)
    callback = LightningMonitorCallback(every=EVERY)
    with pytest.raises(FxdebugError, match=r"step 0 is a logged step but it recorded nothing.*"
                                           r"pass module= naming the submodule it calls: one of "
                                           r"\['model'\]"):
        lightning_fit(package, module, [callback], tmp_path)
    assert callback.monitor is None and unpatched(module)  # on_exception detached it
    with pytest.raises(FxdebugError, match=r"module='modle' is not a submodule of Tiny; its "
                                           r"submodules are \['model'\]"):
        lightning_fit(package, module, [LightningMonitorCallback(module="modle")], tmp_path)
    assert unpatched(module)


@pytest.mark.parametrize("package", LIGHTNING)
def test_lightning_resumed_from_a_checkpoint_counts_on_from_its_global_step(tmp_path, package):
    from fxdebug.monitoring.lightning_callback import LightningMonitorCallback
    seen: list[int] = []
    options = dict(module="model", every=3, callback=lambda step, values: seen.append(step))
    module = lightning_module(package, calls_self=True)
    trainer = lightning_fit(package, module, [LightningMonitorCallback(**options)], tmp_path,
                            max_steps=4)
    trainer.save_checkpoint(tmp_path / "step4.ckpt")
    assert sorted(set(seen)) == [0, 3]
    del seen[:]
    module = lightning_module(package, calls_self=True)
    pl = importlib.import_module(package)
    trainer = pl.Trainer(max_steps=7, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, accumulate_grad_batches=2,
                         callbacks=[LightningMonitorCallback(**options)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, batches(), ckpt_path=tmp_path / "step4.ckpt")
    assert trainer.global_step == 7
    assert sorted(set(seen)) == [6], seen  # steps 4, 5, 6 ran; 6 is logged (every 3 from 0)
    assert unpatched(module)


@pytest.mark.parametrize("package", LIGHTNING)
def test_lightning_reports_are_kept_and_logged(tmp_path, package, caplog):
    from fxdebug.monitoring.lightning_callback import LightningMonitorCallback
    from fxdebug.monitoring.spikes import NonFinite

    module = lightning_module(package, True)
    plain_step = module.training_step

    def training_step(batch, batch_idx):  # step 3's batches overflow float32 in the LayerNorm
        x, y = batch
        if module.trainer.global_step == 3:
            x = x * 1e25
        return plain_step((x, y), batch_idx)
    module.training_step = training_step
    callback = LightningMonitorCallback(module="model", every=100, spikes=[NonFinite()])
    with caplog.at_level(logging.WARNING, logger="fxdebug.monitor"):
        lightning_fit(package, module, [callback], tmp_path, max_steps=4)
    assert [report.step for report in callback.reports] == [3]
    report = callback.reports[0]
    assert report.reproduced is True and report.first_nonfinite is not None
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "fxdebug.monitor"] == [("fxdebug.monitor", "WARNING", str(report))]


def test_lightning_callback_options_are_checked():
    if not LIGHTNING:
        pytest.skip("no Lightning package installed")
    from fxdebug.monitoring.lightning_callback import LightningMonitorCallback
    with pytest.raises(FxdebugError, match="module= is the attribute path"):
        LightningMonitorCallback(module=torch.nn.Linear(2, 2))
    with pytest.raises(FxdebugError, match="every= must be a positive int"):
        LightningMonitorCallback(every=-1)
    for package in LIGHTNING:
        assert isinstance(LightningMonitorCallback(), importlib.import_module(package).Callback)


# -- imports -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, missing, extra", [
    ("fxdebug.monitoring.hf_callback", "transformers", "pip install 'fxdebug[hf]'"),
    ("fxdebug.monitoring.lightning_callback", "pytorch_lightning", "pip install 'fxdebug[lightning]'"),
])
def test_import_without_the_library_names_the_pip_install(monkeypatch, name, missing, extra):
    monkeypatch.delitem(sys.modules, name, raising=False)
    for blocked in (missing, "lightning"):
        monkeypatch.setitem(sys.modules, blocked, None)  # import raises ImportError
    with pytest.raises(FxdebugError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        importlib.import_module(name)


def test_importing_a_callback_module_keeps_fxdebug_monitor_the_function():
    import fxdebug.monitoring.hf_callback  # noqa: F401
    assert callable(fxdebug.monitor) and fxdebug.monitor.__name__ == "monitor"
    net = torch.nn.Linear(2, 2)
    with fxdebug.monitor(net, every=1) as mon:
        mon.model(torch.ones(1, 2)).sum().backward()
        mon.step()
    assert mon.steps == 1 and unpatched(net)
