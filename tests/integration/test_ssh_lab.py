"""The SSH device lab (`vkubelet.testing.ssh_lab` / the `ssh_devices` fixture) behaves like the
boards the SSH provider will manage: a separate host behind a link that can fail, a non-root
user, a host key that is verified, and port forwarding to servers on the device's loopback."""

from __future__ import annotations

import asyncio
import contextlib
import pwd
import subprocess
import time
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from vkubelet.testing.sshlab import SshDeviceFactory, TestDevice, ssh_lab, ssh_lab_unavailable


def connect(device: TestDevice, **overrides: Any) -> Any:
    """A connection the way the provider will make it: key auth, host key verified, nothing
    from the runner's ~/.ssh or ssh-agent. Use with `async with` or await it."""
    options: dict[str, Any] = {
        "port": device.port,
        "username": device.user,
        "client_keys": [str(device.key_path)],
        "known_hosts": str(device.known_hosts),
        "agent_path": None,
        "config": [],
        "connect_timeout": 10,
        **overrides,
    }
    return asyncssh.connect(device.address, **options)


async def test_devices_accept_their_key_as_their_own_user_and_verify_host_keys(
    ssh_devices: SshDeviceFactory, tmp_path: Path
) -> None:
    devices = ssh_devices(3)
    assert len({d.address for d in devices}) == 3
    assert len({d.user for d in devices}) == 3
    for device in devices:
        assert device.user.startswith("vkd-")
        assert device.key_path.stat().st_mode & 0o777 == 0o600
        async with connect(device) as conn:
            result = await conn.run("id -un; echo $HOME", check=True)
        assert str(result.stdout).split() == [device.user, str(device.home)]
        assert device.run("id -un").stdout.strip() == device.user
        # no rc file that would slow down every command the provider runs
        assert not list(device.home.glob(".*rc")) and not (device.home / ".profile").exists()

    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    with pytest.raises(asyncssh.HostKeyNotVerifiable):
        async with connect(devices[0], known_hosts=str(empty)):
            pass


async def test_processes_survive_link_down_and_are_found_again_after_link_up(
    ssh_devices: SshDeviceFactory,
) -> None:
    [device] = ssh_devices()
    ticks = device.home / "ticks"
    async with connect(device) as conn:
        await conn.run(
            "setsid sh -c 'echo $$ > $HOME/ticker.pid;"
            " while :; do date +%s >> $HOME/ticks; sleep 0.2; done'"
            " </dev/null >/dev/null 2>&1 &",
            check=True,
        )
    deadline = time.monotonic() + 10
    while not (device.home / "ticker.pid").exists() or not ticks.exists():
        assert time.monotonic() < deadline, "the ticker never started"
        await asyncio.sleep(0.1)
    pid = int((device.home / "ticker.pid").read_text())
    assert pid in device.pids("ticks")

    device.link_down()
    try:
        lines_at_down = len(ticks.read_text().splitlines())
        with pytest.raises((OSError, asyncssh.Error)):  # TimeoutError is an OSError
            await asyncio.wait_for(connect(device, connect_timeout=2), timeout=5)
        await asyncio.sleep(1)
        assert pid in device.pids("ticks")  # seen from inside: still running
    finally:
        device.link_up()
    lines_at_up = len(ticks.read_text().splitlines())
    assert lines_at_up > lines_at_down, "the ticker did not tick during the outage"

    async with connect(device) as conn:
        result = await conn.run(f"kill -0 {pid} && cat $HOME/ticker.pid && wc -l < $HOME/ticks")
    assert result.exit_status == 0, result.stderr
    seen_pid, seen_lines = str(result.stdout).split()
    assert int(seen_pid) == pid
    assert int(seen_lines) >= lines_at_up


async def test_root_device_accepts_root_login(ssh_devices: SshDeviceFactory) -> None:
    first, second = ssh_devices(2, root=True)
    assert pwd.getpwnam(first.user).pw_uid == pwd.getpwnam(second.user).pw_uid == 0
    assert first.home != second.home and first.home.is_dir() and second.home.is_dir()
    async with connect(first) as conn:
        result = await conn.run(f"id -u; touch {first.home}/from-ssh", check=True)
    assert str(result.stdout).strip() == "0"
    assert (first.home / "from-ssh").exists()
    assert first.run("id -un; pwd").stdout.split() == ["root", str(first.home)]


async def test_direct_tcpip_reaches_a_server_on_the_device_loopback(
    ssh_devices: SshDeviceFactory,
) -> None:
    [device] = ssh_devices()
    (device.home / "index.html").write_text("hello from the device\n")
    started = device.run(
        "python3 -m http.server --bind 127.0.0.1 8080 >http.log 2>&1 & echo $!", timeout=10
    )
    assert started.returncode == 0, started.stderr
    # the server is on the device's loopback, not reachable from the host
    with pytest.raises(OSError):
        await asyncio.wait_for(asyncio.open_connection(device.address, 8080), timeout=2)

    async with connect(device) as conn:
        deadline = time.monotonic() + 15
        while True:
            try:
                reader, writer = await conn.open_connection("127.0.0.1", 8080)
                break
            except asyncssh.ChannelOpenError:  # not listening yet
                assert time.monotonic() < deadline, (device.home / "http.log").read_text()
                await asyncio.sleep(0.2)
        writer.write(b"GET /index.html HTTP/1.0\r\nHost: device\r\n\r\n")
        response = await asyncio.wait_for(reader.read(), timeout=10)
        writer.close()
    assert response.startswith(b"HTTP/1.0 200")
    assert response.endswith(b"hello from the device\n")


def test_teardown_leaves_no_user_netns_veth_or_process(tmp_path: Path) -> None:
    reason = ssh_lab_unavailable()
    if reason:
        pytest.skip(reason)
    strays = []
    with ssh_lab(2, tmp_path) as devices:
        for device in devices:
            # a detached process and a stray root process in the netns must die too
            device.run("setsid sh -c 'while :; do sleep 1; done' </dev/null >/dev/null 2>&1 &")
            strays.append(subprocess.Popen(["ip", "netns", "exec", device.netns, "sleep", "600"]))
        uids = {device.home.stat().st_uid for device in devices}
    for stray in strays:
        assert stray.wait(timeout=5) != 0
    for device in devices:
        assert not Path("/run/netns", device.netns).exists()
        assert not Path("/sys/class/net", device.host_veth).exists()
        assert not device.home.exists()
        with pytest.raises(KeyError):
            pwd.getpwnam(device.user)
        live = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    status = (entry / "status").read_text()
                    uid = int(status.split("Uid:")[1].split()[0])
                    if uid in uids and "\nState:\tZ" not in status:
                        live.append(entry.name)
        assert not live, f"processes of removed device users: {live}"
