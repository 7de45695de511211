"""STUB (vmbackup's branch): the contract's Reconciler protocol and Context, until vmcrd's
`_base.py` lands; vmcrd's file replaces this one at the merge."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import lightkube


class EventRecorder(Protocol):
    def emit(self, obj: Any, type: str, reason: str, message: str) -> None: ...


class Reconciler(Protocol):
    resource: type

    async def reconcile(self, ctx: Context, namespace: str, name: str) -> float | None: ...


@dataclass
class Context:
    client: lightkube.AsyncClient
    events: EventRecorder
