"""Profiling: device-side times of every kernel launch, copy, transfer and compile.

>>> import anygpu as ag
>>> from anygpu.profile import profile
>>> x = ag.ones(64, 64)
>>> with profile() as prof:
...     total = (x * 2).sum().item()
>>> sorted({e.kind for e in prof.events} & {"kernel", "download"})
['download', 'kernel']

``prof.summary()`` is a table of the kernels by device time; ``prof.export_chrome_trace(path)``
writes a trace that ui.perfetto.dev opens.
"""

from anygpu.profile.profiler import Profile, profile
from anygpu.profile.report import Event, Stat

__all__ = ["profile", "Profile", "Event", "Stat"]
