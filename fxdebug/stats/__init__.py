"""The statistics engine: a tensor's summary numbers, exact and fast, on any device.

Everything here imports only :mod:`fxdebug.base` and :mod:`fxdebug.errors`; the runtime's
Records, the saved runs, the monitor and the sharded assembly build on it::

    summary.py         Stats (mean, std, min, max, norm, zeros, non-finite), summarize(t):
                       the 8-number summary; combine(), stats_from_summary()
    kernel.py          the summary of one tensor: which implementation, for which size
    native.py          the CPU's C kernel (built with the system's C compiler, where one
                       is): the summary, and the monitor's ten numbers, of many tensors
                       from one call (a difference taken, or a copy made, in the same read)
    native_source.py   its C source
    triton_kernel.py   the Triton kernel, on a GPU with triton
    batch.py           the summaries of many small tensors at once (stats mode's captures)
    moments.py         the monitor's ten numbers (the summary with M3, M4), pooled over keys

>>> from fxdebug.stats.summary import summarize, stats_from_summary
>>> import torch
>>> stats_from_summary(summarize(torch.tensor([1.0, 3.0]))).mean
2.0
"""
