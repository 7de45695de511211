"""What resolution reads: the API objects a pod references, behind a small protocol.

Resolution is pure; the agent (or a test) supplies a `Sources` that answers from its caches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

JSON = Mapping[str, Any]


class SourceReadError(Exception):
    """Raised by a `Sources` or token source when an object could not be read.

    "Could not be read" (API unreachable, cache not synced, forbidden) is different from "does not
    exist" (return None): only a missing object lets an optional reference be skipped. A read
    failure fails the container even for an optional reference, as in the kubelet, so that a
    flaky API server never silently starts a container without its configuration.
    """


class Sources(Protocol):
    """Read access to the API objects a pod may reference, as JSON dicts."""

    def get_configmap(self, namespace: str, name: str) -> JSON | None:
        """The ConfigMap, or None if it does not exist; raise `SourceReadError` if unreadable."""
        ...

    def get_secret(self, namespace: str, name: str) -> JSON | None:
        """The Secret (`data` base64-encoded, as the API returns it), or None if missing."""
        ...

    def get_service(self, namespace: str, name: str) -> JSON | None:
        """One Service, or None if it does not exist; `SourceReadError` if unreadable."""
        ...

    def list_services(self, namespace: str) -> Sequence[JSON]:
        """All Services of the namespace; raise `SourceReadError` if they cannot be listed."""
        ...
