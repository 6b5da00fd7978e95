"""A ticker on the event loop, as an SSE writer waits for its next token: how many times it ran
while something else held the loop's thread (or the GIL) is what every stream would have seen."""

from __future__ import annotations

import asyncio
import contextlib


class Ticks:
    count = 0


@contextlib.asynccontextmanager
async def ticking():
    """`async with ticking() as ticks:` counts the ticks (`ticks.count`) a 1 ms sleep loop made."""
    ticks = Ticks()

    async def tick():
        while True:
            await asyncio.sleep(0.001)
            ticks.count += 1

    ticker = asyncio.create_task(tick())
    try:
        yield ticks
    finally:
        ticker.cancel()
