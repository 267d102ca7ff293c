"""``fxdebug dump [MODEL] FOLDER``: instrument the model and write it to a folder that round-trips.

``--standalone`` leaves fxdebug's nodes out: the folder then needs torch, not fxdebug.
"""

from __future__ import annotations

import os
import warnings

from ._common import add_model_arguments, capture_argument, describe_inputs, model_and_inputs


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "dump", help="write the instrumented model to a folder of plain Python files",
        description="Instrument MODEL and write it, its weights, random example inputs and "
                    "the outputs they give to FOLDER: run FOLDER/run.py to run and compare, "
                    "fxdebug debug FOLDER --break KEY to step through it in pdb.")
    add_model_arguments(parser)
    parser.add_argument("folder", help="folder to create (its parent must exist)")
    parser.add_argument("--capture", default="modules",
                        help="modules, all, comma-separated keys/globs, or none (default modules)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace FOLDER if it is an earlier dump")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="pickle submodules that cannot be written as code (loading the folder "
                             "then unpickles them with weights_only=False); default: refuse")
    parser.add_argument("--standalone", action="store_true",
                        help="leave out fxdebug's capture nodes, so the folder runs where "
                             "fxdebug is not installed (default: keep them; the folder then "
                             "imports fxdebug)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from ..dumping import dump
    from ..instrumenting import instrument
    model, inputs = model_and_inputs(args)
    capture = [] if args.capture == "none" else capture_argument(args.capture)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gm = instrument(model, capture=capture)
    for warning in caught:
        print(f"note: {warning.message}")
    dump(gm, *inputs, folder=args.folder, overwrite=args.overwrite,
         allow_pickled_modules=args.allow_pickle, standalone=args.standalone)
    print(f"{args.model}: {type(model).__name__}, input {describe_inputs(inputs)}, "
          f"capture={'none (standalone)' if args.standalone else args.capture}")
    run_py = os.path.join(args.folder, "run.py")
    print(f"wrote {args.folder}: python {run_py} runs it; "
          f"fxdebug debug {args.folder} --break KEY steps through it in pdb")
    if not args.standalone and capture != []:
        print("note: module.py keeps the capture nodes, which call fxdebug: the folder runs where "
              "fxdebug is installed; --standalone writes one that needs only torch")
    return 0
