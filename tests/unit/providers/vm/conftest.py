"""The VM provider over the fake runtime (fakes.py), a fresh one per test."""

from __future__ import annotations

from pathlib import Path

import pytest

from vkubelet.providers.vm._provider import VMProvider

from .fakes import Events, FakeRuntime, provider_for


@pytest.fixture
def runtime() -> FakeRuntime:
    return FakeRuntime()


@pytest.fixture
def events() -> Events:
    return Events()


@pytest.fixture
def provider(tmp_path: Path, runtime: FakeRuntime, events: Events) -> VMProvider:
    return provider_for(tmp_path, runtime, events)
