"""STUB (vmmigrate's branch) of vmcrd's `_base.py`, as the contract states it: on merge, take
vmcrd's file."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from lightkube import AsyncClient


class EventRecorder(Protocol):
    def emit(self, obj: Any, type: str, reason: str, message: str) -> None: ...


@dataclass
class Context:
    client: AsyncClient
    events: EventRecorder


class Reconciler(Protocol):
    resource: type

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None: ...
