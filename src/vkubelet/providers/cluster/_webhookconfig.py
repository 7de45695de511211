"""`webhook:` in lower.yaml: the constraint webhook's settings (see `_admission`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..._fields import reject_unknown
from ...sdk import ConfigError

__all__ = ["WebhookConfig", "parse_webhook_config"]

_KEYS = {
    "enabled",
    "port",
    "host",
    "certFile",
    "keyFile",
    "caFile",
    "keepKeys",
    "timeoutSeconds",
    "auditSeconds",
}


@dataclass(frozen=True)
class WebhookConfig:
    """`webhook:` in lower.yaml. `host`: what the apiserver dials (default: the node's
    internal IP, which the kubelet serving certificate covers)."""

    enabled: bool = False
    port: int = 10260
    host: str | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    keep_keys: tuple[str, ...] = ()
    timeout_seconds: int = 3
    audit_seconds: float = 60.0


def parse_webhook_config(where: str, raw: Any, base: Path) -> WebhookConfig:
    if raw is None:
        return WebhookConfig()
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: webhook: expected a mapping (enabled, port, ...)")

    def fail(name: str, problem: str) -> ConfigError:
        return ConfigError(f"{where}: webhook.{name}: {problem}")

    reject_unknown(raw, _KEYS, "", fail)

    enabled = raw.get("enabled", False)
    if not isinstance(enabled, bool):
        raise fail("enabled", "expected true or false")
    port = raw.get("port", 10260)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise fail("port", "expected a port number in 1..65535")
    host = raw.get("host")
    if host is not None and (not isinstance(host, str) or not host):
        raise fail("host", "expected a host name or IP address")
    files: dict[str, Path | None] = {}
    for name in ("certFile", "keyFile", "caFile"):
        value = raw.get(name)
        if value is not None and (not isinstance(value, str) or not value):
            raise fail(name, "expected a file path")
        files[name] = None if value is None else base / Path(value).expanduser()
    if (files["certFile"] is None) != (files["keyFile"] is None):
        raise fail("certFile", "certFile and keyFile go together")
    keep = raw.get("keepKeys") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) and k for k in keep):
        raise fail("keepKeys", "expected a list of label or taint keys (shell patterns)")
    timeout = raw.get("timeoutSeconds", 3)
    if isinstance(timeout, bool) or not isinstance(timeout, int) or not 1 <= timeout <= 30:
        raise fail("timeoutSeconds", "expected whole seconds in 1..30 (the API's range)")
    audit = raw.get("auditSeconds", 60)
    if isinstance(audit, bool) or not isinstance(audit, int | float) or audit < 1:
        raise fail("auditSeconds", "expected seconds >= 1")
    return WebhookConfig(
        enabled=enabled,
        port=port,
        host=host,
        cert_file=files["certFile"],
        key_file=files["keyFile"],
        ca_file=files["caFile"],
        keep_keys=tuple(keep),
        timeout_seconds=timeout,
        audit_seconds=float(audit),
    )
