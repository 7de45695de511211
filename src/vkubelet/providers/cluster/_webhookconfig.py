"""`webhook:` in lower.yaml: the constraint webhook's settings (see `_admission`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta, field

from ..._fields import FilePath, Section, decode
from ...sdk import ConfigError

__all__ = ["WebhookConfig", "parse_webhook_config"]


class _Webhook(Section):
    enabled: bool = False
    port: Annotated[int, Meta(ge=1, le=65535, description="a port number in 1..65535")] = 10260
    host: Annotated[str, Meta(min_length=1, description="a host name or IP address")] | None = None
    cert_file: FilePath | None = None
    key_file: FilePath | None = None
    ca_file: FilePath | None = field(default=None, name="caFile")
    keep_keys: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(description="a list of label or taint keys (shell patterns)"),
    ] = field(default_factory=list)
    timeout_seconds: Annotated[
        int, Meta(ge=1, le=30, description="whole seconds in 1..30 (the API's range)")
    ] = 3
    audit_seconds: Annotated[float, Meta(ge=1, description="seconds >= 1")] = 60.0


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
    hook = decode(raw, _Webhook, where, at="webhook")
    if (hook.cert_file is None) != (hook.key_file is None):
        raise ConfigError(f"{where}: webhook.certFile: certFile and keyFile go together")

    def file(value: str | None) -> Path | None:
        return None if value is None else base / Path(value).expanduser()

    return WebhookConfig(
        enabled=hook.enabled,
        port=hook.port,
        host=hook.host,
        cert_file=file(hook.cert_file),
        key_file=file(hook.key_file),
        ca_file=file(hook.ca_file),
        keep_keys=tuple(hook.keep_keys),
        timeout_seconds=hook.timeout_seconds,
        audit_seconds=hook.audit_seconds,
    )
