"""``fxdebug check``: run passes one by one and check each stage against the one before.

    fxdebug check [MODEL] [--input SHAPE] [--pass NAME|FILE.py:FN|pkg.mod:FN ...]
                  [--rtol R] [--atol A] [--grads] [--train] [--seed 0]
    fxdebug check [MODEL] --compiled [--backend NAME|FILE.py:FN|pkg.mod:FN] [--mode M]

Stage 0 is the model itself; stage N is pass N applied to a copy of stage
N-1 (parameters shared), checked against stage N-1 with
:func:`fxdebug.check_equivalence`. Each check prints its verdict table (the
first divergent node and its source line when it differs). Exit status 0 when
every pass kept the outputs, 1 when one did not, 2 for trouble (an error).

With ``--compiled`` it checks ``torch.compile(model, backend=NAME)`` against the
eager model instead (:func:`fxdebug.check_compiled`): graph breaks with their
source lines, and the first node the backend computes differently.
"""

from __future__ import annotations

import importlib

from ..errors import FxdebugError
from ._common import (BUILTIN_PASS_NAMES, add_model_arguments, describe_inputs, load_pass,
                      model_and_inputs)

DEFAULT_PASSES = ("capture",)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "check", help="run passes and check that each one keeps the outputs",
        description="Trace MODEL, run each --pass on a copy of the stage before, and check "
                    "every stage against the one before on the inputs; a stage that differs "
                    "names its first divergent node and source line.")
    add_model_arguments(parser)
    parser.add_argument("--pass", dest="passes", action="append", metavar="NAME",
                        help=f"a built-in pass ({', '.join(BUILTIN_PASS_NAMES)}) or your own as "
                             f"path/to/file.py:name or package.module:name (a Pass class or "
                             f"instance, or a function gm -> gm); repeat for several "
                             f"(default: {', '.join(DEFAULT_PASSES)})")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--grads", action="store_true",
                        help="also compare parameter gradients of sum(out.sum())")
    parser.add_argument("--train", action="store_true", help="run in training mode (default eval)")
    parser.add_argument("--compiled", action="store_true",
                        help="check torch.compile(model) against eager instead of passes: graph "
                             "breaks and the first node the backend computes differently")
    parser.add_argument("--backend", default="inductor", metavar="NAME",
                        help="with --compiled: a dynamo backend name, or your own backend "
                             "function as path/to/file.py:name or package.module:name "
                             "(default inductor)")
    parser.add_argument("--mode", default=None,
                        help="with --compiled: inductor's mode (e.g. max-autotune)")
    parser.add_argument("--dump", default=None, metavar="FOLDER",
                        help="with --compiled: write the smallest divergent piece to FOLDER")
    parser.set_defaults(run=run)


def load_backend(spec: str):
    """``--backend``: a dynamo backend name as it is, or ``file.py:name`` / ``package.module:name``."""
    if ":" not in spec:
        return spec
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        from .model_spec import _import_file
        module = _import_file(where)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise FxdebugError(f"--backend {spec!r}: cannot import {where!r}: {exc}.") from exc
    found = getattr(module, name, None)
    if not callable(found):
        raise FxdebugError(f"--backend {spec!r}: {where!r} has no function {name!r}; name a "
                           f"backend function (gm, example_inputs) -> callable defined there.")
    return found


def run_compiled(args) -> int:
    from ..compiled import check_compiled
    if args.passes:
        raise FxdebugError("--compiled checks torch.compile against eager and runs no passes; "
                           "drop --pass, or drop --compiled to check passes.")
    model, inputs = model_and_inputs(args)
    model.train(args.train)
    report = check_compiled(model, *inputs, backend=load_backend(args.backend), mode=args.mode,
                            rtol=args.rtol, atol=args.atol, grads=args.grads)
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}")
    print(report.table(wide=getattr(args, "wide", None)))
    if args.dump and report.first_divergence is not None:
        print(f"smallest divergent piece written to {report.dump(args.dump)}")
    return 0 if report.ok else 1


def run(args) -> int:
    if args.compiled:
        return run_compiled(args)
    from ..equivalence import check_equivalence
    from ..passes.base import graph_source, run_passes, unchanged_message
    from ..tracing import keyed_copy
    from ..frontend import trace
    from ..base.formatting import format_error
    from ..base.progress import progress
    from ..base.fit_to_width import fit_table, table_width
    names = args.passes or list(DEFAULT_PASSES)
    passes = [load_pass(name) for name in names]
    model, inputs = model_and_inputs(args)
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
          f"passes: {', '.join(p.name for p in passes)}")
    gm = trace(model)
    stages = [model, graph_source(gm)]  # the stage before (the model itself first), its code
    summary: list[list[str]] = []

    def check_stage(step, result) -> None:
        if result.modified:
            result.graph_module.recompile()
        if graph_source(result.graph_module) == stages[1]:
            print(f"warning: {unchanged_message(step.name, result.graph_module)}")
        report = check_equivalence(stages[0], result.graph_module, *inputs, rtol=args.rtol,
                                   atol=args.atol, grads=args.grads, train=args.train)
        print(f"\n== pass {len(summary) + 1}: {step.name} ("
              f"{'modified' if result.modified else 'unchanged'} graph), checked against "
              f"{'the model' if not summary else 'the stage before'}")
        print(report.table(wide=getattr(args, "wide", None)))
        first = report.first_divergence
        summary.append([step.name, "yes" if result.modified else "no",
                        "ok" if report.ok else "DIFFERS",
                        format_error(report.max_error or 0.0),
                        "-" if first is None else f"{first.key} ({first.location})"])
        if len(summary) < len(passes):  # the next pass edits the graph: keep this stage
            stages[:] = [keyed_copy(result.graph_module), graph_source(result.graph_module)]

    run_passes(gm, progress(passes, desc="check passes", unit="pass"), after_each=check_stage)
    print()
    print(fit_table(summary, ["pass", "modified", "equivalent", "max abs error",
                              "first divergence"], width=table_width(getattr(args, "wide", None)),
                    truncate=("pass", "first divergence")))
    return 0 if all(row[2] == "ok" for row in summary) else 1
