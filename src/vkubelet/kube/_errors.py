"""The two ways a request to the apiserver fails: it answered no (`ApiError`, with the Status
reason when it sent one) or it could not be asked (`Unreachable`). Callers retry the second and
judge the first, so they are kept apart."""

from __future__ import annotations

import msgspec

_decode = msgspec.json.decode


class ApiError(Exception):
    """A non-2xx answer from the apiserver, with its Status reason when it sent one."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409

    @property
    def gone(self) -> bool:
        return self.status == 410


class Unreachable(Exception):
    """The apiserver could not be reached (connection refused, TLS failure, timeout)."""


def api_error(status: int, content: bytes) -> ApiError:
    try:
        body = _decode(content)
    except msgspec.DecodeError:
        return ApiError(status, "Unknown", content.decode(errors="replace")[:500])
    if isinstance(body, dict):
        return ApiError(status, str(body.get("reason", "")), str(body.get("message", "")))
    return ApiError(status, "Unknown", str(body)[:500])


def status_error(raw: bytes) -> ApiError:
    """Turn the object of a watch ERROR event (a metav1.Status) into an ApiError."""
    body = _decode(raw)
    return ApiError(
        int(body.get("code", 500)), str(body.get("reason", "")), body.get("message", "")
    )
