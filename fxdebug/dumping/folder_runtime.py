"""The dumped folder's own small runtime: run.py carries a copy of these functions.

run.py must run where fxdebug is not installed, so :func:`fxdebug.dump` writes
the source of every function here into it (``inspect.getsource``); fxdebug
itself uses the same functions to record what the folder must reproduce.
"""

import dataclasses

import torch

__all__ = ["flatten_outputs", "loss_of", "first_line", "compare"]


def flatten_outputs(value, prefix="output"):
    """Flatten a (nested) output into ``{"output/0/logits": tensor, ...}``; other leaves kept if simple.

    >>> list(flatten_outputs((torch.ones(1), {"b": 2})))
    ['output/0', 'output/1/b']
    """
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        items = list(zip(value._fields, value))
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    elif isinstance(value, dict):
        items = list(value.items())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    elif value is None or isinstance(value, (bool, int, float, str)):
        return {prefix: value}
    else:
        return {}
    flat = {}
    for name, item in items:
        flat.update(flatten_outputs(item, f"{prefix}/{name}"))
    return flat


def loss_of(flat):
    """The scalar backward starts from: the sum of every floating output that requires grad.

    >>> loss_of({"a": torch.ones(2, requires_grad=True), "b": torch.ones(3)})
    tensor(2., grad_fn=<SumBackward0>)
    """
    terms = [t.sum() for t in flat.values()
             if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]
    return sum(terms[1:], terms[0]) if terms else None


def first_line(exc):
    """The first line of an exception's message (what run.py compares for a failing backward).

    >>> first_line(RuntimeError("broken\\ndetails"))
    'broken'
    """
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def compare(title, expected, got):
    """Print how ``got`` compares with ``expected`` (dicts of values); return whether all match.

    >>> compare("outputs", {"y": torch.ones(2)}, {"y": torch.ones(2) + 1e-7})
    outputs: 1 close
      y: close (max abs diff 1.19e-07)
    True
    """
    verdicts = {}
    for key, want in expected.items():
        have = got.get(key)
        if not isinstance(want, torch.Tensor):
            verdicts[key] = "equal" if have == want else f"DIFFERENT ({have!r} != {want!r})"
        elif not isinstance(have, torch.Tensor):
            verdicts[key] = "MISSING"
        elif have.shape != want.shape or have.dtype != want.dtype:
            verdicts[key] = (f"DIFFERENT (shape {tuple(have.shape)} {have.dtype}, "
                             f"expected {tuple(want.shape)} {want.dtype})")
        elif torch.equal(have, want):
            verdicts[key] = "equal"
        else:
            diff = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
            if torch.allclose(have, want, rtol=1e-5, atol=1e-6, equal_nan=True):
                verdicts[key] = f"close (max abs diff {diff:.3g})"
            else:
                verdicts[key] = f"DIFFERENT (max abs diff {diff:.3g})"
    counts = {}
    for verdict in verdicts.values():
        word = verdict.split(" ")[0]
        counts[word] = counts.get(word, 0) + 1
    print(f"{title}: " + ", ".join(f"{n} {word}" for word, n in counts.items()))
    for key, verdict in verdicts.items():
        if verdict != "equal" or len(verdicts) <= 8:
            print(f"  {key}: {verdict}")
    return all(v == "equal" or v.startswith("close") for v in verdicts.values())
