"""The one back-off of retry loops: doubling to a cap, jitter, reset on success."""

from __future__ import annotations

import asyncio

from vkubelet.sdk.retry import Backoff


def test_delays_double_from_initial_up_to_the_cap_without_jitter() -> None:
    backoff = Backoff(initial=0.5, cap=4.0, jitter=0.0)
    assert [backoff.next_delay() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_a_success_starts_again_from_the_bottom() -> None:
    backoff = Backoff(initial=1.0, cap=60.0, jitter=0.0)
    backoff.next_delay()
    backoff.next_delay()
    backoff.reset()
    assert backoff.next_delay() == 1.0


def test_jitter_adds_at_most_its_fraction_and_never_shortens() -> None:
    low = Backoff(initial=2.0, jitter=0.25, random=lambda: 0.0)
    high = Backoff(initial=2.0, jitter=0.25, random=lambda: 0.999999)
    assert low.delay(1) == 2.0
    assert 2.0 < high.delay(1) < 2.5


def test_a_patient_cause_raises_the_cap_for_one_wait_only() -> None:
    backoff = Backoff(initial=1.0, cap=2.0, jitter=0.0)
    for _ in range(4):
        backoff.next_delay()
    assert backoff.next_delay(cap=60.0) == 16.0
    assert backoff.next_delay() == 2.0


def test_wait_sleeps_the_delay_it_returns() -> None:
    backoff = Backoff(initial=0.01, cap=0.01, jitter=0.0)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        delay = await backoff.wait()
        assert loop.time() - start >= delay
        return delay

    assert asyncio.run(main()) == 0.01
    assert backoff.failures == 1


def test_a_loop_failing_for_days_keeps_waiting_the_cap_instead_of_overflowing() -> None:
    """1025 failures in a row (17 h of an unreachable peer at a 60 s cap; a minute of
    `wait_for` polling every 50 ms) once made `factor ** failures` leave float's range: the
    OverflowError ended the retry loop itself."""
    backoff = Backoff(initial=1.0, cap=60.0, jitter=0.0)
    assert backoff.delay(1025) == 60.0 and backoff.delay(10**6) == 60.0
    assert Backoff(initial=0.05, cap=0.05, jitter=0.0).delay(5000) == 0.05
