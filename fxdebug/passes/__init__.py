"""Graph passes: one pass a file, each a ``torch.fx`` ``PassBase``.

A pass rewrites a keyed GraphModule in place and says whether it changed it.
The inserted nodes call :mod:`fxdebug.runtime`; passes never read Records::

    instrument(model, capture=..., grads=..., passes=[...])
      ├─ Capture        capture.py         capture / capture_stats after each value
      │                                    (a copy where aliasing.py finds a later write)
      ├─ GradHooks      grad_hooks.py      record_grads: a tensor hook per value
      └─ user passes, e.g.
           ├─ GradTransform   grad_transform.py   edit_grads: grad -> fn(grad)
           ├─ Functionalize   functionalize.py    in-place ops -> out-of-place ops
           ├─ Checkpoint      checkpoint.py       module calls recomputed in backward
           ├─ Breakpoint      breakpoint.py       stop in pdb before a node
           └─ FakePrecision   fake_precision.py   nodes rounded to bfloat16 / float16 / float8
    Capture and GradHooks place their nodes with _placement.py.

``BUILTIN_PASSES`` maps the names the command line accepts (``--pass NAME``)
to pass factories that take no arguments. A pass that replaces a node gives the new
one the old one's key with ``inherit_key`` (from :mod:`fxdebug.tracing.keys`), so that
checks and diffs match them.

>>> import fxdebug
>>> fxdebug.passes.BUILTIN_PASSES["capture"]().name
'capture'
"""

from ..tracing.keys import inherit_key
from .base import Pass, PassResult, as_pass
from .breakpoint import Breakpoint
from .capture import Capture
from .checkpoint import Checkpoint
from .eager_regions import EagerRegions
from .fake_precision import FakePrecision
from .functionalize import Functionalize
from .grad_hooks import GradHooks
from .grad_transform import GradTransform

__all__ = ["Pass", "PassResult", "as_pass", "inherit_key", "Capture", "GradHooks",
           "GradTransform", "Breakpoint", "Functionalize", "Checkpoint", "EagerRegions",
           "FakePrecision", "BUILTIN_PASSES"]

BUILTIN_PASSES = {
    "capture": Capture,
    "grads": GradHooks,
    "breakpoint": Breakpoint,
    "functionalize": Functionalize,
    "checkpoint": Checkpoint,
}
