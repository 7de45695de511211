"""The image store: every VM image downloaded once, kept by content, shared by all pods.

Layout (virtlet's, so its tooling and habits carry over):

    <root>/data/<sha256>          the image bytes, named by their digest
    <root>/data/part_<random>     a download in progress (never used as an image)
    <root>/links/<name, / -> %>   symlink to ../data/<sha256>: which image name is which content

Why these choices:
- a download goes to a `part_` file that is fsynced, verified and then renamed, so a crash or a
  digest mismatch can never leave a half or wrong image under a digest name;
- a cut connection is resumed with a Range request (guarded by If-Range, so a changed file on the
  server restarts instead of splicing two versions); servers without ranges are restarted; a pull
  that gives up keeps its part file in memory so the kubelet-style retry resumes it;
- concurrent pulls of one URL share one download (a Deployment of 20 VM pods fetches once);
- a rule with `sha256` finds its content without any network when it is already stored; otherwise
  an existing link is trusted (`refresh=True` re-downloads: imagePullPolicy Always);
- credentials never reach a log or an error: they are taken out of the URL before the request
  (httpx logs request URLs) and every URL shown goes through `redact_url`;
- `qemu-img info` tells qcow2 from raw; a qcow2 with a backing file is refused, because a
  downloaded image must never make QEMU open a file of the host's choosing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import os
import re
import secrets
import ssl
import time
import urllib.parse
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Final, Literal, cast

import httpx2 as httpx

from ...sdk.retry import Backoff
from ._disks import DiskError, StoredImage, image_info
from ._translate import ImageSource, redact_url

__all__ = ["ImageStore", "PullError", "StoredImage"]

log = logging.getLogger(__name__)


class _RedactRequestUrls(logging.Filter):
    """httpx logs every request's URL at INFO; the store's URLs may carry tokens in their query
    (presigned URLs), so the store redacts them in httpx's records (credentials in the userinfo
    never get that far: they are sent as an auth header)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple) and any(
            isinstance(arg, httpx.URL) for arg in record.args
        ):
            record.args = tuple(
                redact_url(str(arg)) if isinstance(arg, httpx.URL) else arg for arg in record.args
            )
        return True


_httpx_log = logging.getLogger("httpx2")
if not any(isinstance(f, _RedactRequestUrls) for f in _httpx_log.filters):
    _httpx_log.addFilter(_RedactRequestUrls())

Progress = Callable[[int, int | None], None]

_SHA256: Final = re.compile(r"[0-9a-f]{64}")
_PART: Final = "part_"
_CHUNK: Final = 1 << 20


def _no_progress(done: int, total: int | None) -> None:
    """The default progress callback: nobody listening."""


class PullError(Exception):
    """An image that could not be pulled. `reason` is what a kubelet would put in the
    container's Waiting state; the message is readable and holds no credentials."""

    def __init__(self, message: str, *, reason: str = "ErrImagePull") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass
class _Partial:
    """A part file a failed pull left behind, to resume on the next pull of the same URL."""

    path: Path
    validator: str | None


_LOG_EVERY: Final = 10.0  # seconds between progress lines in the log


@dataclass
class _Download:
    name: str
    task: asyncio.Task[str]
    listeners: list[Progress] = field(default_factory=list)
    waiters: int = 0
    logged: float = field(default_factory=time.monotonic)

    def report(self, done: int, total: int | None) -> None:
        now = time.monotonic()
        if now - self.logged >= _LOG_EVERY:
            self.logged = now
            of = f" of {total} ({100 * done // total}%)" if total else ""
            log.info("pulling image %s: %d bytes%s", self.name, done, of)
        for listener in list(self.listeners):
            try:
                listener(done, total)
            except Exception:
                log.exception("image pull progress callback failed")


@dataclass
class _Transfer:
    """An HTTP download across its attempts: the part file, what it holds and its hash."""

    part: Path
    done: int = 0
    validator: str | None = None
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)

    def restart(self) -> None:
        self.done, self.hasher = 0, hashlib.sha256()


class _Incomplete(Exception):
    """The server closed the body early (its Content-Length was not reached)."""


class ImageStore:
    def __init__(
        self,
        root: Path,
        *,
        timeout: float = 60.0,
        retries: int = 5,
        retry_delay: float = 0.5,
        verify: ssl.SSLContext | Path | str | bool = True,
    ) -> None:
        """`verify`: TLS verification for https images (a CA bundle file or an SSLContext for
        a private mirror; True: the usual CAs)."""
        self.root = root
        self.data = root / "data"
        self.links = root / "links"
        self.data.mkdir(parents=True, exist_ok=True)
        self.links.mkdir(parents=True, exist_ok=True)
        self._timeout = timeout
        self._retries = retries
        self._backoff = Backoff(initial=retry_delay, cap=5 * retry_delay)
        self._verify = (
            ssl.create_default_context(cafile=str(verify))
            if isinstance(verify, str | Path)
            else verify
        )
        self._downloads: dict[tuple[str, str | None], _Download] = {}
        self._active_parts: set[Path] = set()
        self._partials: dict[str, _Partial] = {}
        self._pinned: collections.Counter[str] = collections.Counter()

    # -- names ------------------------------------------------------------------------------------
    def link_path(self, name: str) -> Path:
        return self.links / name.replace("/", "%")

    def _linked_digest(self, name: str) -> str | None:
        try:
            target = self.link_path(name).readlink()
        except OSError:
            return None
        digest = Path(target).name
        return digest if _SHA256.fullmatch(digest) and (self.data / digest).is_file() else None

    def _link(self, name: str, digest: str) -> None:
        """Point the name at the digest atomically (a reader sees the old or the new link)."""
        link = self.link_path(name)
        temporary = self.links / f".tmp_{secrets.token_hex(8)}"
        temporary.symlink_to(f"../data/{digest}")
        temporary.replace(link)

    # -- pulling ----------------------------------------------------------------------------------
    async def pull(
        self, source: ImageSource, progress: Progress = _no_progress, *, refresh: bool = False
    ) -> StoredImage:
        digest = None
        if not refresh:
            if source.sha256 is not None:
                if (self.data / source.sha256).is_file():
                    digest = source.sha256
            else:
                digest = self._linked_digest(source.name)
        if digest is None:
            digest = await self._fetch_shared(source, progress)  # returns it pinned
        else:
            self._pin(digest)  # against gc until the link is made
        try:
            path = self.data / digest
            try:
                info = await image_info(path)
            except DiskError as exc:
                raise PullError(f"image {source.name}: {exc}") from None
            if info.format not in ("qcow2", "raw"):
                raise PullError(
                    f"image {source.name}: format {info.format!r} is not supported (qcow2 or raw)"
                )
            if info.backing_file is not None:
                raise PullError(
                    f"image {source.name}: a qcow2 image with a backing file is refused"
                )
            self._link(source.name, digest)
        finally:
            self._unpin(digest)
        fmt: Literal["qcow2", "raw"] = "qcow2" if info.format == "qcow2" else "raw"
        return StoredImage(path=path, sha256=digest, format=fmt, virtual_size=info.virtual_size)

    async def _fetch_shared(self, source: ImageSource, progress: Progress) -> str:
        """The digest, pinned against gc (the caller unpins). The download stays registered
        until its last waiter has pinned the result: gc, which keeps registered downloads'
        digests, can then never slip in between the rename and the link."""
        key = (source.url, source.sha256)
        download = self._downloads.get(key)
        if download is None:
            task = asyncio.get_running_loop().create_task(self._fetch(source, key))
            download = _Download(source.name, task)
            self._downloads[key] = download
            task.add_done_callback(lambda _: self._forget(key, download))
        download.listeners.append(progress)
        download.waiters += 1
        try:
            # Shielded: one pod giving up must not cancel the download the others wait for.
            digest = await asyncio.shield(download.task)
            self._pin(digest)
            return digest
        finally:
            with contextlib.suppress(ValueError):
                download.listeners.remove(progress)
            download.waiters -= 1
            self._forget(key, download)

    def _pin(self, digest: str) -> None:
        self._pinned[digest] += 1

    def _unpin(self, digest: str) -> None:
        self._pinned[digest] -= 1
        if self._pinned[digest] <= 0:
            del self._pinned[digest]

    def _forget(self, key: tuple[str, str | None], download: _Download) -> None:
        if download.waiters == 0 and download.task.done() and self._downloads.get(key) is download:
            del self._downloads[key]

    async def _fetch(self, source: ImageSource, key: tuple[str, str | None]) -> str:
        def report(done: int, total: int | None) -> None:
            download = self._downloads.get(key)
            if download is not None:
                download.report(done, total)

        if source.sha256 is not None and (self.data / source.sha256).is_file():
            return source.sha256
        shown = redact_url(source.url)
        started = time.monotonic()
        log.info("pulling image %s from %s", source.name, shown)
        scheme = urllib.parse.urlsplit(source.url).scheme
        if scheme == "file":
            part, digest = await self._copy_file(source, report)
        elif scheme in ("http", "https"):
            part, digest = await self._download(source, report)
        else:
            raise PullError(f"image {source.name}: unsupported URL scheme {scheme!r}")
        try:
            if source.sha256 is not None and digest != source.sha256:
                raise PullError(
                    f"image {source.name}: digest mismatch: expected sha256 {source.sha256}, "
                    f"got {digest} from {shown}"
                )
            size = _size(part)
            await asyncio.to_thread(_fsync_file, part)
            target = self.data / digest
            # Pinned from here until this task's result is set (then gc keeps the digest of
            # a finished download until its waiters have pinned it themselves).
            self._pin(digest)
            try:
                if target.is_file():
                    part.unlink()
                else:
                    part.replace(target)
                    await asyncio.to_thread(_fsync_dir, self.data)
            finally:
                self._unpin(digest)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
        finally:
            self._active_parts.discard(part)
        elapsed = time.monotonic() - started
        log.info(
            "pulled image %s: %d bytes in %.1fs, sha256 %s", source.name, size, elapsed, digest
        )
        return digest

    def _new_part(self) -> Path:
        part = self.data / f"{_PART}{secrets.token_hex(8)}"
        self._active_parts.add(part)
        return part

    async def _copy_file(self, source: ImageSource, report: Progress) -> tuple[Path, str]:
        """file:// : hard-link when the image is on the store's filesystem (no copy, same
        bytes), else copy; either way hash what the store will hold. In a thread: a multi-GB
        copy must not stall the event loop."""
        src = Path(urllib.parse.unquote(urllib.parse.urlsplit(source.url).path))
        part = self._new_part()
        loop = asyncio.get_running_loop()

        def threadsafe_report(done: int, total: int | None) -> None:
            loop.call_soon_threadsafe(report, done, total)

        try:
            digest = await asyncio.to_thread(
                _copy_and_hash, src, part, self.data, threadsafe_report
            )
        except BaseException as exc:
            part.unlink(missing_ok=True)
            self._active_parts.discard(part)
            if isinstance(exc, OSError):
                why = exc.strerror or str(exc)
                raise PullError(f"image {source.name}: cannot read {src}: {why}") from None
            raise
        return part, digest

    async def _download(self, source: ImageSource, report: Progress) -> tuple[Path, str]:
        url, auth = _split_credentials(source.url)
        shown = redact_url(source.url)
        partial = self._partials.pop(source.url, None)
        if partial is not None and partial.path.is_file():
            self._active_parts.add(partial.path)
            transfer = _Transfer(partial.path, _size(partial.path), partial.validator)
            await asyncio.to_thread(_hash_into, partial.path, transfer.hasher)
        else:
            transfer = _Transfer(self._new_part())
            transfer.part.write_bytes(b"")
        part = transfer.part
        failures = 0
        timeout = httpx.Timeout(self._timeout, connect=min(self._timeout, 30.0))
        try:
            async with httpx.AsyncClient(
                follow_redirects=True,
                max_redirects=5,
                timeout=timeout,
                auth=auth,
                verify=self._verify,
            ) as client:
                while True:
                    before = transfer.done
                    try:
                        await self._attempt(client, url, shown, source.name, transfer, report)
                        return part, transfer.hasher.hexdigest()
                    except (httpx.TransportError, _Incomplete) as exc:
                        # An interruption after progress counts once: only a server that is
                        # stuck for `retries` attempts in a row makes the pull give up.
                        failures = 1 if transfer.done > before else failures + 1
                        if failures > self._retries:
                            self._partials[source.url] = _Partial(part, transfer.validator)
                            self._active_parts.discard(part)
                            raise PullError(
                                f"image {source.name}: downloading {shown} failed after "
                                f"{transfer.done} bytes: {_describe(exc)}"
                            ) from None
                        log.info(
                            "image %s: download interrupted at %d bytes (%s); retrying",
                            source.name,
                            transfer.done,
                            _describe(exc),
                        )
                        await asyncio.sleep(self._backoff.delay(failures))
                    except httpx.HTTPError as exc:  # too many redirects and the like: final
                        raise PullError(
                            f"image {source.name}: downloading {shown}: {_describe(exc)}"
                        ) from None
                    except OSError as exc:  # the store's disk, e.g. full
                        raise PullError(
                            f"image {source.name}: writing {part}: {exc.strerror or exc}"
                        ) from None
        except BaseException:
            kept = self._partials.get(source.url)
            if kept is None or kept.path != part:
                part.unlink(missing_ok=True)
                self._active_parts.discard(part)
            raise

    async def _attempt(
        self,
        client: httpx.AsyncClient,
        url: str,
        shown: str,
        name: str,
        transfer: _Transfer,
        report: Progress,
    ) -> None:
        """One GET: resumes at `transfer.done` when the server can, restarts the file when it
        sends the whole body. Returns when the body is complete."""
        headers = {"Accept-Encoding": "identity"}
        if transfer.done:
            headers["Range"] = f"bytes={transfer.done}-"
            if transfer.validator:
                headers["If-Range"] = transfer.validator
        async with client.stream("GET", url, headers=headers) as response:
            status = response.status_code
            start, range_total = _content_range(response)
            if transfer.done and status == 206 and start == transfer.done:
                total = range_total
                mode = "ab"
            elif status == 200:
                total = _int_header(response, "content-length")
                transfer.restart()
                mode = "wb"
            elif transfer.done and status == 206:
                # A range we did not ask for: splicing it would corrupt the image. Start over.
                transfer.restart()
                raise _Incomplete(f"server answered the resume with {_content_range(response)}")
            elif transfer.done and status == 416:
                # Our part is at least as long as the file: it changed under us. Start over.
                transfer.restart()
                transfer.part.write_bytes(b"")
                raise _Incomplete("server refused the resume range")
            else:
                phrase = response.reason_phrase
                raise PullError(f"image {name}: GET {shown}: HTTP {status} {phrase}")
            transfer.validator = _validator(response) or (
                transfer.validator if status == 206 else None
            )
            report(transfer.done, total)
            with _open(transfer.part, mode) as writer:
                # No chunk size: httpx would hold bytes back until a chunk fills, and a cut
                # connection would lose them instead of resuming after them.
                async for chunk in response.aiter_raw():
                    writer.write(chunk)
                    transfer.hasher.update(chunk)
                    transfer.done += len(chunk)
                    report(transfer.done, total)
            if total is not None and transfer.done < total:
                raise _Incomplete(f"body ended at {transfer.done} of {total} bytes")

    # -- housekeeping -----------------------------------------------------------------------------
    def gc(self, in_use: Collection[str], *, min_age: float = 0.0) -> list[str]:
        """Remove what no pod uses: links not named in `in_use` (image names, or digests, e.g.
        of overlays' backing files) and older than `min_age` seconds, dangling links, data files
        no remaining link or digest keeps, and part files no download is writing. Returns the
        digests removed."""
        keep = {entry for entry in in_use if _SHA256.fullmatch(entry)}
        keep_links = {self.link_path(entry).name for entry in in_use}
        keep.update(self._pinned)
        for download in self._downloads.values():
            task = download.task
            if task.done() and not task.cancelled() and task.exception() is None:
                keep.add(task.result())
        now = time.time()
        for link in self.links.iterdir():
            try:
                digest = link.readlink().name
                age = now - link.lstat().st_mtime
            except OSError:
                continue  # a temporary link mid-rename or not a link: leave it
            if not (self.data / digest).is_file():
                link.unlink(missing_ok=True)
            elif link.name in keep_links or age < min_age:
                keep.add(digest)
            else:
                log.info("image gc: forgetting %s", link.name.replace("%", "/"))
                link.unlink(missing_ok=True)
        removed = []
        for path in self.data.iterdir():
            if path.name.startswith(_PART):
                if path not in self._active_parts:
                    path.unlink(missing_ok=True)
                    self._partials = {url: p for url, p in self._partials.items() if p.path != path}
            elif _SHA256.fullmatch(path.name) and path.name not in keep:
                path.unlink(missing_ok=True)
                removed.append(path.name)
        if removed:
            log.info("image gc: removed %d image(s): %s", len(removed), ", ".join(removed))
        return sorted(removed)

    async def aclose(self) -> None:
        """Stop the downloads in progress (their part files are removed)."""
        tasks = [download.task for download in self._downloads.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


def _split_credentials(url: str) -> tuple[str, httpx.BasicAuth | None]:
    """The URL without user:password, and those as auth: what is logged has no secret."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    netloc = parts.netloc.rpartition("@")[2]
    auth = httpx.BasicAuth(
        urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")
    )
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), auth


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _int_header(response: httpx.Response, name: str) -> int | None:
    value = response.headers.get(name)
    return int(value) if value is not None and value.isdigit() else None


def _content_range(response: httpx.Response) -> tuple[int | None, int | None]:
    match = re.fullmatch(
        r"bytes (\d+)-\d+/(\d+|\*)", response.headers.get("content-range", "").strip()
    )
    if match is None:
        return None, None
    total = match.group(2)
    return int(match.group(1)), (int(total) if total.isdigit() else None)


def _validator(response: httpx.Response) -> str | None:
    """What If-Range may carry: a strong ETag, else Last-Modified."""
    etag = response.headers.get("etag")
    if etag and not etag.startswith("W/"):
        return etag
    return response.headers.get("last-modified")


def _size(path: Path) -> int:
    return path.stat().st_size


def _open(path: Path, mode: str) -> BinaryIO:
    """The part file, written on the loop: chunks are small and page-cache writes fast."""
    return cast(BinaryIO, path.open(mode))


def _copy_and_hash(src: Path, part: Path, data: Path, report: Progress) -> str:
    if not src.is_file():
        raise OSError(f"{src} is not a regular file")
    total = src.stat().st_size
    linked = False
    if src.stat().st_dev == data.stat().st_dev:
        try:
            os.link(src, part)
            linked = True
        except OSError:
            pass  # protected_hardlinks, another owner...: copy instead
    hasher = hashlib.sha256()
    done = 0
    with src.open("rb") as reader, contextlib.ExitStack() as stack:
        writer = None if linked else stack.enter_context(part.open("wb"))
        while chunk := reader.read(_CHUNK):
            hasher.update(chunk)
            if writer is not None:
                writer.write(chunk)
            done += len(chunk)
            report(done, total)
    return hasher.hexdigest()


def _hash_into(path: Path, hasher: hashlib._Hash) -> None:
    with path.open("rb") as reader:
        while chunk := reader.read(_CHUNK):
            hasher.update(chunk)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    _fsync_file(path)
