"""Leave a monitor on while a tiny GPT-2 trains; its drift table names the layer that grows.

One layer (``transformer.h.1.mlp.c_fc``) trains with a learning rate 50 times the
others': its weights grow step after step, and the activations after it with them, while
the loss still falls: the slow drift that comes before a loss spike. ``fxdebug.monitor`` records every
module's statistics every 5 steps into a folder (a JSON-lines file per rank); the
other 4 steps in 5 run the model as it is. ``fxdebug.load_series(folder).drift()`` (or
``fxdebug series FOLDER`` on the command line) lists the keys that moved most.
"""

import os
import tempfile
import warnings

import torch
import transformers

import fxdebug

DRIFTING = "transformer.h.1.mlp.c_fc"

torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=32,
                                 use_cache=False, attn_implementation="eager")
model = transformers.GPT2LMHeadModel(config)  # random weights
fast = [p for name, p in model.named_parameters() if name.startswith(DRIFTING)]
rest = [p for name, p in model.named_parameters() if not name.startswith(DRIFTING)]
optimizer = torch.optim.AdamW([{"params": rest, "lr": 1e-3}, {"params": fast, "lr": 5e-2}],
                              weight_decay=0.0)

folder = os.path.join(tempfile.mkdtemp(prefix="fxdebug-"), "series")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # GPT-2 is traced part by part: fxdebug says so once
    with fxdebug.monitor(model, every=5, folder=folder) as mon:
        for step in range(50):
            tokens = torch.randint(0, 64, (4, 16))
            loss = mon.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            mon.step(loss)  # after backward, before optimizer.step()
            optimizer.step()
            optimizer.zero_grad()

series = fxdebug.load_series(folder)
report = series.drift(kinds=("param",), limit=5)  # the weights that moved most
print(report.table())
print()
print(series.drift(kinds=("out",), limit=5).table())  # the activations: it and what follows
steps, ratio = series.get(DRIFTING, "ratio", kind="update")
print(f"{DRIFTING} update/param ratio: {ratio[0]:.3g} at step {steps[0]}, "
      f"{ratio[-1]:.3g} at step {steps[-1]}")

try:
    from matplotlib.figure import Figure  # no pyplot: the backend stays as it was
except ImportError:
    Figure = None
if Figure is not None:
    figure = Figure(figsize=(6, 3.5))
    axes = figure.add_subplot()
    for row in report.rows[:4]:
        axes.plot(*series.get(row.key, "rms", kind=row.kind), label=f"{row.key} ({row.kind})")
    axes.set_xlabel("step")
    axes.set_ylabel("rms")
    axes.set_yscale("log")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(os.path.join(folder, "drift.png"))
    print(f"plot: {os.path.join(folder, 'drift.png')}")

top = report.rows[0]
assert top.key == DRIFTING, f"expected {DRIFTING} to drift most, the table says {top.key}"
print(f"ok: {top.key} drifted most ({top.kind} rms x{top.factor:.3g} over steps "
      f"{report.steps[0]}-{report.steps[1]})")
