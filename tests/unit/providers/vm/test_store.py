"""The image store against a real HTTP server on 127.0.0.1 and real qemu-img."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import hashlib
import ipaddress
import logging
import os
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vkubelet.providers.vm._disks import create_overlay, image_info
from vkubelet.providers.vm._store import ImageStore, PullError
from vkubelet.providers.vm._translate import ImageSource
from vkubelet.testing.harness import eventually

pytestmark = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img")


@pytest.fixture(scope="module")
def qcow2(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small qcow2 with some data in it (so a download spans several reads)."""
    where = tmp_path_factory.mktemp("img")
    raw = where / "disk.raw"
    raw.write_bytes(os.urandom(512 * 1024) + bytes(512 * 1024))
    subprocess.run(
        ["qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, where / "disk.qcow2"], check=True
    )
    return (where / "disk.qcow2").read_bytes()


@dataclass
class Server:
    """A tiny HTTP/1.1 file server with the misbehaviours the store must survive."""

    files: dict[str, bytes] = field(default_factory=dict)
    ranges: bool = True
    cut_after: int | None = None  # bytes of the body sent before the connection is cut
    cuts: int = 0  # how many responses to cut
    gate: asyncio.Event | None = None  # responses wait for it (after the headers)
    requests: list[dict[str, str]] = field(default_factory=list)
    port: int = 0

    def url(self, path: str, userinfo: str = "") -> str:
        return f"http://{userinfo}127.0.0.1:{self.port}/{path}"

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode()
        except asyncio.IncompleteReadError:
            writer.close()
            return
        line, *lines = head.strip().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        path = line.split(" ")[1].lstrip("/")
        self.requests.append({"path": path, **headers})
        body = self.files.get(path)
        if path == "loop":
            writer.write(b"HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\n\r\n")
        elif body is None:
            writer.write(
                b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
        else:
            status, start = "200 OK", 0
            extra = f'ETag: "{hashlib.sha256(body).hexdigest()[:16]}"\r\n'
            wanted = headers.get("range", "")
            if self.ranges:
                extra += "Accept-Ranges: bytes\r\n"
                if wanted.startswith("bytes=") and headers.get("if-range", "") in extra:
                    start = int(wanted[6:].rstrip("-"))
                    status = "206 Partial Content"
                    extra += f"Content-Range: bytes {start}-{len(body) - 1}/{len(body)}\r\n"
            payload = body[start:]
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Length: {len(payload)}\r\n{extra}"
                "Connection: close\r\n\r\n".encode()
            )
            if self.gate is not None:
                await writer.drain()
                await self.gate.wait()
            if self.cuts and self.cut_after is not None:
                self.cuts -= 1
                payload = payload[: self.cut_after]
            writer.write(payload)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()


@pytest.fixture
async def server() -> AsyncIterator[Server]:
    state = Server()
    listener = await asyncio.start_server(state.serve, "127.0.0.1", 0)
    state.port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield state


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "images", retry_delay=0.01)


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_in(directory: Path) -> list[str]:
    return sorted(path.name for path in directory.iterdir())


async def test_a_pulled_image_is_stored_by_digest_with_a_readable_link(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    seen: list[tuple[int, int | None]] = []
    image = await store.pull(
        ImageSource("vm.vkubelet.io/os/tiny", server.url("tiny.qcow2")),
        lambda done, total: seen.append((done, total)),
    )
    assert image.sha256 == digest(qcow2)
    assert image.path == store.data / digest(qcow2)
    assert image.path.read_bytes() == qcow2
    assert (image.format, image.virtual_size) == ("qcow2", 1024 * 1024)
    link = store.links / "vm.vkubelet.io%os%tiny"
    assert str(link.readlink()) == f"../data/{digest(qcow2)}"
    assert files_in(store.data) == [digest(qcow2)]
    assert seen[-1] == (len(qcow2), len(qcow2))
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


async def test_a_cut_download_is_resumed_with_a_range_request(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    server.cut_after, server.cuts = 70_000, 1
    image = await store.pull(ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2")))
    assert image.path.read_bytes() == qcow2
    assert [r.get("range") for r in server.requests] == [None, "bytes=70000-"]
    assert server.requests[1]["if-range"].startswith('"')


async def test_a_cut_download_restarts_when_the_server_has_no_ranges(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    server.ranges = False
    server.cut_after, server.cuts = 70_000, 2
    image = await store.pull(ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2")))
    assert image.sha256 == digest(qcow2)
    assert image.path.read_bytes() == qcow2
    assert len(server.requests) == 3


async def test_a_pull_that_gives_up_is_resumed_by_the_next_pull(
    server: Server, tmp_path: Path, qcow2: bytes
) -> None:
    store = ImageStore(tmp_path / "images", retries=0, retry_delay=0.01)
    server.files["tiny.qcow2"] = qcow2
    server.cut_after, server.cuts = 70_000, 1
    source = ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2"))
    with pytest.raises(PullError, match="failed after 70000 bytes") as caught:
        await store.pull(source)
    assert caught.value.reason == "ErrImagePull"
    assert [name[:5] for name in files_in(store.data)] == ["part_"]
    image = await store.pull(source)
    assert image.path.read_bytes() == qcow2
    assert server.requests[-1]["range"] == "bytes=70000-"
    assert files_in(store.data) == [digest(qcow2)]


async def test_a_file_changed_on_the_server_is_downloaded_again_not_spliced(
    server: Server, tmp_path: Path
) -> None:
    store = ImageStore(tmp_path / "images", retries=0, retry_delay=0.01)
    server.files["tiny.qcow2"] = os.urandom(300_000)  # raw images: any bytes are valid
    server.cut_after, server.cuts = 70_000, 1
    source = ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2"))
    with pytest.raises(PullError):
        await store.pull(source)
    changed = os.urandom(300_000)
    server.files["tiny.qcow2"] = changed
    image = await store.pull(source)
    assert server.requests[-1]["range"] == "bytes=70000-"  # asked, If-Range said no
    assert image.path.read_bytes() == changed
    assert image.sha256 == digest(changed)


async def test_a_digest_mismatch_fails_and_keeps_nothing(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    wrong = "0" * 64
    source = ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2"), sha256=wrong)
    with pytest.raises(PullError) as caught:
        await store.pull(source)
    assert caught.value.reason == "ErrImagePull"
    assert wrong in str(caught.value) and digest(qcow2) in str(caught.value)
    assert files_in(store.data) == []
    assert files_in(store.links) == []


async def test_concurrent_pulls_of_one_url_download_it_once(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    server.gate = asyncio.Event()
    progress: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    pulls = [
        asyncio.create_task(
            store.pull(
                ImageSource(f"vm.vkubelet.io/{name}", server.url("tiny.qcow2")),
                lambda done, _total, name=name: progress[name].append(done),  # type: ignore[misc]
            )
        )
        for name in progress
    ]
    await eventually(lambda: server.requests, what="the download to start")
    server.gate.set()
    images = await asyncio.gather(*pulls)
    assert len(server.requests) == 1
    assert {image.path for image in images} == {store.data / digest(qcow2)}
    assert files_in(store.links) == ["vm.vkubelet.io%a", "vm.vkubelet.io%b", "vm.vkubelet.io%c"]
    assert all(seen[-1] == len(qcow2) for seen in progress.values())


async def test_a_pull_given_up_by_one_pod_goes_on_for_the_others(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    server.gate = asyncio.Event()
    source = ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2"))
    first = asyncio.create_task(store.pull(source))
    second = asyncio.create_task(store.pull(source))
    await eventually(lambda: server.requests, what="the download to start")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    server.gate.set()
    assert (await second).path.read_bytes() == qcow2
    assert len(server.requests) == 1


async def test_a_stored_image_is_not_downloaded_again(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    pinned = ImageSource("vm.vkubelet.io/a", server.url("tiny.qcow2"), sha256=digest(qcow2))
    await store.pull(pinned)
    # Another name with the same digest finds the content without the network ...
    await store.pull(ImageSource("vm.vkubelet.io/b", server.url("gone"), sha256=digest(qcow2)))
    # ... and a name without digest trusts its link.
    await store.pull(ImageSource("vm.vkubelet.io/a", server.url("gone")))
    assert len(server.requests) == 1
    await store.pull(ImageSource("vm.vkubelet.io/a", server.url("tiny.qcow2")), refresh=True)
    assert len(server.requests) == 2


async def test_an_http_error_names_the_status_and_never_the_credentials(
    server: Server, store: ImageStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    url = server.url("missing.qcow2?token=s3cr3t", userinfo="alice:hunter2@")
    with pytest.raises(PullError, match="HTTP 404") as caught:
        await store.pull(ImageSource("vm.vkubelet.io/x", url))
    expected = "Basic " + base64.b64encode(b"alice:hunter2").decode()
    assert server.requests[0]["authorization"] == expected
    for text in (str(caught.value), caplog.text):
        assert "hunter2" not in text and "s3cr3t" not in text and "alice" not in text


async def test_a_redirect_loop_is_a_pull_error(server: Server, store: ImageStore) -> None:
    with pytest.raises(PullError, match="TooManyRedirects") as caught:
        await store.pull(ImageSource("vm.vkubelet.io/x", server.url("loop")))
    assert caught.value.reason == "ErrImagePull"
    assert len(server.requests) == 6
    assert files_in(store.data) == []


async def test_a_file_url_on_the_same_filesystem_is_hard_linked(
    store: ImageStore, tmp_path: Path, qcow2: bytes
) -> None:
    source_file = tmp_path / "my image.qcow2"
    source_file.write_bytes(qcow2)
    image = await store.pull(ImageSource("vm.vkubelet.io/f", "file://" + str(source_file)))
    assert image.path.read_bytes() == qcow2
    assert image.path.stat().st_ino == source_file.stat().st_ino


async def test_a_file_url_is_copied_when_it_cannot_be_linked(
    store: ImageStore, tmp_path: Path, qcow2: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*_: object) -> None:
        raise PermissionError("protected_hardlinks")

    monkeypatch.setattr(os, "link", refuse)
    source_file = tmp_path / "disk.qcow2"
    source_file.write_bytes(qcow2)
    seen: list[tuple[int, int | None]] = []
    image = await store.pull(
        ImageSource("vm.vkubelet.io/f", source_file.as_uri()),
        lambda done, total: seen.append((done, total)),
    )
    assert image.path.read_bytes() == qcow2
    assert image.path.stat().st_ino != source_file.stat().st_ino
    await eventually(lambda: seen and seen[-1] == (len(qcow2), len(qcow2)), what="last progress")


async def test_a_missing_file_url_is_a_pull_error(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(PullError, match="cannot read"):
        await store.pull(ImageSource("vm.vkubelet.io/f", f"file://{tmp_path}/nope.qcow2"))
    assert files_in(store.data) == []


async def test_raw_images_are_accepted_and_backed_qcow2_images_refused(
    store: ImageStore, tmp_path: Path
) -> None:
    raw = tmp_path / "disk.raw"
    raw.write_bytes(bytes(1 << 20))
    image = await store.pull(ImageSource("vm.vkubelet.io/raw", raw.as_uri()))
    assert (image.format, image.virtual_size) == ("raw", 1 << 20)
    backed = tmp_path / "backed.qcow2"
    create = await asyncio.create_subprocess_exec(
        "qemu-img", "create", "-q", "-f", "qcow2", "-b", raw, "-F", "raw", backed
    )
    assert await create.wait() == 0
    with pytest.raises(PullError, match="backing file"):
        await store.pull(ImageSource("vm.vkubelet.io/backed", backed.as_uri()))
    assert files_in(store.links) == ["vm.vkubelet.io%raw"]


async def test_an_image_in_another_format_is_refused(store: ImageStore, tmp_path: Path) -> None:
    vmdk = tmp_path / "disk.vmdk"
    create = await asyncio.create_subprocess_exec(
        "qemu-img", "create", "-q", "-f", "vmdk", vmdk, "1M"
    )
    assert await create.wait() == 0
    with pytest.raises(PullError, match="format 'vmdk' is not supported"):
        await store.pull(ImageSource("vm.vkubelet.io/vmdk", vmdk.as_uri()))


async def test_a_pulled_image_backs_a_pod_overlay(
    server: Server, store: ImageStore, qcow2: bytes, tmp_path: Path
) -> None:
    server.files["tiny.qcow2"] = qcow2
    image = await store.pull(ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2")))
    await create_overlay(image, tmp_path / "root.qcow2", size="2Mi")
    info = await image_info(tmp_path / "root.qcow2")
    assert (info.backing_file, info.virtual_size) == (str(image.path), 2 << 20)
    assert store.gc([image.sha256]) == []  # an overlay's digest keeps its image


async def test_gc_removes_unused_images_and_dangling_links_only(
    store: ImageStore, tmp_path: Path, qcow2: bytes
) -> None:
    one, two, three = tmp_path / "1.img", tmp_path / "2.img", tmp_path / "3.img"
    one.write_bytes(qcow2)
    two.write_bytes(b"\0" * 4096)
    three.write_bytes(b"\1" * 4096)
    a = await store.pull(ImageSource("vm.vkubelet.io/a", one.as_uri()))
    b = await store.pull(ImageSource("vm.vkubelet.io/b", two.as_uri()))
    c = await store.pull(ImageSource("vm.vkubelet.io/c", three.as_uri()))
    (store.links / "vm.vkubelet.io%dangling").symlink_to("../data/" + "f" * 64)
    stale = store.data / "part_0123456789abcdef"
    stale.write_bytes(b"left by a crash")
    removed = store.gc(["vm.vkubelet.io/a", c.sha256])
    assert removed == [b.sha256]
    assert files_in(store.links) == ["vm.vkubelet.io%a"]
    assert files_in(store.data) == sorted([a.sha256, c.sha256])
    assert store.gc([]) == sorted([a.sha256, c.sha256])
    assert files_in(store.data) == []


async def test_gc_keeps_young_images_when_asked(store: ImageStore, tmp_path: Path) -> None:
    (tmp_path / "1.img").write_bytes(b"\0" * 4096)
    image = await store.pull(ImageSource("vm.vkubelet.io/a", (tmp_path / "1.img").as_uri()))
    assert store.gc([], min_age=3600) == []
    assert files_in(store.data) == [image.sha256]


async def test_gc_never_removes_a_download_in_progress(
    server: Server, store: ImageStore, qcow2: bytes
) -> None:
    server.files["tiny.qcow2"] = qcow2
    server.gate = asyncio.Event()
    pull = asyncio.create_task(
        store.pull(ImageSource("vm.vkubelet.io/tiny", server.url("tiny.qcow2")))
    )
    part = await eventually(
        lambda: [p for p in store.data.iterdir() if p.name.startswith("part_")],
        what="the part file",
    )
    assert store.gc([]) == []
    assert part[0].exists()
    server.gate.set()
    image = await pull
    assert image.path.read_bytes() == qcow2


@pytest.mark.parametrize("scheme", ["http", "file"])
async def test_gc_running_all_through_a_pull_never_takes_its_image(
    server: Server, store: ImageStore, qcow2: bytes, tmp_path: Path, scheme: str
) -> None:
    server.files["tiny.qcow2"] = qcow2
    (tmp_path / "tiny.qcow2").write_bytes(qcow2)
    url = server.url("tiny.qcow2") if scheme == "http" else (tmp_path / "tiny.qcow2").as_uri()
    runs = 0

    async def collect_on_every_turn() -> None:
        nonlocal runs
        while True:
            store.gc([])
            runs += 1
            await asyncio.sleep(0)

    async def pull_and_read(name: str) -> bytes:
        image = await store.pull(ImageSource(f"vm.vkubelet.io/{name}", url))
        return image.path.read_bytes()  # before gc's next turn (the image is unused then)

    collector = asyncio.create_task(collect_on_every_turn())
    try:
        read = await asyncio.gather(pull_and_read("a"), pull_and_read("b"))
        assert list(read) == [qcow2, qcow2]
    finally:
        collector.cancel()
    assert runs > 10


def tls_for_localhost(directory: Path) -> ssl.SSLContext:
    """A self-signed certificate for 127.0.0.1, written to directory/cert.pem as the CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "image-mirror")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    (directory / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(directory / "cert.pem", directory / "key.pem")
    return context


async def test_https_images_are_verified_against_the_configured_ca(
    tmp_path: Path, qcow2: bytes
) -> None:
    state = Server(files={"tiny.qcow2": qcow2})
    listener = await asyncio.start_server(
        state.serve, "127.0.0.1", 0, ssl=tls_for_localhost(tmp_path)
    )
    url = f"https://127.0.0.1:{listener.sockets[0].getsockname()[1]}/tiny.qcow2"
    async with listener:
        untrusting = ImageStore(tmp_path / "a", retries=0)
        with pytest.raises(PullError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify"):
            await untrusting.pull(ImageSource("vm.vkubelet.io/tiny", url))
        trusting = ImageStore(tmp_path / "b", verify=str(tmp_path / "cert.pem"))
        image = await trusting.pull(ImageSource("vm.vkubelet.io/tiny", url))
        assert image.path.read_bytes() == qcow2
