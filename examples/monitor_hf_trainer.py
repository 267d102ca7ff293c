"""Leave fxdebug's monitor on inside a Hugging Face Trainer: one callback, no loop of your own.

``HFMonitorCallback`` takes ``fxdebug.monitor``'s keyword arguments. When training starts it
attaches a monitor to the Trainer's model; at each optimizer step (after the gradient
accumulation's last micro-batch and the gradient clipping, before the optimizer steps) it
calls ``mon.step(loss)`` with the loss the Trainer computed; when training ends it detaches
it. Monitor step ``s`` is the Trainer's ``state.global_step == s``. A tiny GPT-2 with random
weights trains 8 steps on random tokens; the drift table lists the keys that moved most.
"""

import logging
import os
import tempfile
import warnings

import torch
import transformers

import fxdebug
from fxdebug.monitoring.hf_callback import HFMonitorCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, count, length=16, vocab=64):
        self.ids = torch.randint(0, vocab, (count, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
transformers.logging.set_verbosity_error()
logging.getLogger("fxdebug").setLevel(logging.ERROR)
config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                 use_cache=False, attn_implementation="eager", bos_token_id=0,
                                 eos_token_id=0)
model = transformers.GPT2LMHeadModel(config)  # random weights

with tempfile.TemporaryDirectory(prefix="fxdebug-") as folder:
    series_folder = os.path.join(folder, "series")
    callback = HFMonitorCallback(every=2, folder=series_folder)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(folder, "trainer"), max_steps=8, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, learning_rate=5e-3, report_to=[], save_strategy="no",
        logging_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=RandomTokens(32),
                                   callbacks=[callback])
    trainer.remove_callback(transformers.PrinterCallback)  # no metrics printed
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GPT-2 is traced part by part: fxdebug says so once
        trainer.train()

    series = fxdebug.load_series(series_folder)
    print(series.drift(kinds=("param",), limit=5).table())
    steps, losses = series.get("loss", "mean")
    print("loss at steps", steps, ":", ", ".join(f"{loss:.3f}" for loss in losses))

assert steps == [0, 2, 4, 6], steps  # one monitor step per optimizer step, logged every 2
assert "forward" not in vars(model) and callback.monitor is None  # the model as it was
print(f"ok: {len(steps)} logged steps of {trainer.state.global_step}, the loss recorded at each; "
      f"the model has its own forward back")
