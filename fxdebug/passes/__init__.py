"""Graph passes: one pass a file.

``BUILTIN_PASSES`` maps the names the command line accepts (``--pass NAME``)
to pass factories that take no arguments.

>>> import fxdebug
>>> fxdebug.passes.BUILTIN_PASSES["capture"]().name
'capture'
"""

from .base import Pass, PassResult, as_pass
from .breakpoint import Breakpoint
from .capture import Capture
from .checkpoint import Checkpoint
from .functionalize import Functionalize
from .grad_hooks import GradHooks
from .grad_transform import GradTransform
from .manager import PassManager, PassReport, Stage

__all__ = ["Pass", "PassResult", "as_pass", "Capture", "GradHooks", "GradTransform",
           "PassManager", "PassReport", "Stage", "Breakpoint", "Functionalize", "Checkpoint",
           "BUILTIN_PASSES"]

BUILTIN_PASSES = {
    "capture": Capture,
    "grads": GradHooks,
    "breakpoint": Breakpoint,
    "functionalize": Functionalize,
    "checkpoint": Checkpoint,
}
