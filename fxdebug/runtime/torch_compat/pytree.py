"""torch's pytree: flattening nested values (tuples, lists, dicts, namedtuples...) to leaves.

``torch.utils._pytree`` has no public twin (checked on 2.9.1 and 2.14.1);
:mod:`fxdebug.runtime.values` builds fxdebug's one nested-value walker on it.

>>> leaves, spec = tree_flatten({"a": (1, 2)}); leaves, tree_unflatten(leaves, spec)
([1, 2], {'a': (1, 2)})
"""

from __future__ import annotations

import torch.utils._pytree as _pytree  # no public pytree module (2.9.1, 2.14.1)

__all__ = ["PYTREE_IMPORT", "tree_flatten", "tree_flatten_with_path", "tree_is_leaf", "tree_leaves",
           "tree_unflatten", "treespec_dumps"]

# torch.utils._pytree (checked on 2.9.1 and 2.14.1; torch has no public twin). treespec_dumps:
# a TreeSpec as JSON, what a dumped script loads with torch.utils._pytree.treespec_loads.
tree_leaves, tree_flatten, tree_unflatten = _pytree.tree_leaves, _pytree.tree_flatten, _pytree.tree_unflatten
treespec_dumps = _pytree.treespec_dumps

tree_flatten_with_path, tree_is_leaf = _pytree.tree_flatten_with_path, _pytree.tree_is_leaf
"""``([(key path, leaf)], spec)`` and "kept whole" (2.9.1, 2.14.1; no public twin): the walk
:mod:`fxdebug.runtime.values`, fxdebug's one nested-value walker, is built on."""

PYTREE_IMPORT = "from torch.utils._pytree import tree_flatten_with_path, tree_is_leaf"
"""The line a dumped folder's run.py imports pytree's walk with (no fxdebug there)."""
