"""A wall clock the deadline tests move by hand.

`Clock` stands in for the `time` module of the modules a test patches (`monkeypatch.setattr(module,
"time", clock)`): `time()` is the real one plus `offset_s`, everything else is the real module's.
"""

from __future__ import annotations

import time


class Clock:
    def __init__(self):
        self.offset_s = 0.0

    def time(self) -> float:
        return time.time() + self.offset_s

    def __getattr__(self, name):
        return getattr(time, name)
