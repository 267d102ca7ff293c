"""What a part-by-part model captures: the user's selection, applied part by part.

``instrument()``'s capture arguments are checked against every key the whole
model showed on its first run, and turned into arguments for each traced part
(:meth:`Selection.for_part`) and decisions for each eager module or op
(:meth:`Selection.for_eager`, :meth:`Selection.for_op`).
"""

from __future__ import annotations

import dataclasses
import re

import torch.fx as fx

from ..errors import SelectionError
from ..tracing.keys import META_MODULE, key_base
from ..tracing.selection import as_patterns, candidates, check_patterns, key_depth, matches

__all__ = ["Selection", "key_plan"]


def key_plan(gm: fx.GraphModule, module_paths: dict) -> dict[str, tuple[str, int, int]]:
    """For every capturable key: (base, index among the keys of that base, keys of that base)."""
    bases: dict[str, str] = {}
    for target in candidates(gm, every_node=True):
        key = target.key
        if target.is_module:
            match = re.fullmatch(r"(.+)_(\d+)", key)
            base = key if key in module_paths or not match or \
                match.group(1) not in module_paths else match.group(1)
        else:
            node = target.nodes[0]
            base = key if node.op == "placeholder" else \
                key_base(node.op, node.target, node.meta.get(META_MODULE, ""))
            if not (key == base or re.fullmatch(re.escape(base) + r"_\d+", key)):
                base = key
        bases.setdefault(key, base)
    per_base: dict[str, int] = {}
    plan = {}
    for key, base in bases.items():
        plan[key] = (base, per_base.get(base, 0))
        per_base[base] = per_base.get(base, 0) + 1
    return {key: (base, index, per_base[base]) for key, (base, index) in plan.items()}


class Selection:
    """The user's capture arguments, checked against the whole model, applied per part."""

    def __init__(self, capture, depth, include, exclude, grads, mode) -> None:
        if isinstance(capture, str) and capture not in ("modules", "all"):
            raise SelectionError(f"capture={capture!r}: use 'modules', 'all', or a list of keys "
                                 f"or globs such as ['backbone.body.layer1', '*.conv1'].")
        if mode not in ("tensor", "stats"):
            raise SelectionError(f"mode={mode!r}: use 'tensor' (keep values) or 'stats' (keep "
                                 f"summary statistics only).")
        self.capture = capture if isinstance(capture, str) else as_patterns("capture", capture)
        self.depth, self.grads, self.mode = depth, grads, mode
        self.include = as_patterns("include", include)
        self.exclude = as_patterns("exclude", exclude)
        self.include_given = include is not None

    def check(self, keys: list[str]) -> None:
        pool = [_Key(key) for key in keys]
        if isinstance(self.capture, list):
            check_patterns("capture", self.capture, pool)
        check_patterns("include", self.include, pool)
        check_patterns("exclude", self.exclude, pool)

    def for_part(self, keys: list[str]) -> dict | None:
        """``instrument()`` arguments for a part with these keys; None: nothing to do there."""
        def here(patterns):
            return [p for p in patterns if any(matches(key, p) for key in keys)]
        include = here(self.include)
        if self.include_given and not include:
            return None
        capture = self.capture if isinstance(self.capture, str) else here(self.capture)
        if isinstance(self.capture, list) and self.capture and not capture:
            return None
        return dict(capture=capture, depth=self.depth, include=include or None,
                    exclude=here(self.exclude) or None, grads=self.grads, mode=self.mode)

    def for_eager(self, key: str) -> tuple[str | None, str | None]:
        """(capture mode or None, grads mode or None) for the output of a module run eagerly."""
        if self.depth is not None and key_depth(key) > self.depth:
            return None, None
        if self.include and not any(matches(key, p) for p in self.include):
            return None, None
        if any(matches(key, p) for p in self.exclude):
            return None, None
        listed = isinstance(self.capture, list)
        chosen = not listed or any(matches(key, p) for p in self.capture)
        capture = self.mode if chosen and not (listed and not self.capture) else None
        grads_chosen = chosen or (listed and not self.capture)
        return capture, (self.mode if self.grads and grads_chosen else None)

    @property
    def records_ops(self) -> bool:
        """Whether ops inside eager code can be selected (``capture="all"`` or patterns)."""
        return self.capture == "all" or (isinstance(self.capture, list) and bool(self.capture))

    def for_op(self, key: str) -> tuple[str | None, str | None]:
        """As :meth:`for_eager`, for an op that ran inside eager code (none for ``"modules"``)."""
        return self.for_eager(key) if self.records_ops else (None, None)


@dataclasses.dataclass(frozen=True)
class _Key:
    key: str
