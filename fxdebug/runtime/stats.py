"""``fxdebug.runtime.stats``: an old path kept for pickles.

Records pickled before the statistics engine had a room of its own hold their statistics as
``fxdebug.runtime.stats.Stats``: pickle imports a class from the module it was defined in, and
the code now lives in :mod:`fxdebug.stats.summary`.
"""

from ..stats.summary import Stats

__all__ = ["Stats"]
