"""``fxdebug check``: run passes one by one and check each stage against the one before.

    fxdebug check [MODEL] [--input SHAPE] [--pass NAME|FILE.py:FN|pkg.mod:FN ...]
                  [--rtol R] [--atol A] [--grads] [--train] [--seed 0]

Stage 0 is the model itself; stage N is pass N applied to a copy of stage
N-1 (parameters shared), checked against stage N-1 with
:func:`fxdebug.check_equivalence`. Each check prints its verdict table (the
first divergent node and its source line when it differs). Exit status 0 when
every pass kept the outputs, 1 when one did not (or on an error).
"""

from __future__ import annotations


from tabulate import tabulate

from ._common import BUILTIN_PASS_NAMES, add_model_arguments, load_pass, describe_inputs, model_and_inputs

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
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..analysis import check_equivalence
    from ..tracing import keyed_copy, trace
    names = args.passes or list(DEFAULT_PASSES)
    passes = [load_pass(name) for name in names]
    model, inputs = model_and_inputs(args)
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
          f"passes: {', '.join(p.name for p in passes)}")
    previous = model
    gm = trace(model)
    summary = []
    from ..runtime.progress import progress
    for index, step in progress(list(enumerate(passes, start=1)), desc="check passes",
                                unit="pass"):
        stage = keyed_copy(gm)
        try:
            result = step(stage)
        except Exception as exc:
            exc.add_note(f"fxdebug: raised by pass {step.name!r} (pass {index} of {len(passes)})")
            raise
        report = check_equivalence(previous, result.graph_module, *inputs, rtol=args.rtol,
                                   atol=args.atol, grads=args.grads, train=args.train)
        print(f"\n== pass {index}: {step.name} ({'modified' if result.modified else 'unchanged'}"
              f" graph), checked against {'the model' if index == 1 else 'the stage before'}")
        print(report.table())
        first = report.first_divergence
        summary.append([step.name, "yes" if result.modified else "no",
                        "ok" if report.ok else "DIFFERS",
                        f"{report.max_error:.3g}" if report.max_error else "0",
                        "-" if first is None else f"{first.key} ({first.location})"])
        previous = gm = result.graph_module
    print()
    print(tabulate(summary, headers=["pass", "modified", "equivalent", "max abs error",
                                     "first divergence"], disable_numparse=True))
    return 0 if all(row[2] == "ok" for row in summary) else 1
