"""The dumped folder's own small runtime: run.py carries a copy of these functions.

run.py must run where fxdebug is not installed, so :func:`fxdebug.dump` writes
the source of every function here into it (``inspect.getsource``), with the
functions of :mod:`fxdebug.runtime.values` they call: the nested-value walker and
the one default loss, :func:`~fxdebug.runtime.values.outputs_loss` (their source
too, parameter annotations left out, with :func:`children` here in place of the
walker's: run.py uses no private torch name, so it opens containers without
torch's pytree); fxdebug itself uses the same functions to record what the folder
must reproduce.
"""

import ast
import inspect
import textwrap
import types

import torch

from ..base.formatting import TOLERANCES
from ..runtime import values
from ..runtime.values import WALKER_FUNCTIONS, named_leaves, outputs_loss
from . import numeric_settings

__all__ = ["flatten_outputs", "first_line", "tolerance", "GRADIENT_SCALE", "SPREAD_SCALE",
           "NONDETERMINISTIC_RUNS",
           "TOLERANCES", "nonfinite_text", "compare_tensor", "compare", "spread_of", "run_py_source",
           "carried_functions", "plain_source"]


_opened_here = WALKER_FUNCTIONS[1]  # the walker's own opening of a container pytree keeps whole


def children(value):
    """run.py's walker step: one level of a nested value without torch's pytree.

    Tuples, lists, dicts (``transformers``' ModelOutput too: its items are the
    values pytree gives), namedtuples, dataclasses and slices are opened as
    fxdebug's walker opens them; an object of another class pytree knows is a
    leaf here (run.py then says its outputs are missing, never compares wrongly).

    >>> children({"a": 1}), children((5,)), children(3)
    ([('a', 1)], [('0', 5)], None)
    """
    if isinstance(value, (torch.Tensor, str, int, float, type(None))):
        return None
    if isinstance(value, dict):
        return [(str(key), item) for key, item in value.items()]
    return _opened_here(value)


def flatten_outputs(value, prefix="output"):
    """Flatten a (nested) output into ``{"output/0/logits": tensor, ...}``; other leaves kept if simple.

    >>> list(flatten_outputs((torch.ones(1), {"b": 2, "c": object()})))
    ['output/0', 'output/1/b']
    """
    return {key: leaf for key, leaf in named_leaves(value, prefix)
            if leaf is None or isinstance(leaf, (torch.Tensor, bool, int, float, str))}


def first_line(exc):
    """The first line of an exception's message (what run.py compares for a failing backward).

    >>> first_line(RuntimeError("broken\\ndetails"))
    'broken'
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def tolerance(want, scaled, spread=0.0):
    """``(rtol, atol)`` for comparing with ``want``: torch.testing.assert_close's for its dtype
    (:data:`~fxdebug.base.formatting.TOLERANCES`; run.py carries the table as a literal).

    ``scaled`` (gradients) adds ``GRADIENT_SCALE * rtol * max|want|`` to atol: a
    gradient sums many terms, and the order of that sum (it changes with the
    number of threads, the machine, the BLAS) moves every element by a few
    roundings of the largest one, however small the element itself is. The
    largest *finite* element: NaN and Inf (a NaN repro's gradients) are
    compared by place, not by size.

    ``spread`` (where torch does not promise the same bits twice: CUDA without
    deterministic algorithms) adds ``SPREAD_SCALE * spread``: ``spread`` is the
    largest difference between run.py's own runs of the same tensor.

    >>> tolerance(torch.tensor([1.0, -50.0]), scaled=True)
    (1.3e-06, 0.00027)
    >>> tolerance(torch.tensor([1.0, -50.0, float("nan"), float("inf")]), scaled=True)
    (1.3e-06, 0.00027)
    >>> tolerance(torch.tensor([1.0, -50.0]), scaled=True, spread=1e-4)
    (1.3e-06, 0.00067)
    """
    rtol, atol = TOLERANCES.get(want.dtype, (0.0, 0.0))
    finite = want[torch.isfinite(want)] if want.is_floating_point() or want.is_complex() else want
    if scaled and finite.numel() and (rtol or atol):
        atol += GRADIENT_SCALE * rtol * finite.abs().max().item()
    atol += SPREAD_SCALE * spread
    return rtol, float(f"{atol:.2g}")


GRADIENT_SCALE = 4
SPREAD_SCALE = 4
NONDETERMINISTIC_RUNS = 3  # run.py's runs where torch does not promise the same bits twice


def nonfinite_text(want):
    """``"2 NaN, 1 Inf"`` for the non-finite elements of ``want`` (``""`` when none).

    >>> nonfinite_text(torch.tensor([1.0, float("nan"), float("-inf")]))
    '1 NaN, 1 Inf'
    """
    if not (want.is_floating_point() or want.is_complex()):
        return ""
    nan, inf = int(torch.isnan(want).sum()), int(torch.isinf(want).sum())
    return ", ".join(f"{n} {word}" for n, word in ((nan, "NaN"), (inf, "Inf")) if n)


def compare_tensor(want, have, scaled=False, spread=0.0):
    """The verdict for one tensor: ``"equal"``, ``"close (...)"`` or ``"DIFFERENT (...)"``.

    NaN and Inf are compared by place (a NaN where a NaN was, the same Inf),
    the finite elements by value; a difference is never printed as NaN.

    >>> compare_tensor(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, float("nan")]))
    'equal (1 NaN at the same places)'
    >>> compare_tensor(torch.tensor([1.0, float("nan")]), torch.tensor([1.0, 2.0]))
    'DIFFERENT (1 NaN expected, none got: not at the same places)'
    """
    if have.shape != want.shape or have.dtype != want.dtype:
        return (f"DIFFERENT (shape {tuple(have.shape)} {have.dtype}, "
                f"expected {tuple(want.shape)} {want.dtype})")
    if torch.equal(have, want):
        return "equal"
    floating = want.is_floating_point() or want.is_complex()
    same_places = ""
    if floating:
        bad_want, bad_have = ~torch.isfinite(want), ~torch.isfinite(have)
        expected, got = nonfinite_text(want), nonfinite_text(have)
        if expected or got:
            inf = torch.isinf(want)
            if not torch.equal(bad_want, bad_have) or not torch.equal(have[inf], want[inf]):
                return (f"DIFFERENT ({expected or 'no NaN/Inf'} expected, {got or 'none'} got: "
                        f"not at the same places)")
            same_places = f"{expected} at the same places"
            want, have = want[~bad_want], have[~bad_want]
            if torch.equal(have, want):
                return f"equal ({same_places})"
    wide = torch.complex128 if want.is_complex() else torch.float64  # complex keeps its imaginary part
    diff = (have.to(wide) - want.to(wide)).abs().max().item() if want.numel() else 0.0
    rtol, atol = tolerance(want, scaled, spread)
    figures = f"max abs diff {diff:.3g}; rtol {rtol:.2g}, atol {atol:.2g}"
    figures += f"; {same_places}" if same_places else ""
    if floating and torch.allclose(have, want, rtol=rtol, atol=atol):
        return f"close ({figures})"
    return f"DIFFERENT ({figures})"


def compare(title, expected, got, scaled=False, spreads=None):
    """Print how ``got`` compares with ``expected`` (dicts of values); return whether all match.

    Tensors are equal, or close: ``|got - want| <= atol + rtol * |want|`` with
    :func:`tolerance`'s figures (``scaled=True`` for gradients; ``spreads``: the
    run-to-run spread of each key, see :func:`spread_of`), printed with the
    largest difference; NaN and Inf must sit at the same places (see
    :func:`compare_tensor`).

    >>> compare("outputs", {"y": torch.ones(2)}, {"y": torch.ones(2) + 1e-7})
    outputs: 1 close
      y: close (max abs diff 1.19e-07; rtol 1.3e-06, atol 1e-05)
    True
    """
    verdicts = {}
    for key, want in expected.items():
        have = got.get(key)
        if not isinstance(want, torch.Tensor):
            same = have == want or (have != have and want != want)  # NaN == NaN here
            verdicts[key] = "equal" if same else f"DIFFERENT ({have!r} != {want!r})"
        elif not isinstance(have, torch.Tensor):
            verdicts[key] = "MISSING"
        else:
            verdicts[key] = compare_tensor(want, have, scaled, (spreads or {}).get(key, 0.0))
    counts = {}
    for verdict in verdicts.values():
        word = verdict.split(" ")[0]
        counts[word] = counts.get(word, 0) + 1
    print(f"{title}: " + ", ".join(f"{n} {word}" for word, n in counts.items()))
    for key, verdict in verdicts.items():
        if verdict != "equal" or len(verdicts) <= 8:
            print(f"  {key}: {verdict}")
    return all(v.startswith(("equal", "close")) for v in verdicts.values())


def spread_of(runs):
    """``{key: the largest difference between any two of runs}`` (dicts of values), floating tensors only.

    Where torch does not promise the same bits twice, run.py runs the model
    more than once and widens each tolerance by what it sees (NaN and Inf
    left out: they are compared by place).

    >>> spread_of([{"y": torch.tensor([1.0, 2.0]), "n": 3}, {"y": torch.tensor([1.0, 2.5]), "n": 3},
    ...            {"y": torch.tensor([0.75, 2.0]), "n": 3}])
    {'y': 0.5}
    """
    spreads = {}
    for key, first in runs[0].items():
        values = [run.get(key) for run in runs]
        if not (isinstance(first, torch.Tensor) and (first.is_floating_point() or first.is_complex())
                and all(isinstance(v, torch.Tensor) and v.shape == first.shape
                        and v.dtype == first.dtype for v in values)):
            continue
        wide = torch.complex128 if first.is_complex() else torch.float64
        largest = 0.0
        for i, a in enumerate(values):
            for b in values[i + 1:]:
                finite = torch.isfinite(a) & torch.isfinite(b)
                if finite.any():
                    largest = max(largest, (a.to(wide) - b.to(wide))[finite].abs().max().item())
        spreads[key] = largest
    return spreads


def carried_functions(roots, instead: dict) -> list[types.FunctionType]:
    """``roots`` and every fxdebug function they call (through their module's globals),
    each once, the functions called before their callers; ``instead[f]`` replaces ``f``.

    >>> [f.__name__ for f in carried_functions([outputs_loss], {values.children: children})]
    ['_opened_here', 'children', 'named_leaves', 'outputs_loss']
    """
    found: dict[types.FunctionType, None] = {}
    visiting: set = set()

    def names(code: types.CodeType):
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):  # comprehensions, nested functions
                yield from names(const)

    def visit(function) -> None:
        function = instead.get(function, function)
        if function in found or function in visiting:
            return
        visiting.add(function)
        for name in dict.fromkeys(names(function.__code__)):
            value = function.__globals__.get(name)
            if isinstance(value, types.FunctionType) and value.__module__.startswith("fxdebug."):
                visit(value)
        found[function] = None

    for root in roots:
        visit(root)
    return list(found)


def plain_source(function) -> str:
    """``function``'s source without the annotations of its parameters and return value
    (run.py imports no ``typing``; annotations are evaluated when a function is defined).

    >>> def f(x: "int", *, y: list | None = None) -> "str":
    ...     return x
    >>> print(plain_source(f))
    def f(x, *, y = None):
        return x
    """
    source = textwrap.dedent(inspect.getsource(function)).rstrip()
    lines = source.split("\n")
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line.encode()) + 1)

    def offset(line: int | None, column: int | None) -> int:  # ast's (1-based line, UTF-8 column)
        return starts[(line or 1) - 1] + (column or 0)

    definition = ast.parse(source).body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise TypeError(f"plain_source takes a function, not {source.splitlines()[0]!r}")
    arguments = definition.args
    cuts = []
    for argument in (arguments.posonlyargs + arguments.args + arguments.kwonlyargs
                     + [a for a in (arguments.vararg, arguments.kwarg) if a is not None]):
        if argument.annotation is not None:  # "x: int" -> "x"
            cuts.append((offset(argument.lineno, argument.col_offset) + len(argument.arg.encode()),
                         offset(argument.annotation.end_lineno, argument.annotation.end_col_offset)))
    data = source.encode()
    returns = definition.returns
    if returns is not None:  # ") -> str:" -> "):"
        end = offset(returns.end_lineno, returns.end_col_offset)
        arrow = data.rindex(b"->", 0, offset(returns.lineno, returns.col_offset))
        cuts.append((len(data[:arrow].rstrip()), end))
    for start, end in sorted(cuts, reverse=True):
        data = data[:start] + data[end:]
    return data.decode()


RUN_PY_FUNCTIONS = (flatten_outputs, outputs_loss, first_line, tolerance, nonfinite_text,
                    compare_tensor, compare, spread_of)
"""What run.py calls (with what they call): flatten, the default loss, compare."""


def run_py_source():
    """The source run.py carries: its constants, every function of :data:`RUN_PY_FUNCTIONS`
    with the fxdebug functions they call (the walker with :func:`children` here), and those
    of :mod:`~fxdebug.dumping.numeric_settings`."""
    table = "".join(f"\n    {dtype!r}: {pair!r}," for dtype, pair in TOLERANCES.items())
    setters = "".join(f"\n    {name!r}: {setter!r}," for name, setter in numeric_settings.SETTERS.items())
    constants = [f"TOLERANCES = {{{table}\n}}  # torch.testing.assert_close's (rtol, atol)",
                 f"GRADIENT_SCALE = {GRADIENT_SCALE}\nSPREAD_SCALE = {SPREAD_SCALE}",
                 f"DETERMINISTIC = {numeric_settings.DETERMINISTIC!r}\n"
                 f"ENVIRONMENT = {numeric_settings.ENVIRONMENT!r}\n"
                 f"MKL_REPRODUCIBILITY = {numeric_settings.MKL_REPRODUCIBILITY!r}\n"
                 f"CPU_CAPABILITY = {numeric_settings.CPU_CAPABILITY!r}\n"
                 f"SETTERS = {{{setters}\n}}  # the function that sets each setting read by a call"]
    functions = carried_functions(RUN_PY_FUNCTIONS + SETTINGS_FUNCTIONS, {values.children: children})
    return "\n\n\n".join(constants + [plain_source(function) for function in functions]) + "\n"


SETTINGS_FUNCTIONS = (numeric_settings.resolve_torch_path, numeric_settings.read_setting,
                      numeric_settings.write_setting, numeric_settings.setting_text,
                      numeric_settings.apply_settings, numeric_settings.nondeterminism)
