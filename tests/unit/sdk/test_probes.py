"""The probe engine against a fake transport: exec probes answer canned exit codes, connections
go to real local servers (HTTP, HTTPS, TCP, a gRPC health server on h2). A probe second lasts
50 ms here."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from lightkube.models.core_v1 import (
    Container,
    ContainerPort,
    ExecAction,
    GRPCAction,
    HTTPGetAction,
    HTTPHeader,
    PodSpec,
    Probe,
    TCPSocketAction,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from vkubelet.sdk.probes import (
    ExecResult,
    PodProbes,
    ProbeEvent,
    ProbeKind,
    ProbeReader,
    ProbeUnknown,
    ProbeWriter,
)
from vkubelet.testing.harness import eventually

pytestmark = pytest.mark.timeout(30)

SECOND = 0.05
HANG = -1  # a canned answer: none, ever
UNKNOWN = -2  # a canned answer: the transport cannot tell


class FakeTransport:
    def __init__(self) -> None:
        self.up = True
        self.canned: dict[str, list[int]] = {}  # by command; the last answer repeats
        self.probes: list[str] = []  # exec probe commands, as they start
        self.limits: list[float] = []
        self.connections: list[tuple[str, int]] = []
        self.redirect: dict[tuple[str, int], int] = {}  # (host, port) -> the local port it reaches

    def available(self) -> bool:
        return self.up

    async def exec(self, container: str, command: Sequence[str], limit: float) -> ExecResult:
        self.probes.append(command[0])
        self.limits.append(limit)
        answers = self.canned.get(command[0], [0])
        code = answers.pop(0) if len(answers) > 1 else answers[0]
        if code == HANG:
            await asyncio.sleep(3600)
        if code == UNKNOWN:
            raise ProbeUnknown("the backend is down")
        return ExecResult(code, f"{command[0]} said {code}".encode())

    async def open_connection(self, host: str, port: int) -> tuple[ProbeReader, ProbeWriter]:
        self.connections.append((host, port))
        port = self.redirect.get((host, port), port)
        return await asyncio.open_connection("127.0.0.1", port)


class Harness:
    def __init__(self) -> None:
        self.transport = FakeTransport()
        self.events: list[ProbeEvent] = []
        self.restarts: list[tuple[str, int, ProbeKind]] = []
        self.restart_error: Exception | None = None
        self.changes: list[tuple[int, bool, bool]] = []  # (exec probes so far, ready, started)
        self.probes: PodProbes | None = None

    def start(self, pod: Pod, run: object = 0) -> PodProbes:
        self.probes = PodProbes(
            pod,
            self.transport,
            self._restart,
            on_change=self._changed,
            on_event=self.events.append,
            second=SECOND,
        )
        self.probes.sync({"main": run})
        return self.probes

    async def _restart(self, container: str, grace: int, kind: ProbeKind) -> None:
        if self.restart_error is not None:
            raise self.restart_error
        self.restarts.append((container, grace, kind))

    def _changed(self) -> None:
        assert self.probes is not None
        p = self.probes
        self.changes.append((len(self.transport.probes), p.ready("main"), p.started("main")))

    @property
    def ready(self) -> bool:
        assert self.probes is not None
        return self.probes.ready("main")

    def messages(self, reason: str) -> list[str]:
        return [e.message for e in self.events if e.reason == reason]


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    if h.probes is not None:
        await h.probes.aclose()


def exec_probe(command: str, **settings: Any) -> Probe:
    settings.setdefault("periodSeconds", 1)
    return Probe(exec=ExecAction(command=command.split()), **settings)


def make_pod(
    *,
    grace: int | None = 5,
    ports: list[ContainerPort] | None = None,
    startup: Probe | None = None,
    readiness: Probe | None = None,
    liveness: Probe | None = None,
) -> Pod:
    container = Container(
        name="main",
        image="app",
        ports=ports,
        startupProbe=startup,
        readinessProbe=readiness,
        livenessProbe=liveness,
    )
    return Pod(
        metadata=ObjectMeta(name="p", namespace="ns", uid="u1"),
        spec=PodSpec(containers=[container], terminationGracePeriodSeconds=grace),
    )


async def periods(n: float) -> None:
    await asyncio.sleep(n * SECOND)


# -- thresholds -----------------------------------------------------------------------------------
async def test_readiness_turns_true_and_false_only_after_consecutive_results(
    harness: Harness,
) -> None:
    harness.transport.canned["check"] = [1, 0, 0, 1, 0, 1, 1]
    harness.start(make_pod(readiness=exec_probe("check", successThreshold=2, failureThreshold=2)))
    assert not harness.ready  # not ready before a probe said so
    await eventually(lambda: len(harness.transport.probes) >= 10)
    # A success, then the second in a row; a failure, a success (no change), two failures.
    assert [(n, ready) for n, ready, _ in harness.changes] == [(3, True), (7, False)]


async def test_every_failed_probe_is_an_unhealthy_event_in_the_kubelet_s_words(
    harness: Harness,
) -> None:
    harness.transport.canned["check"] = [1, 1, 0]
    harness.start(make_pod(readiness=exec_probe("check")))
    await eventually(lambda: harness.ready)
    assert harness.messages("Unhealthy") == ["Readiness probe failed: check said 1"] * 2
    assert {e.type for e in harness.events} == {"Warning"}
    assert {e.container for e in harness.events} == {"main"}


async def test_liveness_restarts_the_container_once_after_failure_threshold_failures(
    harness: Harness,
) -> None:
    harness.transport.canned["alive"] = [0, 1, 0, 1, 1]
    harness.start(make_pod(grace=5, liveness=exec_probe("alive", failureThreshold=2)))
    await eventually(lambda: bool(harness.restarts))
    assert len(harness.transport.probes) == 5
    await periods(5)  # on hold until the next run: no more probes, no second restart
    assert len(harness.transport.probes) == 5
    assert harness.restarts == [("main", 5, "liveness")]  # the pod's grace period
    assert harness.messages("Killing") == [
        "Container main failed liveness probe, will be restarted"
    ]
    assert harness.ready  # liveness says nothing about readiness


async def test_a_probe_s_own_grace_period_overrides_the_pod_s(harness: Harness) -> None:
    harness.transport.canned["alive"] = [1]
    probe = exec_probe("alive", failureThreshold=1, terminationGracePeriodSeconds=7)
    harness.start(make_pod(grace=30, liveness=probe))
    await eventually(lambda: bool(harness.restarts))
    assert harness.restarts == [("main", 7, "liveness")]


async def test_a_restart_that_failed_is_tried_again_after_the_next_failures(
    harness: Harness,
) -> None:
    harness.transport.canned["alive"] = [1]
    harness.restart_error = RuntimeError("backend busy")
    harness.start(make_pod(liveness=exec_probe("alive", failureThreshold=2)))
    await eventually(lambda: len(harness.messages("Killing")) == 1)
    harness.restart_error = None
    await eventually(lambda: bool(harness.restarts))
    assert len(harness.transport.probes) == 4  # two failures, then two more


async def test_the_initial_delay_holds_the_first_probe_back(harness: Harness) -> None:
    started = time.monotonic()
    harness.start(make_pod(readiness=exec_probe("check", initialDelaySeconds=6)))
    await eventually(lambda: harness.ready)
    assert time.monotonic() - started >= 6 * SECOND
    assert harness.transport.probes == ["check"]


async def test_the_initial_delay_counts_from_a_start_time_the_provider_gives(
    harness: Harness,
) -> None:
    probes = PodProbes(
        make_pod(readiness=exec_probe("check", initialDelaySeconds=3600)),
        harness.transport,
        harness._restart,
        second=SECOND,
    )
    harness.probes = probes
    an_hour_ago = time.time() - 3600 * SECOND
    probes.sync({"main": 0}, started_at={"main": an_hour_ago})
    await eventually(lambda: probes.ready("main"))


async def test_the_period_and_timeout_come_from_the_probe(harness: Harness) -> None:
    harness.start(make_pod(readiness=exec_probe("check", periodSeconds=4, timeoutSeconds=3)))
    await periods(10)
    assert 2 <= len(harness.transport.probes) <= 3  # at 0, 4 and 8 periods
    assert harness.transport.limits[0] == pytest.approx(3 * SECOND)


# -- startup --------------------------------------------------------------------------------------
async def test_a_startup_probe_holds_liveness_and_readiness_back_until_it_succeeds(
    harness: Harness,
) -> None:
    harness.transport.canned |= {"started": [1, 1, 0], "alive": [0], "check": [0]}
    harness.start(
        make_pod(
            startup=exec_probe("started", failureThreshold=5),
            liveness=exec_probe("alive"),
            readiness=exec_probe("check", periodSeconds=1000),
        )
    )
    assert harness.probes is not None and not harness.probes.started("main")
    # Readiness is probed at once when the container has started, not a (long) period later.
    await eventually(lambda: harness.ready)
    probes = harness.transport.probes
    assert probes[:3] == ["started"] * 3
    await periods(4)
    assert probes.count("started") == 3  # done for this run
    assert {"alive", "check"} <= set(probes[3:])
    assert harness.probes.started("main")


async def test_without_a_readiness_probe_a_container_is_ready_once_started(
    harness: Harness,
) -> None:
    harness.transport.canned["started"] = [1, 0]
    harness.start(make_pod(startup=exec_probe("started")))
    assert not harness.ready
    await eventually(lambda: harness.ready)
    assert harness.changes == [(2, True, True)]


async def test_a_startup_probe_that_keeps_failing_restarts_the_container(
    harness: Harness,
) -> None:
    harness.transport.canned |= {"started": [1], "alive": [0]}
    pod = make_pod(startup=exec_probe("started", failureThreshold=3), liveness=exec_probe("alive"))
    harness.start(pod)
    await eventually(lambda: bool(harness.restarts))
    await periods(3)
    assert harness.transport.probes == ["started"] * 3
    assert harness.restarts == [("main", 5, "startup")]
    assert harness.messages("Killing") == ["Container main failed startup probe, will be restarted"]
    assert not harness.ready


async def test_a_container_without_probes_is_ready_and_started_as_soon_as_it_runs(
    harness: Harness,
) -> None:
    probes = harness.start(make_pod())
    assert probes.ready("main") and probes.started("main")
    probes.sync({})  # it stopped
    assert not probes.ready("main") and not probes.started("main")


# -- the transport --------------------------------------------------------------------------------
async def test_an_unavailable_backend_neither_fails_nor_restarts_a_container(
    harness: Harness,
) -> None:
    harness.transport.canned["alive"] = [1]
    harness.transport.up = False
    harness.start(make_pod(liveness=exec_probe("alive", failureThreshold=2)))
    await periods(8)
    assert harness.restarts == []
    assert harness.events == []
    harness.transport.up = True  # the worker is still there, and now failures count
    await eventually(lambda: bool(harness.restarts))


async def test_a_result_the_transport_cannot_vouch_for_counts_neither_way(
    harness: Harness,
) -> None:
    harness.transport.canned["check"] = [0, UNKNOWN, UNKNOWN, UNKNOWN, 1, 1]
    harness.start(make_pod(readiness=exec_probe("check", failureThreshold=2)))
    await eventually(lambda: len(harness.transport.probes) >= 5)
    assert harness.ready  # three unknowns and one failure: not two failures in a row
    await eventually(lambda: not harness.ready)


async def test_a_probe_that_outlasts_its_timeout_is_a_failure(harness: Harness) -> None:
    harness.transport.canned["alive"] = [HANG]
    harness.start(make_pod(liveness=exec_probe("alive", failureThreshold=2)))
    await eventually(lambda: bool(harness.restarts))
    assert len(harness.transport.probes) == 2
    assert (
        harness.messages("Unhealthy")[0]
        == 'Liveness probe failed: command "alive" timed out after 1s'
    )


# -- runs -----------------------------------------------------------------------------------------
async def test_workers_stop_when_the_run_ends_and_start_over_for_the_next(
    harness: Harness,
) -> None:
    probes = harness.start(make_pod(readiness=exec_probe("check")), run=0)
    await eventually(lambda: harness.ready)
    probes.sync({})
    assert probes.workers == 0
    count = len(harness.transport.probes)
    await periods(4)
    assert len(harness.transport.probes) == count
    probes.sync({"main": 1})
    assert not harness.ready  # a new run is not ready before its probe says so
    await eventually(lambda: harness.ready)


async def test_while_the_pod_terminates_only_readiness_is_probed(harness: Harness) -> None:
    harness.transport.canned |= {"alive": [1], "check": [0, 0, 1]}
    probes = harness.start(
        make_pod(liveness=exec_probe("alive", failureThreshold=100), readiness=exec_probe("check"))
    )
    await eventually(lambda: harness.ready)
    probes.sync({"main": 0}, terminating=True)
    count = harness.transport.probes.count("alive")
    await eventually(lambda: not harness.ready)  # readiness still runs: it turns false
    assert harness.transport.probes.count("alive") == count
    assert harness.restarts == []


# -- handlers -------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def http_server(
    requests: list[bytes], tls: ssl.SSLContext | None = None
) -> AsyncIterator[int]:
    """A server answering with the status its path names: /302/elsewhere redirects to the
    path after the code, /none closes without an answer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await reader.readuntil(b"\r\n\r\n")
        requests.append(request)
        path = request.split(b" ")[1].decode()
        code, _, rest = path.strip("/").partition("/")
        if not code.isdigit():
            writer.close()
            return
        location = f"Location: {rest if '://' in rest else '/' + rest}\r\n" if rest else ""
        body = b"hello"
        writer.write(
            f"HTTP/1.1 {code} Whatever\r\n{location}Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    async with server:
        yield server.sockets[0].getsockname()[1]


async def closed_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port: int = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return port


def http_probe(port: int | str, path: str, **settings: Any) -> Probe:
    """Timeout 20 probe seconds (1 s): a probe of several round trips (redirects, TLS) outran
    the default one (50 ms here) on a loaded machine and failed on its timeout instead."""
    settings.setdefault("timeoutSeconds", 20)
    headers = settings.pop("headers", None)
    scheme = settings.pop("scheme", None)
    get = HTTPGetAction(port=port, path=path, httpHeaders=headers, scheme=scheme)
    return Probe(httpGet=get, periodSeconds=1, failureThreshold=1, **settings)


@pytest.mark.parametrize(("code", "ready"), [(200, True), (204, True), (404, False), (500, False)])
async def test_an_http_probe_succeeds_on_a_2xx_status(
    harness: Harness, code: int, ready: bool
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = http_probe("web", str(code), headers=[HTTPHeader("X-A", "b")])
        harness.start(make_pod(ports=[ContainerPort(port, name="web")], readiness=probe))
        await eventually(lambda: len(requests) >= 3)
        assert harness.ready is ready
    head = requests[0].decode().split("\r\n")
    assert head[0] == f"GET /{code} HTTP/1.1"
    assert {"X-A: b", f"Host: 127.0.0.1:{port}", "User-Agent: kube-probe/1.37"} <= set(head)
    assert harness.transport.connections[0] == ("127.0.0.1", port)
    if not ready:
        assert harness.messages("Unhealthy")[0] == (
            f"Readiness probe failed: HTTP probe failed with statuscode: {code}"
        )


async def test_an_http_probe_s_host_header_replaces_the_default(harness: Harness) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = http_probe(port, "/200", headers=[HTTPHeader("Host", "example.test")])
        harness.start(make_pod(readiness=probe))
        await eventually(lambda: harness.ready)
    head = requests[0].decode().split("\r\n")
    assert [line for line in head if line.lower().startswith("host:")] == ["Host: example.test"]


async def test_an_http_probe_follows_a_redirect_to_the_same_host(harness: Harness) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        harness.start(make_pod(readiness=http_probe(port, "/302/500")))
        await eventually(lambda: len(requests) >= 2)
        await eventually(lambda: bool(harness.messages("Unhealthy")))
    assert requests[1].startswith(b"GET /500 ")
    assert not harness.ready  # the final answer counts
    assert harness.messages("Unhealthy")[0].endswith("statuscode: 500")


async def test_an_http_redirect_to_another_host_is_a_success_with_a_warning(
    harness: Harness,
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        probe = http_probe(port, "/301/http://elsewhere.test/x")
        harness.start(make_pod(readiness=probe))
        await eventually(lambda: harness.ready)
    assert len(requests) == 1  # not followed
    assert harness.messages("ProbeWarning")[0] == (
        "Readiness probe warning: Probe terminated redirects, Response body: hello"
    )


async def test_an_http_redirect_without_a_location_is_a_success_with_a_warning(
    harness: Harness,
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        harness.start(make_pod(readiness=http_probe(port, "/302/302/302")))
        await eventually(lambda: harness.ready)
    assert [r.split(b" ")[1] for r in requests[:3]] == [b"/302/302/302", b"/302/302", b"/302"]
    assert harness.messages("ProbeWarning")


async def test_an_http_redirect_loop_fails_after_ten_redirects(harness: Harness) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        harness.start(make_pod(liveness=http_probe(port, "/307" * 30)))
        await eventually(lambda: bool(harness.restarts))
    assert len(requests) == 11
    assert harness.messages("Unhealthy")[0].endswith("stopped after 10 redirects")


async def test_an_http_probe_fails_on_a_connection_closed_without_an_answer(
    harness: Harness,
) -> None:
    requests: list[bytes] = []
    async with http_server(requests) as port:
        harness.start(make_pod(liveness=http_probe(port, "/none")))
        await eventually(lambda: bool(harness.restarts))
    assert len(requests) == 1


async def test_an_http_probe_to_a_closed_port_fails_with_connection_refused(
    harness: Harness,
) -> None:
    port = await closed_port()
    harness.start(make_pod(liveness=http_probe(port, "/healthz")))
    await eventually(lambda: bool(harness.restarts))
    assert harness.messages("Unhealthy")[0] == (
        f'Liveness probe failed: Get "http://127.0.0.1:{port}/healthz": connect: connection refused'
    )


def self_signed(tmp_path: Path) -> ssl.SSLContext:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "probe-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .sign(key, hashes.SHA256())
    )
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return context


async def test_an_https_probe_talks_tls_without_checking_the_certificate(
    harness: Harness, tmp_path: Path
) -> None:
    requests: list[bytes] = []
    async with http_server(requests, tls=self_signed(tmp_path)) as port:
        harness.start(make_pod(readiness=http_probe(port, "/200", scheme="HTTPS")))
        await eventually(lambda: harness.ready)
    assert requests[0].startswith(b"GET /200 HTTP/1.1")


async def test_an_https_probe_loads_no_trust_store_inside_its_timeout(
    harness: Harness, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loading the system's CA store takes tens of milliseconds of CPU, which under load outran
    a probe's timeout (and blocked the event loop) though nothing is verified."""
    server = self_signed(tmp_path)
    loads: list[str] = []
    for method in ("load_default_certs", "set_default_verify_paths", "load_verify_locations"):
        monkeypatch.setattr(ssl.SSLContext, method, lambda *a, m=method, **k: loads.append(m))
    requests: list[bytes] = []
    async with http_server(requests, tls=server) as port:
        harness.start(make_pod(readiness=http_probe(port, "/200", scheme="HTTPS")))
        await eventually(lambda: harness.ready)
    assert loads == []


async def test_a_tcp_probe_succeeds_when_the_port_accepts_a_connection(
    harness: Harness,
) -> None:
    async with http_server([]) as port:
        probe = Probe(tcpSocket=TCPSocketAction(port=str(port)), periodSeconds=1)
        harness.start(make_pod(readiness=probe))
        await eventually(lambda: harness.ready)


async def test_a_tcp_probe_to_a_closed_port_fails(harness: Harness) -> None:
    port = await closed_port()
    probe = Probe(tcpSocket=TCPSocketAction(port=port), failureThreshold=1)
    harness.start(make_pod(liveness=probe))
    await eventually(lambda: bool(harness.restarts))
    assert harness.messages("Unhealthy")[0] == (
        f"Liveness probe failed: dial tcp 127.0.0.1:{port}: connect: connection refused"
    )


async def test_a_probe_on_an_unknown_port_name_errors_and_never_counts(
    harness: Harness,
) -> None:
    probe = Probe(tcpSocket=TCPSocketAction(port="nope"), periodSeconds=1, failureThreshold=1)
    harness.start(make_pod(readiness=probe, liveness=probe))
    await periods(3)
    assert harness.restarts == []
    assert not harness.ready
    assert harness.transport.connections == []
    assert harness.messages("Unhealthy")[0] == (
        "Readiness probe errored and resulted in unknown state: "
        "port 'nope' not found in container main"
    )


# -- grpc -----------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def grpc_health_server(
    statuses: dict[str, int], calls: list[dict[str, str]], *, grpc_status: int = 0
) -> AsyncIterator[int]:
    """grpc.health.v1.Health/Check on h2: the status of the service the request names."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        )
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        headers: dict[str, str] = {}
        body = b""
        while data := await reader.read(65536):
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.RequestReceived):
                    headers = {str(k): str(v) for k, v in event.headers or []}
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data or b""
                    conn.acknowledge_received_data(event.flow_controlled_length or 0, 1)
                elif isinstance(event, h2.events.StreamEnded):
                    calls.append(headers)
                    service = body[7:].decode() if len(body) > 5 else ""
                    sid = event.stream_id or 1
                    conn.send_headers(
                        sid, [(":status", "200"), ("content-type", "application/grpc")]
                    )
                    if grpc_status == 0:
                        message = bytes([0x08, statuses.get(service, 3)])
                        conn.send_data(sid, b"\0" + len(message).to_bytes(4, "big") + message)
                    trailers = [("grpc-status", str(grpc_status)), ("grpc-message", "nope")]
                    conn.send_headers(sid, trailers, end_stream=True)
            writer.write(conn.data_to_send())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def grpc_probe(port: int, service: str | None = None) -> Probe:
    action = GRPCAction(port=port, service=service)  # h2 takes round trips: 1 s, as for http
    return Probe(grpc=action, periodSeconds=1, failureThreshold=1, timeoutSeconds=20)


async def test_a_grpc_probe_calls_the_health_service_and_succeeds_when_serving(
    harness: Harness,
) -> None:
    calls: list[dict[str, str]] = []
    async with grpc_health_server({"": 1}, calls) as port:
        harness.start(make_pod(readiness=grpc_probe(port)))
        await eventually(lambda: harness.ready)
    assert calls[0][":path"] == "/grpc.health.v1.Health/Check"
    assert calls[0]["content-type"] == "application/grpc"
    assert calls[0]["user-agent"] == "kube-probe/1.37"


async def test_a_grpc_probe_names_its_service_and_fails_when_it_is_not_serving(
    harness: Harness,
) -> None:
    async with grpc_health_server({"db": 2, "": 1}, []) as port:
        harness.start(make_pod(liveness=grpc_probe(port, "db")))
        await eventually(lambda: bool(harness.restarts))
    assert harness.messages("Unhealthy")[0] == (
        'Liveness probe failed: service unhealthy (responded with "NOT_SERVING")'
    )


async def test_a_grpc_probe_of_a_server_without_the_health_service_fails(
    harness: Harness,
) -> None:
    async with grpc_health_server({}, [], grpc_status=12) as port:
        harness.start(make_pod(liveness=grpc_probe(port)))
        await eventually(lambda: bool(harness.restarts))
    assert "does not implement the grpc health protocol" in harness.messages("Unhealthy")[0]


async def test_a_grpc_probe_to_a_closed_port_fails(harness: Harness) -> None:
    port = await closed_port()
    harness.start(make_pod(liveness=grpc_probe(port)))
    await eventually(lambda: bool(harness.restarts))
    assert harness.messages("Unhealthy")[0].startswith(
        f'Liveness probe failed: error: failed to connect service at "127.0.0.1:{port}"'
    )
