"""What can go wrong when streaming to another apiserver or kubelet, as exception types a relay
can map onto its own answers (a 404 upstream for a 404 downstream, and so on)."""

from __future__ import annotations


class StreamingError(Exception):
    """exec, attach or port-forward could not be carried out (connection lost, bad answer)."""


class UpgradeFailed(StreamingError):
    """The server refused the upgrade with an HTTP status, e.g. 404 for an unknown pod, 400 for
    an unknown container, 401/403 for missing rights. ``str()`` is the server's own message
    (``pods "x" not found``), which is what kubectl prints after "Error from server"."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message or f"HTTP {status} {reason}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404


class RemoteCommandError(StreamingError):
    """The command ended without an exit code: it could not be started, or the session failed.
    ``str()`` is the server's status message."""


class PortForwardError(StreamingError):
    """The far side could not forward a connection; ``str()`` is what it wrote on the pair's
    error stream (e.g. "error forwarding port 80 to pod x, uid ...: connection refused")."""
