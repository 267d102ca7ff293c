"""Leave a monitor on while a tiny GPT-2 trains; its drift table and its plot name the layer that grows.

One layer (``transformer.h.1.mlp.c_fc``) trains with a learning rate 50 times the
others': its weights grow step after step, and the activations after it with them, while
the loss (on random tokens) shows nothing: the slow drift that comes before a loss spike. ``fxdebug.monitor``
records every module's statistics every 5 steps of 50 into a folder (a JSON-lines file
per rank); the other 4 steps in 5 run the model as it is. ``fxdebug.load_series(folder)``
reads it back: ``.drift()`` lists the keys that moved most (``fxdebug series FOLDER`` on
the command line), ``.plot(png)`` draws them over the steps with the loss below (spike
steps the monitor replayed would be marked), and ``fxdebug.report(series, html)`` puts
the same on a self-contained page (``fxdebug series FOLDER --plot PNG --html HTML``). Everything is written in a temporary folder, removed
at the end.
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

with tempfile.TemporaryDirectory(prefix="fxdebug-") as scratch:
    folder = os.path.join(scratch, "series")
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
    print(f"{DRIFTING} update/param ratio:\n  {ratio[0]:.3g} at step {steps[0]}, "
          f"{ratio[-1]:.3g} at step {steps[-1]}")
    print()

    # The plot: the param rms of the 4 keys that moved most, the loss on an axis of its
    # own; chart_data() is what it draws (and what the HTML page shows), as plain data.
    shown = dict(kinds=("param",), limit=4)
    view = series.chart_data(**shown)
    for chart in view.charts:
        print(f"plotted, {chart.title}:")
        for line in chart.lines:
            print(f"  {line.label}: {line.values[0]:.4g} at step {line.steps[0]}, "
                  f"{line.values[-1]:.4g} at step {line.steps[-1]}")
    page = fxdebug.report(view, os.path.join(scratch, "series.html"))  # the same, as SVG
    print(f"series.html: {os.path.getsize(page)} bytes, self-contained (inline SVG)")
    try:
        png = series.plot(os.path.join(scratch, "drift.png"), **shown)
    except fxdebug.FxdebugError as exc:  # no matplotlib: pip install matplotlib
        print(f"no plot: {exc}")
    else:
        print(f"drift.png: {os.path.getsize(png)} bytes (in a temporary folder, removed "
              f"at the end)")

top = report.rows[0]
assert top.key == DRIFTING, f"expected {DRIFTING} to drift most, the table says {top.key}"
plotted = view.charts[0].lines[0].label
assert plotted == f"{DRIFTING}.param.rms", f"the plot's first line is {plotted}"
print(f"ok: {top.key} moved most (x{top.factor:.3g}, steps "
      f"{report.steps[0]}-{report.steps[1]}), first plotted")
