"""``fxdebug compare``: two saved runs, key by key.

    fxdebug compare A B [--rtol R] [--atol A] [--run-a N] [--run-b N] [--wide]

A and B are folders written by ``fxdebug.save_records`` or
``fxdebug.instrument(model, save_to=...)`` (the latest run there, or run N).
Prints the verdict, the first divergent key with its op and file:line, and every
key with its error (:func:`fxdebug.compare_runs`). The ``first divergence:``
line stays one line whatever the terminal's width (the table is fitted), so
``grep "first divergence:"`` finds the key and its file:line. Exit status, as
``diff``: 0 when the runs agree, 1 when they differ, 2 for trouble (a missing
run, bad arguments, an error).
"""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "compare", help="compare two saved runs key by key; name the first that differs",
        description="Compare two saved runs (folders written by fxdebug.save_records or "
                    "instrument(..., save_to=)) key by key in execution order; print the first "
                    "divergent key with its op and source line, and every key's error.")
    parser.add_argument("a", metavar="A", help="a saved run's folder (the reference)")
    parser.add_argument("b", metavar="B", help="the other run's folder")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--atol", type=float, default=None,
                        help="absolute tolerance (default: the dtype's, as torch.testing)")
    parser.add_argument("--run-a", type=int, default=None, metavar="N",
                        help="run N of a save_to folder A (default: the latest)")
    parser.add_argument("--run-b", type=int, default=None, metavar="N",
                        help="run N of a save_to folder B (default: the latest)")
    parser.add_argument("--wide", action="store_true", help="every column, whatever the width")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..runs.compare_runs import compare_runs
    from ..runs.saved_runs import load_records
    report = compare_runs(load_records(args.a, run=args.run_a), load_records(args.b, run=args.run_b),
                          rtol=args.rtol, atol=args.atol)
    print(report.table(wide=args.wide or None))
    return 0 if report.ok else 1
