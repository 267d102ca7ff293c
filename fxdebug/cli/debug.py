"""``fxdebug debug FOLDER [--break KEY]``: run a dumped folder's run.py under pdb.

The folder comes from ``fxdebug dump`` / ``fxdebug.dump``; its breakpoints.json
maps node keys to lines of module.py. pdb starts with a breakpoint on each
``--break`` node's line (default: the first line of ``forward``) and runs to it:
the node's inputs are local variables there (``p layer1_0_relu.shape``), ``n``
runs the node, ``c`` runs on to the end, where run.py compares the results.
"""

from __future__ import annotations

import bdb
import builtins
import difflib
import json
import os
import sys

from ..errors import FxdebugError


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "debug", help="step through a dumped folder in pdb, stopped at a node's line",
        description="Run FOLDER/run.py under pdb with a breakpoint at the line of each --break "
                    "node in FOLDER/module.py (default: the first line of forward). This runs "
                    "the folder's Python code: open only folders you trust.")
    parser.add_argument("folder", help="a folder written by fxdebug dump")
    parser.add_argument("--break", dest="breaks", action="append", metavar="KEY", default=[],
                        help="node key (layer1.0.conv2) or module path (layer1.0: its first node); "
                             "repeat for several")
    parser.add_argument("--backward", action="store_true", help="run.py --backward")
    parser.set_defaults(run=run)


def _read_map(folder: str) -> dict:
    path = os.path.join(folder, "breakpoints.json")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, "run.py")):
        raise FxdebugError(f"{folder!r} is not a folder written by fxdebug dump (no run.py and "
                           f"breakpoints.json). Write one with: fxdebug dump [MODEL] FOLDER")
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def resolve(mapping: dict, key: str | None) -> tuple[int, str, dict | None]:
    """``(line, description, node entry)`` of a breakpoint for ``key`` (``None``: start of forward).

    >>> mapping = {"forward_line": 9, "nodes": {"conv1": {"line": 10, "op": "Conv2d",
    ...            "source": "net.py:4", "inputs": ["x"]}}}
    >>> resolve(mapping, "conv1")[:2]
    (10, "before node 'conv1' (Conv2d, net.py:4); its inputs are local variables: x")
    """
    nodes = mapping["nodes"]
    if key is None:
        return mapping["forward_line"] + 1, "at the first line of forward", None
    found = key if key in nodes else next((k for k in nodes if k.startswith(key + ".")), None)
    if found is None:
        close = difflib.get_close_matches(key, list(nodes), n=3, cutoff=0.5)
        hint = f" Close keys: {', '.join(map(repr, close))}." if close else ""
        raise FxdebugError(f"--break {key!r}: no node or module with that key in this dump.{hint} "
                           f"breakpoints.json lists every key.")
    entry = nodes[found]
    inputs = ", ".join(entry.get("inputs") or []) or "none"
    first = "" if found == key else f" (the first node of {key})"
    return entry["line"], (f"before node {found!r}{first} ({entry['op']}, {entry['source']}); "
                           f"its inputs are local variables: {inputs}"), entry


def run(args) -> int:
    import pdb

    folder = os.path.abspath(args.folder)
    mapping = _read_map(folder)
    module_py = os.path.join(folder, mapping.get("file", "module.py"))
    run_py = os.path.join(folder, "run.py")
    debugger = pdb.Pdb()
    debugger.clear_all_breaks()  # bdb shares breakpoints between instances: start from none
    for key in args.breaks or [None]:
        line, description, _ = resolve(mapping, key)
        error = debugger.set_break(module_py, line)
        if error:
            raise FxdebugError(f"pdb could not set a breakpoint at module.py:{line}: {error}")
        print(f"fxdebug: breakpoint at module.py:{line}, {description}", flush=True)
    debugger.rcLines.append("continue")  # run to the first breakpoint, not to run.py's line 1
    with open(run_py, encoding="utf-8") as handle:
        code = compile(handle.read(), run_py, "exec")
    namespace = {"__name__": "__main__", "__file__": run_py, "__builtins__": builtins}
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [run_py] + (["--backward"] if args.backward else [])
    sys.path.insert(0, folder)
    try:
        debugger.run(code, namespace)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except bdb.BdbQuit:
        pass
    finally:
        sys.argv[:], sys.path[:] = saved_argv, saved_path
        debugger.clear_all_breaks()
    print("fxdebug: the pdb session ended before run.py finished.", flush=True)
    return 1
