from __future__ import annotations

from datetime import UTC, datetime

import pytest

from vkubelet.sdk import clock


def test_the_stamp_is_the_utc_second_and_follows_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    moments = iter([1_700_000_000.2, 1_700_000_000.9, 1_700_000_001.0])
    monkeypatch.setattr(clock, "_clock", lambda: next(moments))
    first, same, after = clock.now_rfc3339(), clock.now_rfc3339(), clock.now_rfc3339()
    assert first == same == "2023-11-14T22:13:20Z"
    assert after == "2023-11-14T22:13:21Z"
    assert datetime.fromisoformat(after) == datetime.fromtimestamp(1_700_000_001, UTC)
