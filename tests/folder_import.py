"""Import a dumped folder (a package) from where it lies, leaving ``sys.path`` as it is.

    package = import_folder(path)            # the folder's __init__.py, as package NAME
    model = package.load()

``python -c`` children of the tests use it too (tests/ is on their PYTHONPATH).
"""

from __future__ import annotations

import importlib.util
import os
import sys

__all__ = ["import_folder"]


def import_folder(folder, name: str | None = None):
    """The package in ``folder`` (named after the folder unless ``name``), imported from its
    location; its modules leave ``sys.modules`` again, so two folders of one name do not mix."""
    folder = os.fspath(folder)
    name = name or os.path.basename(os.path.normpath(folder))
    spec = importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    if spec is None or spec.loader is None:
        raise ImportError(f"{folder!r} is not a package (no __init__.py)")
    package = importlib.util.module_from_spec(spec)
    before = set(sys.modules)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
    finally:
        for added in sorted(set(sys.modules) - before):
            if added == name or added.startswith(name + "."):
                del sys.modules[added]
    return package
