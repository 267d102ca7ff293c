"""Graph passes: one pass a file.

>>> import fxdebug
>>> sorted(fxdebug.passes.__all__)
['Capture', 'Pass', 'PassResult', 'as_pass']
"""

from .base import Pass, PassResult, as_pass
from .capture import Capture

__all__ = ["Pass", "PassResult", "as_pass", "Capture"]
