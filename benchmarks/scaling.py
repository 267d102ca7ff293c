"""Scaling: a 10k-node graph through fxdebug's front end, and dumps against ``to_folder``.

Two measurements, each in one process with interleaved repeats (medians):

1. A chain of ``--pairs`` ``Linear(8, 8)`` + ``ReLU`` modules (5000 pairs: 10k
   nodes). ``fxdebug.trace`` + ``fxdebug.instrument`` + ``fxdebug.diff`` (traced
   against instrumented) + ``fxdebug.print_tabular`` of the result, against
   ``torch.fx.symbolic_trace`` of the same model; then each stage alone. Both
   run with Python's garbage collector as the user left it (fxdebug never
   pauses it: the user's code runs during a trace).
2. ``fxdebug.dump`` (annotated code, weights, example inputs and outputs,
   run.py) against ``torch.fx.GraphModule.to_folder`` (code and weights), on
   resnet50 and on the chain, both writing to a fresh temporary folder.
3. A large Hugging Face decoder config (``LlamaConfig``, ``--hf-layers`` 48
   layers, hidden size 64, random weights, built from the config: nothing is
   downloaded): ``fxdebug.instrument(model)``, and with its first call (a model
   fx cannot trace whole is traced part by part on that call), against
   ``torch.fx.symbolic_trace`` (HF's ``transformers.utils.fx.symbolic_trace``
   where plain fx fails and transformers ships it) and ``torch.export.export``;
   a front end that fails is a row saying how. Each variant runs once untimed,
   then ``--hf-repeats`` times.

Run (from the repository root)::

    python benchmarks/scaling.py            # 5000 pairs, resnet50, 3 repeats
    python benchmarks/scaling.py --quick    # 1000 pairs, resnet18, 1 repeat
    python benchmarks/scaling.py --only dump --repeats 7   # the dumps alone
    python benchmarks/scaling.py --only hf                 # the HF decoder alone
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
import warnings

import torch
import torchvision
from _common import header, interleaved, median, parse_args, table

import fxdebug


def chain(pairs: int) -> torch.nn.Sequential:
    layers = []
    for _ in range(pairs):
        layers += [torch.nn.Linear(8, 8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def front_end(model):
    def run():
        gm = fxdebug.trace(model)
        instrumented = fxdebug.instrument(gm)
        fxdebug.diff(gm, instrumented)
        fxdebug.print_tabular(instrumented, file=io.StringIO())
    return run


def stages(model):
    gm = fxdebug.trace(model)
    instrumented = fxdebug.instrument(gm)
    return {
        "  fxdebug.trace": lambda: fxdebug.trace(model),
        "  fxdebug.instrument (traced input)": lambda: fxdebug.instrument(gm),
        "  fxdebug.diff": lambda: fxdebug.diff(gm, instrumented),
        "  fxdebug.print_tabular": lambda: fxdebug.print_tabular(instrumented, file=io.StringIO()),
    }


def dumps(label, model, x, root):
    gm = fxdebug.trace(model)
    plain = torch.fx.symbolic_trace(model)
    def fresh(name):
        return os.path.join(tempfile.mkdtemp(dir=root), name)

    def to_folder():
        plain.to_folder(fresh("tofolder"), "Model")

    def dump():
        fxdebug.dump(gm, x, folder=fresh("dump"))
    return {f"torch to_folder, {label}": to_folder, f"fxdebug.dump, {label}": dump}


def hf_decoder(layers: int):
    """A Llama decoder of ``layers`` layers from its config (random weights), its input, and a
    line saying what it is."""
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256,
                                      max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    label = f"Llama {layers} layers (transformers {transformers.__version__})"
    return model, torch.randint(0, 256, (1, 16)), label


def _hf_fx():
    """HF's own fx tracer, or None where transformers no longer ships it (5.x)."""
    try:
        from transformers.utils.fx import symbolic_trace
    except ImportError:
        return None
    return symbolic_trace


def hf_rows(args) -> list[list[str]]:
    """fxdebug.instrument on a large HF decoder beside torch.fx and torch.export."""
    model, x, label = hf_decoder(12 if args.quick else args.hf_layers)

    def instrumented_and_called():
        fxdebug.instrument(model)(x)

    candidates = {"torch.fx.symbolic_trace": lambda: torch.fx.symbolic_trace(model)}
    hf_fx = _hf_fx()
    if hf_fx is not None:
        candidates["transformers.utils.fx.symbolic_trace"] = \
            lambda: hf_fx(model, input_names=["input_ids"])
    candidates.update({"torch.export.export": lambda: torch.export.export(model, (x,)),
                       "fxdebug.instrument": lambda: fxdebug.instrument(model),
                       "fxdebug.instrument + first call": instrumented_and_called,
                       "eager forward": lambda: model(x)})
    variants, rows = {}, []
    for name, call in candidates.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                call()
            variants[name] = call
        except Exception as exc:  # a front end that cannot take the model: said, not timed
            rows.append([f"{name}, {label}", "", "", f"fails: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:60]}", ""])
    if hf_fx is None:
        rows.append([f"transformers.utils.fx.symbolic_trace, {label}", "", "",
                     "not shipped by this transformers", ""])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        times = interleaved(variants, repeats=args.hf_repeats, warmup=0)  # each ran once above
    base = "torch.export.export" if "torch.export.export" in times else next(iter(times))
    for name, t in times.items():
        rows.append([f"{name}, {label}", f"{median(t) * 1e3:.0f}",
                     f"{(max(t) - min(t)) * 1e3:.0f}",
                     f"{median(t) / median(times[base]):.2f}x", base])
    return rows


def run(args) -> list[list[str]]:
    """The rows of the table (also used by benchmarks/run.py)."""
    pairs = 1000 if args.quick else args.pairs
    model = chain(pairs).eval()
    rows = []
    only = getattr(args, "only", "all")
    if only == "hf":
        return hf_rows(args)
    with torch.no_grad():
        variants = {"torch.fx.symbolic_trace": lambda: torch.fx.symbolic_trace(model),
                    "fxdebug trace+instrument+diff+tabular": front_end(model), **stages(model)}
        times = interleaved(variants, repeats=args.repeats, warmup=args.warmup) if only != "dump" else {}
        for label, t in times.items():
            base = median(times["torch.fx.symbolic_trace"])
            rows.append([f"{label} ({2 * pairs} nodes)" if not label.startswith(" ") else label,
                         f"{median(t) * 1e3:.0f}", f"{(max(t) - min(t)) * 1e3:.0f}",
                         f"{median(t) / base:.2f}x", "symbolic_trace"])
        if only == "front":
            return rows
        vision = "resnet18" if args.quick else "resnet50"
        root = tempfile.mkdtemp(prefix="fxdebug-scaling-")
        try:
            for label, model_, x in (
                    (vision, torchvision.models.get_model(vision, weights=None).eval(),
                     torch.randn(1, 3, 64, 64)),
                    (f"chain {2 * pairs} nodes", model, torch.randn(1, 8))):
                variants = dumps(label, model_, x, root)
                times = interleaved(variants, repeats=args.repeats, warmup=args.warmup)
                base = times[f"torch to_folder, {label}"]
                for name, t in times.items():
                    ratios = [mine / theirs for mine, theirs in zip(t, base)]  # same round
                    rows.append([name, f"{median(t) * 1e3:.0f}", f"{(max(t) - min(t)) * 1e3:.0f}",
                                 f"{median(t) / median(base):.2f}x (min {min(ratios):.2f}x)",
                                 "to_folder"])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows + (hf_rows(args) if only == "all" else [])


HEADERS = ["variant", "median ms", "spread ms", "ratio", "ratio to"]


def _options(parser) -> None:
    parser.add_argument("--pairs", type=int, default=5000)
    parser.add_argument("--only", choices=("all", "front", "dump", "hf"), default="all",
                        help="front: the 10k-node front end alone; dump: the dumps alone; hf: "
                             "the HF decoder alone")
    parser.add_argument("--hf-layers", type=int, default=48,
                        help="decoder layers of the HF Llama config (default 48)")
    parser.add_argument("--hf-repeats", type=int, default=1,
                        help="timed calls of each HF variant after one untimed (default 1: "
                             "the part-by-part first call takes tens of seconds)")


def main():
    args = parse_args(__doc__, input="1,8", repeats=3, warmup=1, quick=("1,8", 1),
                      extra=_options)
    print(header(args))
    print(table(run(args), HEADERS))


if __name__ == "__main__":
    main()
