"""Arguments every subcommand shares: the model, its inputs and the seed."""

from __future__ import annotations

import argparse

from .model_spec import DEFAULT_INPUT, DEFAULT_MODEL, _import_file, _import_module, load_model, make_inputs

# Names of fxdebug.passes.BUILTIN_PASSES, spelled out so that `fxdebug --help` and argument
# errors need no torch import (tests/test_first_minutes.py checks they agree).
BUILTIN_PASS_NAMES = ("capture", "grads", "breakpoint", "functionalize", "checkpoint")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``MODEL``, ``--input`` and ``--seed``."""
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"package.module:factory or path/to/file.py:factory "
                             f"(default {DEFAULT_MODEL}, random weights)")
    parser.add_argument("--input", action="append", metavar="SHAPE[:DTYPE]",
                        help=f"input shape, e.g. 1,3,224,224 or 1,16:int64; repeat for several "
                             f"inputs (default {DEFAULT_INPUT})")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs (default 0)")
    parser.add_argument("--wide", action="store_true",
                        help="print every table column in full (default: fit the terminal; "
                             "output to a file or pipe is always in full unless COLUMNS is set)")


def model_and_inputs(args) -> tuple:
    """Build the model (eval mode, seeded) and its inputs from parsed arguments."""
    import torch
    torch.manual_seed(args.seed)
    model, inputs = load_model(args.model)
    if inputs is None or args.input:
        inputs = make_inputs(args.input or [DEFAULT_INPUT], seed=args.seed)
    return model, inputs


def describe_inputs(inputs) -> str:
    import torch

    from ..base.formatting import shape_text
    return ", ".join(shape_text(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                     for t in inputs)


def capture_argument(text: str):
    """``modules``/``all`` as they are, anything else as a comma-separated list of keys/globs."""
    if text in ("modules", "all"):
        return text
    return [part.strip() for part in text.split(",") if part.strip()]


def add_pass_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--pass NAME`` (repeatable), naming built-in passes."""
    parser.add_argument("--pass", dest="passes", action="append", metavar="NAME",
                        help=f"a pass to run, in order: a built-in one "
                             f"({', '.join(BUILTIN_PASS_NAMES)}) or your own as "
                             f"path/to/file.py:name or package.module:name (a Pass class or "
                             f"instance, or a function gm -> gm); repeat for several")


def built_in_passes(names) -> list:
    """Instances of the named built-in passes; an unknown name lists the known ones."""
    from ..errors import FxdebugError
    from ..passes import BUILTIN_PASSES
    if not names:
        raise FxdebugError(f"name at least one pass with --pass NAME; built-in passes: "
                           f"{', '.join(BUILTIN_PASSES)}.")
    return [load_pass(name) for name in names]


def load_pass(spec: str):
    """A pass from ``--pass``: a built-in name, or ``file.py:name`` / ``package.module:name``."""
    from ..errors import FxdebugError
    from ..passes import BUILTIN_PASSES, Pass, as_pass
    if ":" not in spec:
        if spec not in BUILTIN_PASSES:
            raise FxdebugError(f"--pass {spec!r} is not a built-in pass; choose from "
                               f"{', '.join(BUILTIN_PASSES)}, or name your own as "
                               f"path/to/file.py:name or package.module:name.")
        return BUILTIN_PASSES[spec]()
    where, _, name = spec.rpartition(":")
    if where.endswith(".py"):
        module = _import_file(where, "pass")
    else:
        try:
            module = _import_module(where)
        except ImportError as exc:
            raise FxdebugError(f"--pass {spec!r}: cannot import {where!r}: {exc}.") from exc
    found = getattr(module, name, None)
    if found is None:
        raise FxdebugError(f"--pass {spec!r}: {where!r} has no {name!r}; name a Pass class, a "
                           f"Pass instance or a function gm -> gm defined there.")
    if isinstance(found, type) and issubclass(found, Pass):
        return found()
    step = as_pass(found)
    if step.name == "<lambda>":
        step.name = name
    return step
