"""``fxdebug passes``: run built-in passes and print what each one changed.

With ``--check`` each stage is also checked against the one before: exit status
1 when one differs (0 when all agree, 2 for trouble).
"""

from __future__ import annotations

from ._common import (add_model_arguments, add_pass_arguments, built_in_passes, describe_inputs,
                      model_and_inputs)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "passes", help="run passes and print each pass's diff",
        description="Trace MODEL, run the named passes in order and print, for each, the nodes "
                    "it added (+), removed (-) and changed (~).")
    add_model_arguments(parser)
    add_pass_arguments(parser)
    parser.add_argument("--code", action="store_true",
                        help="print unified diffs of the generated code instead of node tables")
    parser.add_argument("--check", action="store_true",
                        help="also check each stage against the one before on the inputs")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..errors import PassEquivalenceError
    from ..pass_manager import PassManager
    passes = built_in_passes(args.passes)
    model, inputs = model_and_inputs(args)
    manager = PassManager(passes, check_inputs=inputs if args.check else None)
    differs = None
    try:
        report = manager.run(model).report
    except PassEquivalenceError as exc:  # what --check looks for: a difference (1), no trouble
        report, differs = exc.report, exc
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
          f"passes: {', '.join(p.name for p in passes)}")
    for stage in report.stages[1:]:
        change = stage.diff
        if change is None:  # only the input stage has no diff
            continue
        print(f"\n== pass {stage.name}: {change.summary()}")
        print(change.code_diff() if args.code else change.table(wide=args.wide))
    print()
    print(report.table())
    if differs is not None:
        print(f"\npass {differs.pass_name!r} changed what the module computes; the passes after "
              f"it did not run")
        equivalence = report.stages[-1].equivalence
        if equivalence is not None:
            print(equivalence.table(wide=args.wide))
        return 1
    return 1 if report.ok is False else 0
