"""How long to wait before trying again: the one back-off every retry loop of vkubelet uses.

A loop that reconnects, relists or re-registers after a failure waits `initial` seconds first,
twice that after the next failure, and so on up to `cap`; a success starts it from the bottom
again. Each delay gets up to `jitter` of itself added at random, so that many loops that failed
together (every reflector of an agent when the apiserver restarts, every agent of a fleet) do
not retry together. A cause that calls for patience (an apiserver that is down, not one that
refused a request) passes a larger cap for that one wait.

The kubelet's restart rule for crashing containers is a different thing with fixed numbers that
users see in pod status: `vkubelet.sdk.backoff` keeps it.

`Backoff` takes its random source as an argument and `delay()` is a pure function of the number
of failures, so both are tested without waiting.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass
class Backoff:
    """The back-off of one retry loop: `await wait()` after a failure, `reset()` after a success."""

    initial: float = 0.5
    cap: float = 30.0
    factor: float = 2.0
    jitter: float = 0.1
    random: Callable[[], float] = field(default=random.random, repr=False)
    failures: int = 0

    def delay(self, failures: int, *, cap: float | None = None) -> float:
        """The wait after the `failures`-th failure in a row (1 is the first), jitter included."""
        limit = self.cap if cap is None else cap
        try:
            base = min(self.initial * self.factor ** max(failures - 1, 0), limit)
        except OverflowError:  # so many failures in a row that the cap was reached long ago
            base = limit
        return base * (1.0 + self.jitter * self.random())

    def next_delay(self, *, cap: float | None = None) -> float:
        """Count one more failure and return how long to wait before the next try."""
        self.failures += 1
        return self.delay(self.failures, cap=cap)

    async def wait(self, *, cap: float | None = None) -> float:
        """Count a failure and sleep its delay; returns the delay (for the log line)."""
        delay = self.next_delay(cap=cap)
        await asyncio.sleep(delay)
        return delay

    def reset(self) -> None:
        """A success: the next failure waits `initial` again."""
        self.failures = 0
