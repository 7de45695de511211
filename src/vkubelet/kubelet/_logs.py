"""`/containerLogs`: a provider's log stream as a chunked response, flushed chunk by chunk.

`kubectl logs -f` shows lines as the apiserver relays them, and the apiserver relays as the
kubelet flushes, so every chunk is written out at once. The connection layer cancels the stream
when the client hangs up, which ends the provider's iterator too.

An error from the provider before the first chunk is a 400 whose body is the provider's message,
whatever the error: the kubelet answers every container-log error so, and the apiserver passes
a 400's message on to kubectl (`Error from server (BadRequest): previous terminated container
"main" in pod "x" not found`), where a 404 or 500 would become a generic message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import datetime

from ..sdk.provider import ContainerLogOptions, ContainerLogs, ProviderError
from ._context import Call
from ._http import HttpError, Request

log = logging.getLogger(__name__)

_TRUE = {"1", "t", "true"}
_FALSE = {"0", "f", "false", ""}


def _bool(request: Request, name: str) -> bool:
    value = request.param(name)
    if value is None:
        return False
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise HttpError(400, f"query parameter {name!r}: {value!r} is not a boolean")


def _int(request: Request, name: str, minimum: int) -> int | None:
    value = request.param(name)
    if value is None or value == "":
        return None
    try:
        number = int(value)
    except ValueError:
        raise HttpError(400, f"query parameter {name!r}: {value!r} is not an integer") from None
    if number < minimum:
        raise HttpError(400, f"query parameter {name!r} must be at least {minimum}")
    return number


def log_options(request: Request) -> ContainerLogOptions:
    """The query as the kubelet validates it (PodLogOptions)."""
    since_time = None
    if raw := request.param("sinceTime"):
        try:
            since_time = datetime.fromisoformat(raw)
        except ValueError:
            raise HttpError(400, f"query parameter 'sinceTime': {raw!r} is not RFC 3339") from None
        if since_time.tzinfo is None:
            raise HttpError(400, "query parameter 'sinceTime' needs a time zone")
    since_seconds = _int(request, "sinceSeconds", 1)
    if since_seconds is not None and since_time is not None:
        raise HttpError(400, "at most one of sinceTime or sinceSeconds may be specified")
    return ContainerLogOptions(
        tail_lines=_int(request, "tailLines", 0),
        limit_bytes=_int(request, "limitBytes", 1),
        since_seconds=since_seconds,
        since_time=since_time,
        timestamps=_bool(request, "timestamps"),
        follow=_bool(request, "follow"),
        previous=_bool(request, "previous"),
    )


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    """The next chunk, or None at the end (a task must not end with StopAsyncIteration)."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _reject(call: Call, error: Exception) -> None:
    """The 400 for an error of the provider's: its message alone, as the kubelet's body is."""
    if not isinstance(error, ProviderError):  # more likely a bug than a user's mistake
        request = call.request
        log.warning("%s %s failed: %s", request.method, request.path, error, exc_info=error)
    await call.exchange.respond(400, str(error) or type(error).__name__)


async def handle_logs(call: Call) -> None:
    provider = call.provider
    if not isinstance(provider, ContainerLogs):
        raise call.missing(ContainerLogs, "kubectl logs")
    options = log_options(call.request)
    try:
        chunks = provider.container_logs(
            call.params["namespace"], call.params["pod"], call.params["container"], options
        )
    except Exception as exc:  # a provider that is not a generator may check before it returns
        await _reject(call, exc)
        return
    first = asyncio.create_task(_next(chunks))
    try:
        # Errors the provider finds at once (no such container) become a 400; a follower with
        # nothing to say yet gets its headers anyway, and a later error can only cut the stream.
        await asyncio.wait({first}, timeout=call.config.logs_first_chunk_wait)
        if first.done() and not first.cancelled():
            if isinstance(error := first.exception(), Exception):
                await _reject(call, error)
                return
            if first.result() is None:  # result() raises any other BaseException
                await call.exchange.respond(200, b"")
                return
        exchange = call.exchange
        await exchange.start(
            200, [("Content-Type", "text/plain; charset=utf-8"), ("Cache-Control", "no-cache")]
        )
        remaining = options.limit_bytes
        chunk: bytes | None = await first
        while chunk is not None:
            if remaining is not None:
                chunk = chunk[:remaining]
                remaining -= len(chunk)
            await exchange.write(chunk)
            if remaining == 0:
                break
            chunk = await _next(chunks)
        await exchange.finish()
    finally:
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await first
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
