"""``fxdebug.instrument``: an old path kept for pickles.

An instrumented module pickled (or torch.save'd) before instrument.py was renamed follows
train()/eval() with ``fxdebug.instrument._instrument_mode`` and ``_after_mode_switch``: pickle
imports ``fxdebug.instrument`` and reads those names from it. ``fxdebug.instrument`` is the
function ``instrument`` (from :mod:`fxdebug.instrumenting`), so this module puts the function in
its place in ``sys.modules``, holding the names; importing it binds the function, never a
module, to the package.
"""

import sys

from .instrumenting import instrument, _instrument_mode, _after_mode_switch

setattr(instrument, "_instrument_mode", _instrument_mode)
setattr(instrument, "_after_mode_switch", _after_mode_switch)
sys.modules[__name__] = instrument  # type: ignore[assignment]
