"""exec and attach over SPDY/3.1, driven the way the apiserver's client-go executor drives them."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from vkubelet.kubelet import ServerConfig
from vkubelet.protocols.remotecommand import TerminalSize, encode_resize
from vkubelet.protocols.spdy import RstStatus

from .harness import HttpClient, Kubelet, SpdyClient, StartKubelet

CLIENT_GO = ["v5.channel.k8s.io", "v4.channel.k8s.io", "v3.channel.k8s.io", "v2.channel.k8s.io"]


async def start_exec(
    kubelet: Kubelet, query: str, kinds: list[str], *, verb: str = "exec"
) -> tuple[SpdyClient, dict[str, int]]:
    client = await SpdyClient.upgrade(
        kubelet.port, kubelet.context(), f"/{verb}/default/web/app?{query}", CLIENT_GO
    )
    ids = {}
    for index, kind in enumerate(kinds):
        ids[kind] = 2 * index + 1
        await client.open(ids[kind], {"streamType": kind})
    await client.wait_for(lambda: set(ids.values()) <= set(client.replies))
    return client, ids


async def finish(client: SpdyClient, ids: dict[str, int]) -> dict[str, object]:
    """Wait for the server to end the session as client-go expects; return the status."""
    outputs = [ids[k] for k in ("stdout", "stderr", "error") if k in ids]
    await client.wait_for(lambda: set(outputs) <= client.fins and client.goaway is not None)
    status: dict[str, object] = json.loads(client.data[ids["error"]])
    await client.close()
    return status


async def test_exec_streams_stdout_and_reports_success_as_v4_status(kubelet: Kubelet) -> None:
    client, ids = await start_exec(
        kubelet, "command=echo&command=hello&output=1&error=1", ["error", "stdout", "stderr"]
    )
    status = await finish(client, ids)
    assert status == {"metadata": {}, "status": "Success"}
    assert bytes(client.data[ids["stdout"]]) == b"hello\n"
    assert bytes(client.data[ids["stderr"]]) == b""


async def test_negotiation_picks_the_clients_first_supported_version(kubelet: Kubelet) -> None:
    http = await HttpClient.connect(kubelet.port, kubelet.context())
    await http.request(
        "POST",
        "/exec/default/web/app?command=echo&output=1",
        [
            ("Connection", "Upgrade"),
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v9.channel.k8s.io, v4.channel.k8s.io"),
        ],
    )
    response = await http.response()
    await http.close()
    assert response.status_code == 101
    assert (b"x-stream-protocol-version", b"v4.channel.k8s.io") in response.headers


async def test_non_zero_exit_is_reported_as_NonZeroExitCode(kubelet: Kubelet) -> None:
    client, ids = await start_exec(
        kubelet, "command=fail&command=3&output=1&error=1", ["error", "stdout", "stderr"]
    )
    status = await finish(client, ids)
    assert status["status"] == "Failure"
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"] == {"causes": [{"reason": "ExitCode", "message": "3"}]}
    assert bytes(client.data[ids["stdout"]]) == b"partial\n"
    assert bytes(client.data[ids["stderr"]]) == b"oops\n"


async def test_v2_client_gets_plain_text_status(kubelet: Kubelet) -> None:
    client = await SpdyClient.upgrade(
        kubelet.port,
        kubelet.context(),
        "/exec/default/web/app?command=fail&command=2&error=1",
        ["v2.channel.k8s.io"],
    )
    await client.open(1, {"streamType": "error"})
    await client.open(3, {"streamType": "stderr"})
    await client.wait_for(lambda: {1, 3} <= client.fins)
    assert bytes(client.data[1]) == b"command terminated with non-zero exit code: exit status 2"
    await client.close()


async def test_stdin_reaches_the_provider_until_fin(kubelet: Kubelet) -> None:
    client, ids = await start_exec(
        kubelet, "command=cat&input=1&output=1", ["error", "stdin", "stdout"]
    )
    await client.send(ids["stdin"], b"abc")
    await client.wait_for(lambda: client.data[ids["stdout"]] == b"abc")
    await client.send(ids["stdin"], b"def", fin=True)
    status = await finish(client, ids)
    assert bytes(client.data[ids["stdout"]]) == b"abcdef"
    assert status["status"] == "Success"


async def test_tty_resize_events_reach_the_provider(kubelet: Kubelet) -> None:
    client, ids = await start_exec(
        kubelet,
        "command=sizes&command=2&input=1&output=1&tty=1",
        ["error", "stdin", "stdout", "resize"],
    )
    # A JSON object split across frames still makes one size.
    first = encode_resize(TerminalSize(80, 24))
    await client.send(ids["resize"], first[:5])
    await client.send(ids["resize"], first[5:] + encode_resize(TerminalSize(120, 40)))
    status = await finish(client, ids)
    assert bytes(client.data[ids["stdout"]]) == b"80x24\n120x40\n"
    assert status["status"] == "Success"


async def test_attach_relays_the_provider_output(kubelet: Kubelet) -> None:
    client, ids = await start_exec(kubelet, "output=1", ["error", "stdout"], verb="attach")
    status = await finish(client, ids)
    assert bytes(client.data[ids["stdout"]]) == b"attached\n"
    assert status["status"] == "Success"


async def test_provider_exception_becomes_an_internal_error_status(kubelet: Kubelet) -> None:
    client, ids = await start_exec(kubelet, "command=boom&output=1", ["error", "stdout"])
    status = await finish(client, ids)
    assert status["reason"] == "InternalError"
    assert "cannot run ['boom']" in str(status["message"])


async def test_a_command_that_cannot_be_started_exits_127_with_its_message_once(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture
) -> None:
    client, ids = await start_exec(
        kubelet, "command=nope&output=1&error=1", ["error", "stdout", "stderr"]
    )
    status = await finish(client, ids)
    assert status["reason"] == "NonZeroExitCode"
    assert status["details"] == {"causes": [{"reason": "ExitCode", "message": "127"}]}
    assert bytes(client.data[ids["stderr"]]) == b'exec: "nope": executable file not found\n'
    assert bytes(client.data[ids["stdout"]]) == b""
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


async def test_a_provider_failure_is_one_log_line_without_a_traceback(
    kubelet: Kubelet, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="vkubelet.kubelet")
    client, ids = await start_exec(kubelet, "command=boom&output=1", ["error", "stdout"])
    status = await finish(client, ids)
    assert str(status["message"]).count("Internal error occurred") == 1
    [line] = [r for r in caplog.records if "exec/attach failed" in r.getMessage()]
    assert "cannot run ['boom']" in line.getMessage()
    assert line.exc_info is None


async def test_client_hang_up_cancels_the_provider_call(kubelet: Kubelet) -> None:
    client, _ = await start_exec(kubelet, "command=sleep&output=1", ["error", "stdout"])
    await kubelet.provider.started.wait()
    await client.close()
    async with asyncio.timeout(2):
        await kubelet.provider.cancelled.wait()


async def test_pings_are_echoed(kubelet: Kubelet) -> None:
    client, _ = await start_exec(kubelet, "command=sleep&output=1", ["error", "stdout"])
    await client.ping(7)
    await client.wait_for(lambda: client.pings == [7])
    await client.close()


async def test_streams_not_created_in_time_end_the_connection(
    start_kubelet: StartKubelet,
) -> None:
    kubelet = await start_kubelet(
        config=ServerConfig(host="127.0.0.1", stream_creation_timeout=0.2)
    )
    client = await SpdyClient.upgrade(
        kubelet.port, kubelet.context(), "/exec/default/web/app?command=echo&output=1", CLIENT_GO
    )
    await client.open(1, {"streamType": "error"})  # stdout never comes
    await client.wait_for(lambda: client.goaway is not None and client.eof, within=3)
    assert not kubelet.provider.started.is_set()


async def test_streams_opened_after_the_start_are_refused(kubelet: Kubelet) -> None:
    client, _ = await start_exec(kubelet, "command=sleep&output=1", ["error", "stdout"])
    await client.open(5, {"streamType": "stdin"})
    await client.wait_for(lambda: 5 in client.resets)
    assert client.resets[5] == RstStatus.REFUSED_STREAM
    await client.close()


async def test_unsupported_protocol_is_400_listing_ours(kubelet: Kubelet) -> None:
    reply = await kubelet.get(
        "/exec/default/web/app?command=echo&output=1",
        method="POST",
        headers=[
            ("Connection", "Upgrade"),
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v9.channel.k8s.io"),
        ],
    )
    assert reply.status == 400
    accepted = reply.headers["x-accepted-stream-protocol-versions"]
    assert "v4.channel.k8s.io" in accepted


@pytest.mark.parametrize(
    ("target", "status"),
    [
        ("/exec/default/nope/app?command=echo&output=1", 404),
        ("/exec/default/web/other?command=echo&output=1", 404),
        ("/exec/default/web/wrong-uid/app?command=echo&output=1", 404),
        ("/exec/default/web/app?output=1", 400),  # no command
        ("/exec/default/web/app?command=echo", 400),  # no stream at all
    ],
)
async def test_bad_exec_requests_are_refused_before_upgrading(
    kubelet: Kubelet, target: str, status: int
) -> None:
    reply = await kubelet.get(
        target,
        method="POST",
        headers=[
            ("Connection", "Upgrade"),
            ("Upgrade", "SPDY/3.1"),
            ("X-Stream-Protocol-Version", "v4.channel.k8s.io"),
        ],
    )
    assert reply.status == status


async def test_exec_without_an_upgrade_is_400(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/exec/default/web/app?command=echo&output=1", method="POST")
    assert reply.status == 400
    assert "upgrade" in reply.text


async def test_idle_session_is_closed_and_the_provider_cancelled(
    start_kubelet: StartKubelet,
) -> None:
    kubelet = await start_kubelet(config=ServerConfig(host="127.0.0.1", stream_idle_timeout=0.3))
    client, _ = await start_exec(kubelet, "command=sleep&output=1", ["error", "stdout"])
    await client.wait_for(lambda: client.eof, within=3)
    async with asyncio.timeout(2):
        await kubelet.provider.cancelled.wait()
