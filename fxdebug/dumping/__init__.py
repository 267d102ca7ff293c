"""Dumps: a GraphModule written to a folder of plain files that runs, moves and round-trips.

::

    dump(gm, *inputs, folder=)         pipeline.py: the pipeline below, each step once
      ├─ standalone.py                 standalone=True: fxdebug's observing nodes left out,
      │                                so the folder runs where fxdebug is not installed
      ├─ plan.py                       collect: everything the folder holds, as named values
      │    ├─ forward.py               forward a statement a line, and the imports it needs
      │    ├─ structure.py             submodules rebuilt by code, or pickled (and why)
      │    ├─ literals.py              values and import names written as code
      │    └─ expected.py              the outputs and gradients the folder must reproduce
      ├─ render.py                     each file's bytes from the plan
      │    ├─ module_text.py           module.py, each statement ending in ``# [node key] file:line``
      │    ├─ folder_runtime.py        the functions run.py carries (flatten, loss, compare)
      │    └─ templates/*.tmpl         the fixed text of module.py, run.py, __init__.py
      └─ writer.py                     all or nothing: a temporary folder, then a rename

>>> import os, tempfile, torch, fxdebug
>>> folder = fxdebug.dump(torch.nn.Linear(2, 2), torch.ones(1, 2),
...                       folder=os.path.join(tempfile.mkdtemp(), "lin"))
>>> "run.py" in os.listdir(folder)
True
"""

from .pipeline import FILES, dump

__all__ = ["dump", "FILES"]
