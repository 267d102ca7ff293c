"""torch's pytree: flattening nested values (tuples, lists, dicts, namedtuples...) to leaves.

``torch.utils._pytree`` has no public twin (checked on 2.9.1 and 2.14.1);
:mod:`fxdebug.runtime.values` builds fxdebug's one nested-value walker on it.

>>> leaves, spec = tree_flatten({"a": (1, 2)}); leaves, tree_unflatten(leaves, spec)
([1, 2], {'a': (1, 2)})
"""

from __future__ import annotations

import torch.utils._pytree as _pytree  # no public pytree module (2.9.1, 2.14.1)

__all__ = ["tree_flatten", "tree_flatten_with_path", "tree_is_leaf", "tree_leaves", "tree_unflatten",
           "treespec_parts"]

# torch.utils._pytree (checked on 2.9.1 and 2.14.1; torch has no public twin). A dumped folder
# uses none of it: module.py and run.py open and build nested values in plain Python.
tree_leaves, tree_flatten, tree_unflatten = _pytree.tree_leaves, _pytree.tree_flatten, _pytree.tree_unflatten

tree_flatten_with_path, tree_is_leaf = _pytree.tree_flatten_with_path, _pytree.tree_is_leaf
"""``([(key path, leaf)], spec)`` and "kept whole" (2.9.1, 2.14.1; no public twin): the walk
:mod:`fxdebug.runtime.values`, fxdebug's one nested-value walker, is built on."""



def treespec_parts(spec):
    """``None`` for a leaf, else ``(node type, context, [child specs])`` of a pytree TreeSpec.

    Reads ``spec.type``, ``spec.context`` and ``spec.children()`` (``children_specs`` where
    that is missing; both on 2.9.1, ``children_specs`` deprecated on 2.14.1): what a dump
    writes plain Python from, so module.py needs no pytree.

    >>> _, spec = tree_flatten({"a": (1, 2)}); kind, context, children = treespec_parts(spec)
    >>> kind, context, [treespec_parts(child)[0] for child in children]
    (<class 'dict'>, ['a'], [<class 'tuple'>])
    """
    if spec.is_leaf():
        return None
    children = spec.children() if callable(getattr(spec, "children", None)) else spec.children_specs
    return spec.type, spec.context, list(children)
