"""Waiting for a condition, with a deadline: what a test does instead of sleeping for a guessed time.

`wait_until(condition, timeout_s, what)` calls `condition` until it returns something truthy and
returns that; past `timeout_s` it fails the test, saying `what` did not happen. `until` is the same
on an event loop (the loop runs other work between calls). Use them when nothing can be awaited
directly (a thread's effect, a count on another object); a fake clock (tests/fakes/clock.py) when
the code under test reads the time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "the condition",
               poll_s: float = 0.01) -> T:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(poll_s)
    return result


async def until(condition: Callable[[], T], timeout_s: float = 10.0, what: str = "the condition",
                poll_s: float = 0.005) -> T:
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(poll_s)
    return result
