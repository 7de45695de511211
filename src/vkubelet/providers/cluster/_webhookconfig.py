"""`webhook:` in lower.yaml: the constraint webhook's settings (see `_admission`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from ..._fields import Section, decode
from ...sdk import ConfigError

__all__ = ["WebhookConfig", "parse_webhook_config"]


class WebhookConfig(Section):
    """`webhook:` in lower.yaml. `host`: what the apiserver dials (default: the node's
    internal IP, which the kubelet serving certificate covers)."""

    enabled: bool = False
    port: Annotated[int, Meta(ge=1, le=65535, description="a port number in 1..65535")] = 10260
    host: Annotated[str, Meta(min_length=1, description="a host name or IP address")] | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    ca_file: Path | None = None
    keep_keys: Annotated[
        tuple[Annotated[str, Meta(min_length=1)], ...],
        Meta(description="a list of label or taint keys (shell patterns)"),
    ] = ()
    timeout_seconds: Annotated[
        int, Meta(ge=1, le=30, description="whole seconds in 1..30 (the API's range)")
    ] = 3
    audit_seconds: Annotated[float, Meta(ge=1, description="seconds >= 1")] = 60.0


def parse_webhook_config(where: str, raw: Any, base: Path) -> WebhookConfig:
    if raw is None:
        return WebhookConfig()
    hook = decode(raw, WebhookConfig, where, at="webhook")
    if (hook.cert_file is None) != (hook.key_file is None):
        raise ConfigError(f"{where}: webhook.certFile: certFile and keyFile go together")

    def file(value: Path | None) -> Path | None:
        return None if value is None else base / value.expanduser()

    return msgspec.structs.replace(
        hook,
        cert_file=file(hook.cert_file),
        key_file=file(hook.key_file),
        ca_file=file(hook.ca_file),
    )
