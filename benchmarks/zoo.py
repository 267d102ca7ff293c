"""The torchvision zoo through fxdebug: which front end, what ran eagerly, what was captured.

For every torchvision model of every family (classification, segmentation,
detection, video, optical_flow, quantization), random weights, eval mode, CPU,
at the smallest input it accepts:

1. an eager forward with a forward hook on every leaf module (a module without
   children) counts the leaf-module calls and gives the reference outputs;
2. ``fxdebug.trace(model, *inputs, frontend="auto")``: symbolic tracing with
   auto-leaf, else ``torch.export``, else the model traced part by part;
3. ``fxdebug.instrument`` and one forward: outputs compared with eager
   (``torch.equal``; "close" means within ``torch.allclose`` defaults only), and
   how many leaf-module calls have a captured key (``path`` / ``path_N`` for the
   N-th call, as hooks name them);
4. ``fxdebug.dump`` of the instrumented graph (of every traced part, with the
   inputs it was called with, for a partially traced model), imported back from
   the folder and run: outputs equal;
5. the seconds the row took (building the model not included).

Writes a markdown table, a summary per family and one line per gap to
``docs/zoo.md`` (``--out``). Timings on a shared machine are noisy.

Run (from the repository root)::

    python benchmarks/zoo.py                   # all 121 models: long (about an hour on 2 cores)
    python benchmarks/zoo.py --fast            # a fixed dozen, one per family and then some
    python benchmarks/zoo.py --only resnet18,raft_small --out /tmp/zoo.md
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
import warnings

import torch
import torchvision
from torchvision.models import get_model, list_models

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import fxdebug  # noqa: E402
from fxdebug.partial.trace_parts import is_partial, part_inputs, traced_parts  # noqa: E402

FAMILIES = {
    "classification": torchvision.models,
    "segmentation": torchvision.models.segmentation,
    "detection": torchvision.models.detection,
    "video": torchvision.models.video,
    "optical_flow": torchvision.models.optical_flow,
    "quantization": torchvision.models.quantization,
}

FAST = (
    ("classification", "resnet18"),
    ("classification", "mobilenet_v3_small"),
    ("classification", "squeezenet1_1"),
    ("classification", "regnet_x_400mf"),
    ("classification", "shufflenet_v2_x0_5"),
    ("classification", "efficientnet_b0"),
    ("segmentation", "lraspp_mobilenet_v3_large"),
    ("detection", "fasterrcnn_mobilenet_v3_large_320_fpn"),
    ("video", "r3d_18"),
    ("optical_flow", "raft_small"),
    ("quantization", "quantized_mobilenet_v2"),
    ("quantization", "quantized_shufflenet_v2_x0_5"),
)

# sizes tried in order until the eager model accepts the input
IMAGE_SIZES = (64, 96, 128, 160, 224, 299)
VIDEO_SIZES = ((4, 64), (8, 64), (8, 112), (16, 112), (16, 224))


@dataclasses.dataclass
class Row:
    family: str
    name: str
    input: str = ""
    frontend: str = ""
    eager: list = dataclasses.field(default_factory=list)  # [(path, why)]
    captured: int = 0
    leaf_calls: int = 0
    missing: list = dataclasses.field(default_factory=list)  # uncaptured leaf-call keys
    missing_why: list = dataclasses.field(default_factory=list)  # Records notes about them
    equal: str = ""
    dump: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def coverage(self) -> float:
        return 100.0 * self.captured / self.leaf_calls if self.leaf_calls else 100.0


# -- building ------------------------------------------------------------------------------
def _build(family: str, name: str) -> torch.nn.Module:
    kwargs = {"weights": None}
    if family == "detection":
        kwargs["weights_backbone"] = None
        if not name.startswith("ssd"):
            kwargs.update(min_size=128, max_size=160)  # the transform resizes to this
    if family == "quantization":
        kwargs["quantize"] = True
    if family == "segmentation":
        kwargs["weights_backbone"] = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_model(name, **kwargs).eval()


def _candidate_inputs(family: str):
    generator = torch.Generator().manual_seed(0)
    if family == "detection":
        yield "[3x64x80]", ([torch.rand(3, 64, 80, generator=generator)],)
    elif family == "optical_flow":
        for size in (64, 128, 224):
            yield (f"2 x 1x3x{size}x{size}", (torch.rand(1, 3, size, size, generator=generator),
                                               torch.rand(1, 3, size, size, generator=generator)))
    elif family == "video":
        for frames, size in VIDEO_SIZES:
            yield (f"1x3x{frames}x{size}x{size}",
                   (torch.randn(1, 3, frames, size, size, generator=generator),))
    else:
        for size in IMAGE_SIZES:
            yield f"1x3x{size}x{size}", (torch.randn(1, 3, size, size, generator=generator),)


def _leaf_names(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules() if name and not list(module.children())]


def _eager_with_hooks(model: torch.nn.Module, inputs: tuple):
    """Outputs and the keys of every leaf-module call (``path``, then ``path_1``...)."""
    calls: dict[str, int] = {}
    keys: list[str] = []
    handles = []
    for name in _leaf_names(model):
        def hook(_module, _inputs, _output, name=name):
            count = calls.get(name, 0)
            calls[name] = count + 1
            keys.append(name if count == 0 else f"{name}_{count}")
        handles.append(model.get_submodule(name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            output = model(*inputs)
    finally:
        for handle in handles:
            handle.remove()
    return output, keys


def _smallest_input(family: str, model: torch.nn.Module):
    last = None
    for text, inputs in _candidate_inputs(family):
        try:
            output, keys = _eager_with_hooks(model, inputs)
            return text, inputs, output, keys
        except Exception as exc:  # too small for this model: try the next size
            last = exc
    raise RuntimeError(f"no input size worked: {type(last).__name__}: {last}")


# -- comparing -----------------------------------------------------------------------------
def _flatten(value, prefix="out"):
    from fxdebug.runtime import flatten_tensors
    return dict(flatten_tensors(value, prefix))


def _compare(expected, got) -> str:
    a, b = _flatten(expected), _flatten(got)
    if list(a) != list(b):
        return f"NO: outputs {list(a)[:3]} vs {list(b)[:3]}"
    worst = 0.0
    for key in a:
        if a[key].shape != b[key].shape or a[key].dtype != b[key].dtype:
            return f"NO: {key} {tuple(a[key].shape)} vs {tuple(b[key].shape)}"
        if torch.equal(a[key], b[key]):
            continue
        if not torch.allclose(a[key].float(), b[key].float(), equal_nan=True):
            return f"NO: {key} differs by {float((a[key].float() - b[key].float()).abs().max()):.3g}"
        worst = max(worst, float((a[key].float() - b[key].float()).abs().max()))
    return "yes" if worst == 0.0 else f"close ({worst:.1g})"


def _captured(keys: list[str], rec) -> tuple[int, list[str]]:
    have = dict.fromkeys(key.split("/")[0] for key in rec.keys())
    missing = [key for key in keys if key not in have]
    return len(keys) - len(missing), missing


# -- dumping -------------------------------------------------------------------------------
def _round_trip(gm: torch.nn.Module, inputs: tuple, expected, workdir: str, name: str) -> str:
    folder = os.path.join(workdir, name)
    fxdebug.dump(gm, *inputs, folder=folder)
    sys.path.insert(0, workdir)
    try:
        loaded = importlib.import_module(name).load()
        with torch.no_grad():
            return _compare(expected, loaded(*inputs))
    finally:
        sys.path.remove(workdir)
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        shutil.rmtree(folder, ignore_errors=True)


def _dump_check(instrumented, inputs, expected, workdir: str, tag: str) -> str:
    if not hasattr(fxdebug, "dump"):
        return "n/a"
    if not is_partial(instrumented):
        return _round_trip(instrumented, inputs, expected, workdir, tag)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        arguments = part_inputs(instrumented, *inputs)
    results = []
    for index, (label, part) in enumerate(traced_parts(instrumented).items()):
        if label not in arguments:
            continue
        with torch.no_grad():
            reference = part(*arguments[label])
        verdict = _round_trip(part, arguments[label], reference, workdir, f"{tag}_part{index}")
        if verdict != "yes":
            return f"{label}: {verdict}"
        results.append(label)
    return f"yes ({len(results)} parts)"


# -- one model -----------------------------------------------------------------------------
def _eager_reasons(instrumented, gm) -> tuple[str, list]:
    if is_partial(gm):
        report = instrumented.fxdebug_partial
        return "parts", [(e.path or "(root)", f"{e.kind}" + (f" at {e.location}" if e.location
                                                            else "")) for e in report.eager]
    frontend = gm.meta.get("fxdebug_frontend", "fx")
    return frontend, [(path, reason) for path, reason in gm.meta.get("fxdebug_auto_leaves", ())]


def run_model(family: str, name: str, workdir: str, index: int = 0) -> Row:
    """One row of the zoo table; errors are caught and reported in the row."""
    row = Row(family, name)
    try:
        torch.manual_seed(0)
        model = _build(family, name)
        row.input, inputs, expected, keys = _smallest_input(family, model)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gm = fxdebug.trace(model, *inputs, frontend="auto")
            instrumented = fxdebug.instrument(gm)
            with torch.no_grad():
                output = instrumented(*inputs)
        row.frontend, row.eager = _eager_reasons(instrumented, gm)
        row.equal = _compare(expected, output)
        row.leaf_calls = len(keys)
        rec = fxdebug.records(instrumented)
        row.captured, row.missing = _captured(keys, rec)
        row.missing_why = [note for note in rec.notes
                           if any(note.startswith(key + "/") or note.startswith(key + ":")
                                  for key in row.missing)]
        try:
            row.dump = _dump_check(instrumented, inputs, expected, workdir, f"zoo{index}")
        except Exception as exc:
            row.dump = f"NO: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        row.seconds = time.perf_counter() - start
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}" if str(exc) else \
            type(exc).__name__
        traceback.print_exc()
    finally:
        gc.collect()
    return row


# -- the report ----------------------------------------------------------------------------
def _gap_lines(row: Row) -> list[str]:
    lines = []
    if row.error:
        lines.append(f"- `{row.name}`: failed: {row.error}")
        return lines
    if row.eager:
        listed = "; ".join(f"{path}: {why}" for path, why in row.eager)
        what = "ran eagerly" if row.frontend == "parts" else "traced as auto-leaves"
        lines.append(f"- `{row.name}`: {len(row.eager)} module(s) {what}: {listed}")
    if row.missing:
        shown = ", ".join(row.missing[:4]) + (", ..." if len(row.missing) > 4 else "")
        why = f": {'; '.join(row.missing_why[:2])}" if row.missing_why else ""
        lines.append(f"- `{row.name}`: {len(row.missing)} leaf-module call(s) not captured "
                     f"({shown}){why}")
    if row.equal != "yes":
        lines.append(f"- `{row.name}`: outputs equal to eager: {row.equal}")
    if not row.dump.startswith("yes") and row.dump != "n/a":
        cause = ""
        if "has no attribute '_parameters'" in row.dump:
            cause = (" (torch's quantized modules do not survive pickling: "
                     "pickle.loads(pickle.dumps(module)) fails the same way, and fxdebug.dump "
                     "pickles the leaf modules it cannot rebuild from code)")
        lines.append(f"- `{row.name}`: dump round-trip: {row.dump}{cause}")
    return lines


def render(rows: list[Row], command: str) -> str:
    out = ["# The torchvision zoo through fxdebug", "",
           f"Generated by `{command}` (torch {torch.__version__}, torchvision "
           f"{torchvision.__version__}, CPU, random weights, eval mode). Front end: `fx` = "
           f"symbolic tracing of the whole model, `export` = torch.export, `parts` = the "
           f"largest traceable submodules traced when first called, the rest eager "
           f"(fxdebug.partial). Captured: leaf-module calls (counted with forward hooks on "
           f"the eager model) with a captured key. Dump: the instrumented graph (each traced "
           f"part, for `parts`) written with fxdebug.dump, imported back and run. Seconds: "
           f"trace, instrument, run, dump and check, on a shared 2-core machine.", "",
           "## Summary", "",
           "| family | models | fully traced | instrumented | outputs equal | dumped | "
           "captured calls (min) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for family in FAMILIES:
        group = [row for row in rows if row.family == family]
        if not group:
            continue
        ok = [row for row in group if not row.error]
        full = sum(row.frontend in ("fx", "export") and not row.eager for row in ok)
        equal = sum(row.equal == "yes" for row in ok)
        dumped = sum(row.dump.startswith("yes") for row in ok)
        low = min((row.coverage for row in ok), default=0.0)
        out.append(f"| {family} | {len(group)} | {full} | {len(ok)} | {equal} | {dumped} | "
                   f"{low:.0f}% |")
    out += ["", "## Models", "",
            "| family | model | input | front end | eager / auto-leaf modules | captured / "
            "leaf calls | outputs equal | dump round-trip | seconds |",
            "|---|---|---|---|---:|---:|---|---|---:|"]
    for row in rows:
        if row.error:
            out.append(f"| {row.family} | {row.name} | {row.input or '-'} | - | - | - | "
                       f"error | - | - |")
            continue
        out.append(f"| {row.family} | {row.name} | {row.input} | {row.frontend} | "
                   f"{len(row.eager)} | {row.captured}/{row.leaf_calls} ({row.coverage:.0f}%) | "
                   f"{row.equal} | {row.dump} | {row.seconds:.1f} |")
    gaps = [line for row in rows for line in _gap_lines(row)]
    out += ["", "## Gaps (one line each)", ""] + (gaps or ["None."])
    return "\n".join(out) + "\n"


def selected(args) -> list[tuple[str, str]]:
    if args.fast:
        return list(FAST)
    every = [(family, name) for family, module in FAMILIES.items()
             for name in list_models(module=module)]
    if args.only:
        wanted = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in wanted if name not in {n for _, n in every}]
        if unknown:
            raise SystemExit(f"unknown model(s): {', '.join(unknown)}")
        return [(family, name) for family, name in every if name in wanted]
    if args.family:
        return [(family, name) for family, name in every if family in args.family.split(",")]
    return every


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="the fixed dozen of the tests")
    parser.add_argument("--only", help="comma-separated model names")
    parser.add_argument("--family", help="comma-separated families")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "zoo.md"))
    args = parser.parse_args(argv)
    logging.getLogger("torch").setLevel(logging.ERROR)  # torch.export's notes on failures
    shown, skip = [], False
    for arg in argv if argv is not None else sys.argv[1:]:
        if skip or arg.startswith("--out"):
            skip = arg == "--out" and not skip  # the value of --out is not shown either
            continue
        shown.append(arg)
    command = " ".join(["python benchmarks/zoo.py", *shown])
    rows = []
    workdir = tempfile.mkdtemp(prefix="fxdebug_zoo_")
    threads = torch.get_num_threads()  # given back after: tests call main() in their own process
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    try:
        from fxdebug.base.progress import progress
        models = list(selected(args))
        for index, (family, name) in progress(list(enumerate(models)), desc="zoo", unit="model"):
            row = run_model(family, name, workdir, index)
            rows.append(row)
            print(f"{family:>14} {name:<40} {row.frontend or 'ERROR':<7} "
                  f"eager={len(row.eager):<2} captured={row.captured}/{row.leaf_calls} "
                  f"equal={row.equal} dump={row.dump} {row.seconds:.1f}s {row.error}",
                  flush=True)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(workdir, ignore_errors=True)
    text = render(rows, command)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        handle.write(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
