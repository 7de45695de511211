"""The device's side of the SSH provider, for real: the generated scripts run with the local sh
(dash) as `sh -s` in a temporary HOME, as the agent sends them over SSH, and the basic ones
again on busybox (its sh, awk, setsid and coreutils) where busybox is installed.

Every test ends whatever it started: its pods are removed, then any process still carrying the
test's HOME in its environment is killed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vkubelet.providers.ssh._remote import (
    ContainerPlan,
    ContainerStatus,
    ImageRun,
    Mount,
    PodPlan,
    RemotePod,
    Runtime,
    ephemeral_command,
    ephemeral_script,
    exec_command,
    log_path,
    logs_script,
    parse_sweep,
    remove_pod_script,
    restart_container_script,
    revive_pod_script,
    runtime_exec_command,
    start_pod_script,
    stop_pod_script,
    sweep_script,
    terminal_paths,
)
from vkubelet.sdk.logs import LogLine, LogParser
from vkubelet.testing import wait_for

pytestmark = pytest.mark.timeout(60)

ROOT = ".vkubelet"
BUSYBOX = shutil.which("busybox")
CRI_LINE = re.compile(rb"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ (stdout|stderr) [FP] .*")


# -- a device in a temporary HOME -----------------------------------------------------------------
@dataclass
class Device:
    home: Path
    path: str  # PATH on the "device"
    shell: list[str] = field(default_factory=lambda: ["sh"])
    root: str = ROOT
    env_overrides: dict[str, str] = field(default_factory=dict)
    uids: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {
            "HOME": str(self.home),
            "PATH": self.path,
            "LC_ALL": "C.UTF-8",
            "VKUBELET_BACKOFF_BASE": "1",
            **self.env_overrides,
        }

    def run(self, script: str, *, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        result = subprocess.run(
            [*self.shell, "-s"],
            input=script.encode(),
            capture_output=True,
            env=self.env,
            cwd=self.home,
            timeout=10,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"script failed ({result.returncode}): {result.stderr!r}")
        return result

    def start(self, plan: PodPlan) -> int:
        self.uids.append(plan.uid)
        return int(self.run(start_pod_script(self.root, plan)).stdout)

    def sweep(self, uids: list[str] | None = None) -> dict[str, RemotePod]:
        return parse_sweep(self.run(sweep_script(self.root, uids)).stdout)

    def pod(self, uid: str = "u1") -> RemotePod:
        return self.sweep([uid])[uid]

    def wait(
        self, condition: Callable[[RemotePod], bool], uid: str = "u1", timeout: float = 10
    ) -> RemotePod:
        def matching() -> RemotePod:
            pod = self.sweep([uid]).get(uid)
            assert pod is not None and condition(pod), f"last seen: {pod}"
            return pod

        result: RemotePod = wait_for(matching, timeout=timeout, interval=0.05, what=f"pod {uid}")
        return result

    def pod_dir(self, uid: str = "u1") -> Path:
        root = Path(self.root) if self.root.startswith("/") else self.home / self.root
        return root / "pods" / uid

    def log(self, container: str = "main", run: int = 0, uid: str = "u1") -> list[LogLine]:
        data = (self.pod_dir(uid) / "c" / container / f"{run}.log").read_bytes()
        return LogParser().feed(data)

    def cleanup(self) -> None:
        for uid in self.uids:
            self.run(remove_pod_script(self.root, uid), check=False)
        for pid in processes_with(f"HOME={self.home}".encode()):
            os.kill(pid, signal.SIGKILL)


def processes_with(needle: bytes) -> list[int]:
    """Live processes with `needle` in their environment: the ones a test started, no other."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie: nobody may reap orphans here (PID 1 of a container)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat_line.rpartition(")")[2].split()[0] != "Z"


def make_device(tmp_path: Path, kind: str) -> Device:
    home = tmp_path / "home"
    home.mkdir()
    if kind == "dash":
        return Device(home, os.environ["PATH"])
    if kind == "bash":  # /bin/sh on some distributions: bash in its POSIX mode
        bash = shutil.which("bash")
        if bash is None:
            pytest.skip("bash is not installed")
        shims = tmp_path / "bash-bin"
        shims.mkdir()
        (shims / "sh").symlink_to(bash)
        return Device(home, f"{shims}:{os.environ['PATH']}", [str(shims / "sh")])
    if BUSYBOX is None:
        pytest.skip("busybox is not installed")
    # A PATH of busybox applets only: its sh, awk, setsid, date, base64, tail...
    bin_dir = tmp_path / "busybox-bin"
    bin_dir.mkdir()
    applets = subprocess.run([BUSYBOX, "--list"], capture_output=True, text=True, check=True)
    for applet in applets.stdout.split():
        (bin_dir / applet).symlink_to(BUSYBOX)
    return Device(home, str(bin_dir), [BUSYBOX, "sh"])


@pytest.fixture
def device(tmp_path: Path) -> Iterator[Device]:
    dev = make_device(tmp_path, "dash")
    try:
        yield dev
    finally:
        dev.cleanup()


@pytest.fixture(params=["dash", "busybox", "bash"])
def any_device(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Device]:
    """The local sh (dash), busybox, and bash as sh: the basic behaviours hold on each."""
    dev = make_device(tmp_path, request.param)
    try:
        yield dev
    finally:
        dev.cleanup()


# -- plans ----------------------------------------------------------------------------------------
def ctr(
    name: str, script: str, env: dict[str, str] | None = None, working_dir: str | None = None
) -> ContainerPlan:
    """A container running a shell script (the device's sh, as `sh -c`)."""
    return ContainerPlan(name, ["sh", "-c", script], env or {}, working_dir)


def pod_plan(
    *containers: ContainerPlan,
    policy: str = "Never",
    inits: tuple[ContainerPlan, ...] = (),
    uid: str = "u1",
    metadata: bytes = b'{"metadata": {"name": "web"}}',
) -> PodPlan:
    return PodPlan(uid, policy, list(inits), list(containers), metadata)


def status(pod: RemotePod, name: str = "main") -> ContainerStatus:
    return next(c for c in [*pod.init_containers, *pod.containers] if c.name == name)


def state_of(name: str = "main", state: str = "terminated") -> Callable[[RemotePod], bool]:
    return lambda pod: status(pod, name).state == state


# -- starting and running -------------------------------------------------------------------------
def test_a_started_container_runs_in_its_own_group_with_its_pid_and_start_time(
    any_device: Device,
) -> None:
    before = datetime.now(UTC).replace(microsecond=0)
    supervisor = any_device.start(pod_plan(ctr("main", "exec sleep 30")))
    pod = any_device.wait(state_of("main", "running"))
    main = status(pod)
    assert main.pid is not None and alive(main.pid)
    assert os.getpgid(main.pid) == main.pid  # its group: stopping it reaches its children
    assert main.started_at is not None
    assert before <= main.started_at <= datetime.now(UTC)
    assert (main.reason, main.restart_count, main.exit_code, main.last) == ("", 0, None, None)
    assert pod.supervisor_alive and not pod.stopping
    assert pod.metadata_json == b'{"metadata": {"name": "web"}}'
    assert (any_device.pod_dir() / "supervisor.pid").read_text().split()[0] == str(supervisor)
    assert alive(supervisor)


@pytest.mark.parametrize(
    ("script", "code", "reason"),
    [("exit 0", 0, "Completed"), ("exit 3", 3, "Error"), ("kill -KILL $$", 137, "Error")],
)
def test_an_exit_is_reported_with_its_code_and_the_supervisor_ends(
    any_device: Device, script: str, code: int, reason: str
) -> None:
    any_device.start(pod_plan(ctr("main", f"echo bye; {script}")))
    pod = any_device.wait(lambda p: state_of()(p) and not p.supervisor_alive)
    main = status(pod)
    assert (main.exit_code, main.reason, main.restart_count) == (code, reason, 0)
    assert main.started_at is not None and main.finished_at is not None
    assert main.started_at <= main.finished_at
    assert [line.content for line in any_device.log()] == [b"bye"]
    assert (any_device.pod_dir() / "done").exists()
    events = (any_device.pod_dir().parent.parent / "events").read_text().splitlines()
    assert events == ["u1 main running", "u1 main terminated", "u1 - done"]
    assert (any_device.pod_dir() / "supervisor.log").read_text() == ""  # no shell complained


def test_waiting_containers_are_creating_until_they_start(device: Device) -> None:
    plan = pod_plan(ctr("main", "exec sleep 30"))
    device.uids.append("u1")
    # Only the files, not the supervisor: what a sweep shows before the first start.
    script = start_pod_script(ROOT, plan)
    assert '$SETSID sh "$P/run.sh"' in script
    script = script.replace('$SETSID sh "$P/run.sh"', "true")
    device.run(script)
    main = status(device.pod())
    assert (main.state, main.reason, main.restart_count) == ("waiting", "ContainerCreating", 0)


def test_restart_policy_always_restarts_even_a_success_at_once_then_backing_off_twice_as_long(
    any_device: Device,
) -> None:
    began = time.monotonic()
    any_device.start(pod_plan(ctr("main", "exit 0"), policy="Always"))
    pod = any_device.wait(lambda p: status(p).state == "waiting" and status(p).restart_count == 1)
    main = status(pod)
    assert (main.reason, main.backoff_seconds) == ("CrashLoopBackOff", 1)  # BASE, after at once
    assert main.last is not None and (main.last.state, main.last.exit_code) == ("terminated", 0)
    assert main.last.reason == "Completed"
    any_device.wait(lambda p: status(p).restart_count == 3)
    assert time.monotonic() - began >= 2.5  # at once (as the kubelet), then 1 s, then 2 s
    assert status(any_device.pod()).last is not None
    assert any_device.pod().supervisor_alive
    assert (any_device.pod_dir() / "supervisor.log").read_text() == ""


def test_the_back_off_starts_over_after_a_run_that_lasted(device: Device) -> None:
    device.env_overrides["VKUBELET_BACKOFF_RESET"] = "0"  # every run "lasted": all at once
    began = time.monotonic()
    device.start(pod_plan(ctr("main", "exit 0"), policy="Always"))
    device.wait(lambda p: status(p).restart_count >= 3)  # restarts run on between sweeps
    assert time.monotonic() - began < 2.5  # not 0 + 1 + 2 s


def test_restart_policy_on_failure_restarts_until_a_run_succeeds(device: Device) -> None:
    script = "[ -e ran ] && exit 0; touch ran; exit 3"  # the working directory is the pod's fs/
    device.start(pod_plan(ctr("main", script), policy="OnFailure"))
    pod = device.wait(lambda p: state_of()(p) and not p.supervisor_alive)
    main = status(pod)
    assert (main.exit_code, main.restart_count) == (0, 1)
    assert main.last is not None and (main.last.exit_code, main.last.reason) == (3, "Error")
    assert main.last.finished_at is not None and main.started_at is not None
    assert main.last.finished_at <= main.started_at


def test_restart_policy_never_leaves_a_failure_alone(device: Device) -> None:
    device.start(pod_plan(ctr("main", "exit 3"), ctr("other", "exit 0")))
    pod = device.wait(lambda p: not p.supervisor_alive)
    assert [(c.name, c.exit_code, c.restart_count) for c in pod.containers] == [
        ("main", 3, 0),
        ("other", 0, 0),
    ]
    assert status(pod).last is None


def test_init_containers_run_in_order_before_the_containers(device: Device) -> None:
    inits = (ctr("first", "sleep 0.5; echo first >>order"), ctr("second", "echo second >>order"))
    device.start(pod_plan(ctr("main", "echo main >>order; exec sleep 30"), inits=inits))
    pod = device.wait(state_of("first", "running"))
    assert [(c.name, c.state, c.reason) for c in pod.init_containers + pod.containers] == [
        ("first", "running", ""),
        ("second", "waiting", "PodInitializing"),
        ("main", "waiting", "PodInitializing"),
    ]
    pod = device.wait(state_of("main", "running"))
    assert [c.exit_code for c in pod.init_containers] == [0, 0]
    order = device.pod_dir() / "fs" / "order"
    # "running" is reported once main is started, not once its first line has run
    wait_for(lambda: order.read_text().count("\n") == 3, timeout=10)
    assert order.read_text() == "first\nsecond\nmain\n"


def test_a_failing_init_container_fails_the_pod_with_restart_policy_never(device: Device) -> None:
    inits = (ctr("setup", "exit 2"),)
    device.start(pod_plan(ctr("main", "exec sleep 30"), inits=inits))
    pod = device.wait(lambda p: not p.supervisor_alive)
    assert (status(pod, "setup").exit_code, status(pod, "setup").restart_count) == (2, 0)
    main = status(pod)
    assert (main.state, main.reason) == ("waiting", "PodInitializing")
    assert not list((device.pod_dir() / "c" / "main").glob("*.log"))


def test_a_failing_init_container_is_retried_with_other_policies(device: Device) -> None:
    inits = (ctr("setup", "[ -e ready ] && exit 0; touch ready; exit 2"),)
    device.start(pod_plan(ctr("main", "exec sleep 30"), inits=inits, policy="Always"))
    pod = device.wait(state_of("main", "running"))
    setup = status(pod, "setup")
    assert (setup.exit_code, setup.restart_count) == (0, 1)
    assert setup.last is not None and setup.last.exit_code == 2


# -- stopping -------------------------------------------------------------------------------------
def test_stop_terminates_the_whole_process_group_and_the_supervisor_ends(
    any_device: Device,
) -> None:
    any_device.start(pod_plan(ctr("main", "sleep 30 & echo $! >child; wait"), policy="Always"))
    any_device.wait(state_of("main", "running"))
    child_file = any_device.pod_dir() / "fs" / "child"
    wait_for(lambda: child_file.exists() and child_file.read_text().strip() != "", timeout=10)
    child = int(child_file.read_text())
    assert alive(child)
    any_device.run(stop_pod_script(ROOT, "u1", 10))
    pod = any_device.wait(lambda p: state_of()(p) and not p.supervisor_alive, timeout=15)
    assert pod.stopping
    assert status(pod).exit_code == 143  # SIGTERM, long before the grace period
    assert status(pod).restart_count == 0  # stopped: never restarted
    wait_for(lambda: not alive(child), timeout=15)
    assert (any_device.pod_dir() / "supervisor.log").read_text() == ""


def test_a_process_that_ignores_term_is_killed_after_the_grace_period(any_device: Device) -> None:
    script = "trap '' TERM; : >trapped; while :; do sleep 0.1; done"
    any_device.start(pod_plan(ctr("main", script), policy="Always"))
    pid = status(any_device.wait(state_of("main", "running"))).pid
    assert pid is not None
    # "running" is recorded when the shell starts: a stop before the trap is set would end it.
    wait_for(lambda: (any_device.pod_dir() / "fs" / "trapped").exists(), timeout=10)
    stopped = time.monotonic()
    any_device.run(stop_pod_script(ROOT, "u1", 3))
    assert time.monotonic() - stopped < 2.5  # the script does not wait for the grace period
    assert status(any_device.pod()).state == "running"
    pod = any_device.wait(lambda p: state_of()(p) and not p.supervisor_alive, timeout=15)
    assert time.monotonic() - stopped >= 3
    assert (status(pod).exit_code, status(pod).restart_count) == (137, 0)
    assert not alive(pid)
    assert (any_device.pod_dir() / "supervisor.log").read_text() == ""


def test_a_stop_ends_a_back_off_at_once(device: Device) -> None:
    device.env_overrides["VKUBELET_BACKOFF_BASE"] = "30"
    device.start(pod_plan(ctr("main", "exit 1"), policy="Always"))
    device.wait(lambda p: status(p).reason == "CrashLoopBackOff")
    device.run(stop_pod_script(ROOT, "u1", 30))
    pod = device.wait(lambda p: not p.supervisor_alive, timeout=15)
    assert status(pod).restart_count == 1  # restarted at once, then stopped in its back-off


def test_a_stop_with_no_grace_kills_at_once(device: Device) -> None:
    device.start(pod_plan(ctr("main", "trap '' TERM; exec sleep 30")))
    device.wait(state_of("main", "running"))
    device.run(stop_pod_script(ROOT, "u1", 0))
    pod = device.wait(lambda p: not p.supervisor_alive, timeout=15)
    assert status(pod).exit_code == 137


def test_restarting_a_container_ends_its_run_and_its_restart_policy_applies(
    device: Device,
) -> None:
    device.start(pod_plan(ctr("main", "exec sleep 30"), policy="Always"))
    first = status(device.wait(state_of("main", "running"))).pid
    device.run(restart_container_script(ROOT, "u1", "main", 3))
    pod = device.wait(lambda p: status(p).state == "running" and status(p).restart_count == 1)
    second = status(pod).pid
    assert second != first and second is not None
    last = status(pod).last
    assert last is not None and last.exit_code == 143
    # The killer of the first run must not touch the second one after the grace period.
    time.sleep(3.2)
    assert alive(second)
    assert status(device.pod()).pid == second


def test_remove_kills_everything_and_deletes_the_pod(device: Device) -> None:
    script = "(trap '' TERM; exec sleep 30) & echo $! >child; trap '' TERM; wait"
    supervisor = device.start(pod_plan(ctr("main", script), policy="Always"))
    main = status(device.wait(state_of("main", "running"))).pid
    child_file = device.pod_dir() / "fs" / "child"
    wait_for(lambda: child_file.exists() and child_file.read_text().strip() != "", timeout=10)
    child = int(child_file.read_text())
    device.run(remove_pod_script(ROOT, "u1"))
    assert not device.pod_dir().exists()
    assert main is not None
    wait_for(lambda: not any(alive(pid) for pid in (supervisor, main, child)), timeout=15)
    assert device.sweep() == {}
    device.run(remove_pod_script(ROOT, "u1"))  # nothing left to remove: fine


def test_an_ephemeral_process_ends_with_a_stop_a_removal_or_when_handed_again(
    any_device: Device,
) -> None:
    """An ephemeral container's process runs in an SSH session (here: a session of its own, as
    sshd gives one), not under the supervisor: the stop and removal scripts end it by its pid
    file, and so does its script when an agent that restarted hands it again."""
    device = any_device
    device.start(pod_plan(ctr("main", "exec sleep 30"), policy="Always"))
    device.wait(state_of("main", "running"))
    debug = ctr("dbg", 'echo "$WORD"; exec sleep 30', env={"WORD": "debugging"})

    def session() -> subprocess.Popen[bytes]:
        line = ephemeral_command(ROOT, "u1", debug, tty=False, target=None)
        return subprocess.Popen(
            ["setsid", *device.shell, "-c", line],
            stdout=subprocess.PIPE,
            env=device.env,
            cwd=device.home,
        )

    assert device.run(ephemeral_script(ROOT, "u1", debug)).stdout == b"new\n"
    for end in ("stop", "again", "remove"):
        process = session()
        assert process.stdout is not None and process.stdout.readline() == b"debugging\n"
        if end == "stop":
            device.run(stop_pod_script(ROOT, "u1", 5))
        elif end == "again":
            assert device.run(ephemeral_script(ROOT, "u1", debug)).stdout == b"old\n"
        else:
            device.run(remove_pod_script(ROOT, "u1"))
        assert process.wait(timeout=15) in (-signal.SIGTERM, -signal.SIGKILL)
        (device.pod_dir() / "stop").unlink(missing_ok=True)


def test_a_tty_container_runs_in_a_terminal_that_outlives_its_starter(device: Device) -> None:
    """`tty: true`: the command's stdin, stdout and stderr are a terminal, whose name is kept for
    resizes; its output reaches the log and the terminal's own file, its exit code the state."""
    script = 'read -r line; tty; stty size; echo "got $line"; exit 3'
    plan = ContainerPlan("main", ["sh", "-c", script], {}, None, stdin=True, tty=True)
    device.start(pod_plan(plan))
    device.wait(state_of("main", "running"))
    output, pts, session = (
        Path(word.replace('"$HOME"/', f"{device.home}/").replace("'", ""))
        for word in terminal_paths(ROOT, "u1", "main")
    )
    wait_for(lambda: pts.exists(), timeout=15)
    terminal = pts.read_text().strip()
    assert terminal.startswith("/dev/pts/")
    leader = int(session.read_text())
    assert os.getsid(leader) == leader != status(device.pod()).pid  # the terminal's session
    subprocess.run(["stty", "-F", terminal, "rows", "31", "cols", "99"], check=True)
    with (device.pod_dir() / "c" / "main" / "stdin").open("w") as stdin:
        stdin.write("hello\n")
    pod = device.wait(state_of("main"))
    assert status(pod).exit_code == 3
    lines = [line.content.rstrip(b"\r") for line in device.log()]
    assert [terminal.encode(), b"31 99", b"got hello"] == lines[-3:]
    assert b"got hello" in output.read_bytes()


def test_a_tty_container_without_script_on_the_device_says_so(tmp_path: Path) -> None:
    device = make_device(tmp_path, "busybox")  # no script applet in this build
    try:
        if (Path(device.path) / "script").exists():
            pytest.skip("this busybox has script")
        plan = ContainerPlan("main", ["sh", "-c", "exit 0"], {}, None, tty=True)
        device.start(pod_plan(plan))
        assert status(device.wait(state_of("main"))).exit_code == 127
        assert b"needs script" in b"".join(line.content for line in device.log())
    finally:
        device.cleanup()


# -- detached and idempotent ----------------------------------------------------------------------
def test_the_supervisor_survives_the_session_that_started_it(device: Device) -> None:
    # The starting shell in a session of its own, like sshd's; everything left in it is killed.
    plan = pod_plan(ctr("main", "exec sleep 30"))
    device.uids.append("u1")
    starter = subprocess.Popen(
        ["setsid", "sh", "-s"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=device.env,
        cwd=device.home,
    )
    out, _ = starter.communicate(start_pod_script(ROOT, plan).encode(), timeout=10)
    # communicate() returned: nothing holds the session's stdout, as sshd needs to close it.
    supervisor = int(out)
    with pytest.raises(ProcessLookupError):
        os.killpg(starter.pid, signal.SIGKILL)  # its session is gone already
    pod = device.wait(state_of("main", "running"))
    assert pod.supervisor_alive and alive(supervisor)
    assert os.getsid(supervisor) == supervisor != os.getsid(0)
    fds = Path(f"/proc/{supervisor}/fd")
    assert (fds / "0").readlink() == Path("/dev/null")
    assert (fds / "1").readlink().name == "supervisor.log"


def test_starting_twice_changes_nothing(device: Device) -> None:
    plan = pod_plan(ctr("main", "exec sleep 30"), policy="Always")
    supervisor = device.start(plan)
    pid = status(device.wait(state_of("main", "running"))).pid
    assert device.start(plan) == supervisor
    pod = device.pod()
    assert (status(pod).pid, status(pod).restart_count) == (pid, 0)
    run_sh = str(device.pod_dir() / "run.sh").encode()
    supervisors = [  # the supervisor, and its subshells (in its session)
        p
        for p in processes_with(f"HOME={device.home}".encode())
        if run_sh in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    assert supervisor in supervisors
    assert {os.getsid(p) for p in supervisors} == {supervisor}


def test_a_finished_pod_is_not_started_again(device: Device) -> None:
    plan = pod_plan(ctr("main", "echo once >>runs"))
    device.start(plan)
    device.wait(lambda p: not p.supervisor_alive)
    device.start(plan)
    time.sleep(0.3)
    assert (device.pod_dir() / "fs" / "runs").read_text() == "once\n"


def test_a_pod_whose_supervisor_died_starts_over_and_keeps_its_counts(device: Device) -> None:
    plan = pod_plan(ctr("main", "exec sleep 30"), policy="Always")
    supervisor = device.start(plan)
    first = status(device.wait(state_of("main", "running"))).pid
    assert first is not None
    os.killpg(supervisor, signal.SIGKILL)  # the supervisor alone: its container keeps running
    assert not device.wait(lambda p: not p.supervisor_alive).supervisor_alive
    assert alive(first)
    assert device.start(plan) != supervisor
    wait_for(lambda: not alive(first), timeout=15)  # what the old one left is killed
    pod = device.wait(lambda p: status(p).state == "running" and status(p).pid != first)
    assert status(pod).restart_count == 1  # run 0 happened: this one is a restart


def test_a_revived_supervisor_ends_the_lost_run_and_restarts_it_by_policy(device: Device) -> None:
    plan = pod_plan(ctr("main", "exec sleep 30"), policy="Always")
    supervisor = device.start(plan)
    first = status(device.wait(state_of("main", "running"))).pid
    assert first is not None
    assert device.run(revive_pod_script(ROOT, "u1")).stdout == b""  # alive: nothing to do
    os.kill(supervisor, signal.SIGKILL)
    pod = device.wait(lambda p: not p.supervisor_alive)
    assert pod.supervisor_lost and status(pod).state == "running"  # stale: nobody ended it
    assert int(device.run(revive_pod_script(ROOT, "u1")).stdout) != supervisor
    wait_for(lambda: not alive(first), timeout=15)
    pod = device.wait(lambda p: status(p).state == "running" and status(p).pid != first)
    assert pod.supervisor_alive and status(pod).restart_count == 1
    last = status(pod).last
    assert last is not None
    assert (last.exit_code, last.reason) == (137, "ContainerStatusUnknown")


def test_a_stopped_pod_whose_supervisor_died_is_done_not_restarted(device: Device) -> None:
    plan = pod_plan(ctr("main", "trap '' TERM; sleep 30 & wait"), policy="Always")
    supervisor = device.start(plan)
    first = status(device.wait(state_of("main", "running"))).pid
    assert first is not None
    os.kill(supervisor, signal.SIGKILL)
    # dead for the device too: on a loaded machine a killed process runs on a moment, and a
    # revive that still sees it alive rightly does nothing (the agent's next look revives it)
    device.wait(lambda p: not p.supervisor_alive)
    device.run(stop_pod_script(ROOT, "u1", 30))
    assert device.run(revive_pod_script(ROOT, "u1")).stdout == b""
    wait_for(lambda: not alive(first), timeout=15)
    pod = device.pod()
    assert pod.finished and not pod.supervisor_lost
    assert (status(pod).state, status(pod).exit_code) == ("terminated", 137)


# -- logs -----------------------------------------------------------------------------------------
def test_stdout_and_stderr_lines_land_in_the_log_in_cri_format(any_device: Device) -> None:
    script = (
        "echo out 1; echo err 1 >&2; echo 'out 2  '; echo; printf 'no newline'; "
        "i=0; while [ $i -lt 10 ]; do printf 0123456789; i=$((i + 1)); done >&2; echo >&2"
    )
    before = datetime.now(UTC).replace(microsecond=0)
    any_device.start(pod_plan(ctr("main", script)))
    any_device.wait(state_of())  # terminated: the log is complete
    raw = (any_device.pod_dir() / "c" / "main" / "0.log").read_bytes()
    assert all(CRI_LINE.fullmatch(line) for line in raw.splitlines())
    lines = any_device.log()
    stdout = [line.content for line in lines if line.stream == "stdout"]
    stderr = [line.content for line in lines if line.stream == "stderr"]
    assert stdout == [b"out 1", b"out 2  ", b"", b"no newline"]
    assert stderr == [b"err 1", b"0123456789" * 10]
    assert all(before <= line.time <= datetime.now(UTC) for line in lines)
    assert not any(line.partial for line in lines)


def test_long_lines_are_written_in_partial_pieces(device: Device) -> None:
    long = "x" * 9000
    device.start(pod_plan(ctr("main", f"echo {long}; echo {long} >&2")))
    device.wait(state_of())
    for stream in ("stdout", "stderr"):
        pieces = [line for line in device.log() if line.stream == stream]
        assert [p.partial for p in pieces] == [True, True, False]
        assert b"".join(p.content for p in pieces) == long.encode()


def test_lines_are_stamped_by_a_shell_loop_without_awk_strftime(
    device: Device, tmp_path: Path
) -> None:
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "awk").write_text("#!/bin/sh\nexit 2\n")  # an awk that cannot stamp
    (shims / "awk").chmod(0o755)
    device.path = f"{shims}:{device.path}"
    device.start(pod_plan(ctr("main", "echo out; printf '%s\\n' '  err\\' >&2")))
    device.wait(state_of())
    lines = sorted((line.stream, line.content) for line in device.log())
    assert lines == [("stderr", b"  err\\"), ("stdout", b"out")]


def test_the_previous_runs_log_is_kept_and_older_ones_go(device: Device) -> None:
    device.env_overrides["VKUBELET_BACKOFF_MAX"] = "1"
    script = 'n=$(cat count || echo 0); echo "run $n"; echo $((n + 1)) >count; [ $n = 2 ]'
    device.start(pod_plan(ctr("main", script), policy="OnFailure"))
    pod = device.wait(lambda p: state_of()(p) and not p.supervisor_alive)
    assert status(pod).restart_count == 2
    logs = sorted(p.name for p in (device.pod_dir() / "c" / "main").glob("*.log"))
    assert logs == ["1.log", "2.log"]

    def shown(previous: bool) -> bytes:
        script = logs_script(ROOT, "u1", "main", previous=previous, follow=False)
        lines = LogParser().feed(device.run(script).stdout)
        return b"".join(line.content for line in lines)

    assert (shown(False), shown(True)) == (b"run 2", b"run 1")
    path = log_path(ROOT, "u1", "main", 1)
    assert device.run(f"cat {path}").stdout.endswith(b" stdout F run 1\n")


def test_there_is_no_previous_log_before_a_restart(device: Device) -> None:
    device.start(pod_plan(ctr("main", "echo hi")))
    device.wait(state_of())
    script = logs_script(ROOT, "u1", "main", previous=True, follow=False)
    assert device.run(script, check=False).returncode == 1


def test_following_a_log_prints_lines_as_they_come(device: Device) -> None:
    device.start(pod_plan(ctr("main", "echo first; sleep 1; echo second; exec sleep 30")))
    device.wait(state_of("main", "running"))
    follower = subprocess.Popen(
        ["sh", "-s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=device.env
    )
    try:
        assert follower.stdin is not None and follower.stdout is not None
        follower.stdin.write(logs_script(ROOT, "u1", "main", previous=False, follow=True).encode())
        follower.stdin.close()
        parser = LogParser()
        seen: list[bytes] = []
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            if select.select([follower.stdout], [], [], 0.1)[0]:
                chunk = os.read(follower.stdout.fileno(), 65536)
                seen += [line.content for line in parser.feed(chunk)]
        assert seen == [b"first", b"second"]
    finally:
        follower.kill()
        follower.wait()


# -- exec -----------------------------------------------------------------------------------------
def test_exec_runs_in_the_containers_environment_and_working_directory(device: Device) -> None:
    work = device.home / "work dir"
    work.mkdir()
    container = ctr("main", "exec sleep 30", env={"GREETING": "hello world"}, working_dir=str(work))
    device.start(pod_plan(container, ctr("other", "exec sleep 30")))
    device.wait(state_of("main", "running"))
    line = exec_command(ROOT, "u1", "main", ["sh", "-c", 'pwd; echo "$GREETING $VKUBELET_POD_DIR"'])
    result = device.run(line)  # as the login shell of an SSH exec channel runs it
    assert result.stdout.decode().splitlines() == [str(work), f"hello world {device.pod_dir()}"]
    result = device.run(exec_command(ROOT, "u1", "other", ["sh", "-c", 'pwd; echo "$GREETING"']))
    assert result.stdout.decode().splitlines() == [str(device.pod_dir() / "fs"), ""]
    result = device.run(exec_command(ROOT, "u1", "main", ["sh", "-c", "exit 7"]), check=False)
    assert result.returncode == 7


def test_working_directories_are_relative_to_fs_and_must_exist(device: Device) -> None:
    (device.pod_dir() / "fs" / "sub").mkdir(parents=True)  # as the provider's volumes are made
    device.start(
        pod_plan(
            ctr("main", "pwd", working_dir="sub"),
            ctr("empty", "pwd", working_dir=""),
            ctr("missing", "pwd", working_dir="/no/such/dir"),
        )
    )
    pod = device.wait(lambda p: not p.supervisor_alive)
    fs = device.pod_dir() / "fs"
    assert [line.content for line in device.log("main")] == [str(fs / "sub").encode()]
    assert [line.content for line in device.log("empty")] == [str(fs).encode()]
    assert status(pod, "missing").exit_code == 128  # like a runtime's StartError
    [error] = device.log("missing")
    assert error.stream == "stderr" and b"/no/such/dir" in error.content


# -- hostile values -------------------------------------------------------------------------------
CANARY = f"canary-{uuid.uuid4().hex[:8]}"  # a file that no injected command may create
HOSTILE = [
    f"; touch {CANARY}",
    f"$(touch {CANARY})",
    f"`touch {CANARY}`",
    "$HOME",
    "${HOME:?x}",
    f"'; touch {CANARY}; '",
    f'"; touch {CANARY}; "',
    "\\",
    "back\\slash\\n\\'",
    "new\nline\n",
    f"\ntouch {CANARY}\n",
    "*",
    "-rf",
    "--",
    "-",
    "ünïcødé ☃ 日本語",
    "",
    " spaced  out ",
    "tab\there\r",
    "VKUBELET_EOF",
    f"VKUBELET_EOF\ntouch {CANARY}\nVKUBELET_EOF",
    f"| touch {CANARY}",
    f"&& touch {CANARY}",
    f"> {CANARY}",
    "!",
    "#comment",
    "~",
    "%s%n%d",
    "\x1b[31mred",
    "a=b",
]
DUMP = (
    "import json, os, sys; "
    "print(json.dumps([sys.argv[1:], {k: v for k, v in os.environ.items() if k[0] in 'VW'}, "
    "os.getcwd()]))"
)


def test_hostile_values_reach_the_program_literally_and_run_nothing(tmp_path: Path) -> None:
    # The root itself has spaces and quotes in it (trusted, but quoted all the same).
    home = tmp_path / "home"
    home.mkdir()
    root = str(tmp_path / "pod 'root' $(x)")
    device = Device(home, os.environ["PATH"], root=root)
    work = home / f"dir ;$(touch {CANARY})`x`'q\"\\ \n*"
    work.mkdir()
    env = {f"V{i}": value for i, value in enumerate(HOSTILE)}
    env["W_EMPTY"] = ""
    expected_env = {
        **env,
        "VKUBELET_BACKOFF_BASE": "1",
        "VKUBELET_POD_DIR": str(device.pod_dir()),
    }
    argv = [sys.executable, "-c", DUMP, *HOSTILE]
    metadata = bytes(range(256)) + b"\n'$(x)'\n"
    plan = PodPlan("u1", "Never", [], [ContainerPlan("main", argv, env, str(work))], metadata)
    try:
        device.start(plan)
        pod = device.wait(lambda p: state_of()(p) and not p.supervisor_alive)
        assert status(pod).exit_code == 0, device.log()
        assert pod.metadata_json == metadata
        [line] = [line.content for line in device.log() if line.stream == "stdout"]
        seen_argv, seen_env, seen_cwd = json.loads(line)
        assert seen_argv == HOSTILE
        assert seen_env == expected_env
        assert seen_cwd == str(work)
        # And through exec, as `kubectl exec` passes them.
        result = device.run(exec_command(root, "u1", "main", argv))
        assert json.loads(result.stdout) == [HOSTILE, expected_env, str(work)]
        assert not [p for p in tmp_path.rglob("*") if p.name == CANARY]
        assert not Path("/", CANARY).exists()
    finally:
        device.cleanup()


@pytest.mark.parametrize("name", ["MY-VAR", "1X", "A B", "", "A=B", "é", "a.b", "X\n"])
def test_environment_names_sh_cannot_export_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=rf"container web: .*{re.escape(repr(name))}"):
        ContainerPlan("web", ["true"], {name: "x"}, None)


def test_values_no_process_could_receive_are_rejected() -> None:
    with pytest.raises(ValueError, match="NUL"):
        ContainerPlan("web", ["echo", "a\0b"], {}, None)
    with pytest.raises(ValueError, match="NUL"):
        ContainerPlan("web", ["true"], {"A": "\0"}, None)
    with pytest.raises(ValueError, match="no command"):
        ContainerPlan("web", [], {}, None)
    with pytest.raises(ValueError, match="DNS-1123"):
        ContainerPlan("Web;rm", ["true"], {}, None)
    container = ContainerPlan("web", ["true"], {}, None)
    with pytest.raises(ValueError, match="UID"):
        PodPlan("../x", "Never", [], [container], b"")
    with pytest.raises(ValueError, match="restartPolicy"):
        PodPlan("u1", "Sometimes", [], [container], b"")
    with pytest.raises(ValueError, match="two containers"):
        PodPlan("u1", "Never", [container], [container], b"")
    with pytest.raises(ValueError):
        exec_command(ROOT, "u1", "web;x", ["true"])
    with pytest.raises(ValueError):
        sweep_script(ROOT, ["u1", "$(x)"])


def test_secrets_never_appear_in_any_process_arguments(device: Device) -> None:
    secret = f"s3cr3t-{uuid.uuid4()}"
    seen: list[str] = []
    stop = threading.Event()

    def watch() -> None:  # every process's argv, all along, not only at one moment
        while not stop.is_set():
            for entry in Path("/proc").glob("[0-9]*"):
                try:
                    cmdline = (entry / "cmdline").read_bytes()
                except OSError:
                    continue
                if secret.encode() in cmdline:
                    seen.append(cmdline.decode(errors="replace"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        container = ctr("main", 'echo "${#TOKEN}"; exec sleep 30', env={"TOKEN": secret})
        device.start(pod_plan(container, policy="Always"))
        pid = status(device.wait(state_of("main", "running"))).pid
        device.run(exec_command(ROOT, "u1", "main", ["true"]))
        time.sleep(0.3)
    finally:
        stop.set()
        watcher.join()
    assert seen == []
    assert f"TOKEN={secret}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env_file = device.pod_dir() / "env" / "main"
    assert env_file.stat().st_mode & 0o777 == 0o600
    for path in device.pod_dir().rglob("*"):
        if path.is_file() and path != env_file:
            assert secret.encode() not in path.read_bytes(), path


# -- the sweep's output ---------------------------------------------------------------------------
def test_a_sweep_lists_every_pod_or_the_ones_asked_for(device: Device) -> None:
    device.start(pod_plan(ctr("main", "exec sleep 30"), uid="u1"))
    device.start(pod_plan(ctr("main", "exec sleep 30"), uid="u2", metadata=b"two"))
    assert set(device.sweep()) == {"u1", "u2"}
    assert set(device.sweep(["u2", "u3"])) == {"u2"}
    assert device.sweep(["u2"])["u2"].metadata_json == b"two"
    assert device.sweep([]) == {}


SAMPLE = b"""vkubelet-sweep 1
pod u1 1 0
json
eyJhIjoxfQ==
.
init setup 0
state terminated 0 2024-05-01T10:00:00Z 2024-05-01T10:00:01Z
main main 2
state running 4242 2024-05-01T10:00:05Z
last terminated 137 2024-05-01T10:00:02Z 2024-05-01T10:00:03Z
main side 0
state
end u1
pod u2 0 1
json
.
main main 0
state waiting CrashLoopBackOff 20
end u2
"""


def test_parse_sweep_reads_states_times_and_order() -> None:
    pods = parse_sweep(SAMPLE)
    assert set(pods) == {"u1", "u2"}
    u1 = pods["u1"]
    assert (u1.supervisor_alive, u1.stopping, u1.metadata_json) == (True, False, b'{"a":1}')
    [setup] = u1.init_containers
    assert (setup.state, setup.reason, setup.exit_code) == ("terminated", "Completed", 0)
    main, side = u1.containers
    assert (main.state, main.pid, main.restart_count) == ("running", 4242, 2)
    assert main.started_at == datetime(2024, 5, 1, 10, 0, 5, tzinfo=UTC)
    assert main.last is not None and main.last.started_at is not None
    assert (main.last.exit_code, main.last.reason) == (137, "Error")
    assert main.last.finished_at == main.last.started_at + timedelta(seconds=1)
    assert (side.state, side.reason) == ("waiting", "ContainerCreating")
    u2 = pods["u2"]
    assert (u2.supervisor_alive, u2.stopping, u2.metadata_json) == (False, True, b"")
    assert (status(u2).reason, status(u2).backoff_seconds) == ("CrashLoopBackOff", 20)
    assert side.backoff_seconds is None
    assert parse_sweep(SAMPLE.decode()) == pods


def test_parse_sweep_leaves_out_records_cut_short_or_garbled() -> None:
    full = parse_sweep(SAMPLE)
    for cut in range(len(SAMPLE)):
        pods = parse_sweep(SAMPLE[:cut])
        assert all(pods[uid] == full[uid] for uid in pods)
    garbled = SAMPLE.replace(b"state running 4242", b"state running 42x42")
    assert set(parse_sweep(garbled)) == {"u2"}
    garbled = SAMPLE.replace(b"end u1", b"end u9")
    assert set(parse_sweep(garbled)) == {"u2"}
    garbled = SAMPLE.replace(b"eyJhIjoxfQ==", b"eyJh\xffIjoxfQ==")
    assert set(parse_sweep(garbled)) == {"u2"}


@given(st.binary(max_size=400) | st.text(max_size=400))
def test_parse_sweep_never_fails_on_garbage(garbage: bytes | str) -> None:
    parse_sweep(garbage)
    mixed = SAMPLE + garbage if isinstance(garbage, bytes) else SAMPLE.decode() + garbage
    parse_sweep(mixed)


@given(st.lists(st.sampled_from(SAMPLE.split(b"\n")), max_size=30))
def test_parse_sweep_never_fails_on_shuffled_lines(lines: list[bytes]) -> None:
    parse_sweep(b"\n".join(lines))


# -- runtime containers ----------------------------------------------------------------------
#: A stand-in for podman on the "device": `image inspect` finds only the image "present", `pull`
#: of "bad*" fails with the registry's words, `run` records its argv and runs the image's args
#: (after `--` and the image, behind docker's `--entrypoint=PROGRAM`) as the container's
#: command, so exit codes and output flow as with a runtime; `rm` records the name.
FAKE_RUNTIME = r"""#!/bin/sh
log=$(dirname "$0")/calls
case $1 in
image) [ "$3" = present ] ;;
pull)
	case $3 in bad*)
		echo "Error: initializing source docker://$3: connection refused" >&2
		exit 125
		;;
	esac
	;;
run)
	here=$(dirname "$0")
	printf '%s\n' "$@" >"$here/run.args"
	pidfile=
	entrypoint=
	while [ "$1" != -- ]; do
		[ "$1" != --env-file ] || cp "$2" "$here/env.file"
		[ "$1" != --pidfile ] || pidfile=$2
		case $1 in --entrypoint=*) entrypoint=${1#--entrypoint=} ;; esac
		shift
	done
	shift 2
	[ -z "$entrypoint" ] || set -- "$entrypoint" "$@"
	# as podman with runc: what cannot be created or started fails before any pid file
	if [ -e "$here/full" ]; then
		echo "Error: creating container storage: no space left on device" >&2
		exit 125
	fi
	if ! command -v "$1" >/dev/null 2>&1; then
		echo "Error: runc create failed: exec: \"$1\": executable file not found in \$PATH" >&2
		exit 127
	fi
	# created: this process (named crun) is the container's until it runs the command
	[ -z "$pidfile" ] || printf %s $$ >"$pidfile" # no line break, as podman writes it
	[ ! -e "$here/slow" ] || sleep 1
	exec "$@"
	;;
kill) echo "kill $2" >>"$log" ;;
rm) echo "rm $3" >>"$log" ;;
esac
"""


def fake_runtime(tmp_path: Path, kind: Literal["podman", "docker"] = "podman") -> Runtime:
    bin_dir = tmp_path / "rt"
    bin_dir.mkdir()
    (bin_dir / "crun").write_text(FAKE_RUNTIME)
    (bin_dir / "crun").chmod(0o755)
    return Runtime([str(bin_dir / "crun")], ["--ulimit", "nofile=1024:1024"], kind)


def image_ctr(runtime: Runtime, image: str, args: list[str], **extra: Any) -> ContainerPlan:
    env = extra.pop("env", {})
    run = ImageRun(runtime, image, extra.pop("pull_policy", "IfNotPresent"), **extra)
    return ContainerPlan("main", args, env, None, image=run)


def test_a_runtime_container_gets_literal_arguments_its_env_in_a_file_and_its_labels(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    plan = ContainerPlan(
        "main",
        ["sh", "-c", 'printf "%s|" "$@"', "sh", *HOSTILE],
        {"GREETING": "a 'b' $(c)"},
        "/work dir",
        image=ImageRun(
            runtime,
            "present",
            "IfNotPresent",
            mounts=[Mount("volumes/www", "/www", read_only=True), Mount("/srv/x", "/x")],
            memory_bytes=67108864,
            cpus="0.500",
        ),
    )
    device.start(pod_plan(plan))
    pod = device.wait(state_of())
    assert status(pod).exit_code == 0
    output = b"\n".join(line.content for line in device.log())
    assert output == "".join(f"{a}|" for a in HOSTILE).encode()
    argv = (tmp_path / "rt" / "run.args").read_text().split("\n")
    p = device.pod_dir()
    assert argv[: argv.index("--")] == [
        "run", "--rm", "--replace", "--name", "vk-u1-main",
        "--label", "io.vkubelet.pod-uid=u1", "--label", "io.vkubelet.container=main",
        "--network", "host", "--env-file", f"{p}/env/main", "--workdir", "/work dir",
        "--volume", f"{p}/volumes/www:/www:ro", "--volume", "/srv/x:/x",
        "--memory", "67108864", "--cpus", "0.500", "--ulimit", "nofile=1024:1024",
        "--cidfile", f"{p}/c/main/cid", "--pidfile", f"{p}/c/main/cpid",
    ]  # fmt: skip
    assert argv[argv.index("--") + 1] == "present"
    assert "a 'b' $(c)" not in "\n".join(argv)  # env values are never arguments
    assert (tmp_path / "rt" / "env.file").read_text() == "GREETING=a 'b' $(c)\n"
    assert oct((p / "env" / "main").stat().st_mode & 0o777) == "0o600"
    # nothing left behind, at once
    assert (tmp_path / "rt" / "calls").read_text() == "kill vk-u1-main\nrm vk-u1-main\n"


def test_a_docker_run_removes_a_stale_container_first_and_splits_the_command(
    device: Device, tmp_path: Path
) -> None:
    """docker has no `run --replace` and takes one program as `--entrypoint`: the command's
    other words come before the args; and the daemon keeps no log of its own."""
    runtime = fake_runtime(tmp_path, "docker")
    entrypoint = ["sh", "-c", 'printf "%s|" "$@"', "sh"]
    plan = image_ctr(runtime, "present", HOSTILE, entrypoint=entrypoint)
    device.start(pod_plan(plan))
    pod = device.wait(state_of())
    assert status(pod).exit_code == 0
    output = b"\n".join(line.content for line in device.log())
    assert output == "".join(f"{a}|" for a in HOSTILE).encode()
    argv = (tmp_path / "rt" / "run.args").read_text().split("\n")
    options = argv[: argv.index("--")]
    assert "--replace" not in options
    assert options[options.index("--log-driver") + 1] == "none"
    assert "--entrypoint=sh" in options
    assert argv[argv.index("--") + 1 :][:4] == ["present", "-c", 'printf "%s|" "$@"', "sh"]
    # the name made free before the run, and the container gone after it
    calls = (tmp_path / "rt" / "calls").read_text()
    assert calls == "rm vk-u1-main\nkill vk-u1-main\nrm vk-u1-main\n"


def test_a_command_whose_first_word_is_empty_is_refused_for_a_runtime() -> None:
    with pytest.raises(ValueError, match="its first word is empty"):
        image_ctr(Runtime(["docker"], kind="docker"), "busybox", [], entrypoint=["", "x"])


def test_a_pull_failure_is_err_image_pull_with_the_runtimes_words_then_back_off(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    device.start(pod_plan(image_ctr(runtime, "bad/image:1", ["true"]), policy="Always"))
    pod = device.wait(lambda p: status(p).reason == "ErrImagePull")
    assert "docker://bad/image:1" in (status(pod).message or "")
    assert status(pod).restart_count == 0
    pod = device.wait(lambda p: status(p).reason == "ImagePullBackOff", timeout=15)
    assert "connection refused" in (status(pod).message or "")
    device.run(stop_pod_script(ROOT, "u1", 1))
    device.wait(lambda p: not p.supervisor_alive)


def test_each_failed_pull_is_err_image_pull_then_image_pull_back_off_until_the_next(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    device.env_overrides["VKUBELET_BACKOFF_BASE"] = "2"
    device.start(pod_plan(image_ctr(runtime, "bad/image:1", ["true"]), policy="Always"))
    device.wait(lambda p: status(p).reason == "ErrImagePull")
    device.wait(lambda p: status(p).reason == "ImagePullBackOff")
    # the second attempt fails too: ErrImagePull again, with the runtime's words, then back-off
    pod = device.wait(lambda p: status(p).reason == "ErrImagePull", timeout=15)
    assert "connection refused" in (status(pod).message or "")
    device.wait(lambda p: status(p).reason == "ImagePullBackOff", timeout=15)
    device.run(stop_pod_script(ROOT, "u1", 1))
    device.wait(lambda p: not p.supervisor_alive)


def test_a_podman_container_is_running_once_its_runtime_has_started_it(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    (tmp_path / "rt" / "slow").touch()  # a second between creating it and starting it
    device.start(pod_plan(image_ctr(runtime, "present", ["sleep", "30"]), policy="Always"))
    created = device.pod_dir() / "c" / "main" / "cpid"
    wait_for(created.exists, timeout=10, interval=0.01, what="the container created")
    assert status(device.pod()).state == "waiting"  # created, its command not started yet
    pod = device.wait(state_of(state="running"))
    assert status(pod).pid is not None and alive(status(pod).pid or 0)
    assert Path(f"/proc/{created.read_text().strip()}/comm").read_text() == "sleep\n"


def test_a_command_the_runtime_cannot_start_is_start_error_128_then_crash_loop_back_off(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    device.start(pod_plan(image_ctr(runtime, "present", ["no-such-command"]), policy="Always"))
    pod = device.wait(lambda p: status(p).reason == "CrashLoopBackOff", timeout=15)
    last = status(pod).last
    assert last is not None
    assert (last.reason, last.exit_code) == ("StartError", 128)
    assert last.message == (
        'runc create failed: exec: "no-such-command": executable file not found in $PATH'
    )
    assert status(pod).restart_count >= 1
    device.run(stop_pod_script(ROOT, "u1", 1))
    device.wait(lambda p: not p.supervisor_alive)


def test_a_container_the_runtime_cannot_create_waits_in_create_container_error_until_it_can(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    (tmp_path / "rt" / "full").touch()
    device.start(pod_plan(image_ctr(runtime, "present", ["sleep", "30"]), policy="Never"))
    pod = device.wait(lambda p: status(p).reason == "CreateContainerError")
    assert status(pod).message == "creating container storage: no space left on device"
    (tmp_path / "rt" / "full").unlink()
    pod = device.wait(state_of(state="running"), timeout=15)
    assert status(pod).restart_count == 0  # attempts to create it were no runs
    assert status(pod).last is None


def test_an_absent_image_under_never_is_err_image_never_pull(
    device: Device, tmp_path: Path
) -> None:
    runtime = fake_runtime(tmp_path)
    device.start(pod_plan(image_ctr(runtime, "absent", ["true"], pull_policy="Never")))
    pod = device.wait(lambda p: status(p).reason == "ErrImageNeverPull")
    assert "absent is not present with pull policy of Never" in (status(pod).message or "")


@pytest.mark.parametrize("image", ["--privileged", "-v/:/h", "a b", "x;y", "", "$(x)"])
def test_images_a_runtime_could_read_as_options_or_words_are_refused(image: str) -> None:
    with pytest.raises(ValueError, match="not an image reference"):
        image_ctr(Runtime(["podman"]), image, [])


def test_values_a_runtime_container_cannot_take_are_refused() -> None:
    runtime = Runtime(["podman"])
    with pytest.raises(ValueError, match="environment variable A: a value with a line break"):
        image_ctr(runtime, "busybox", [], env={"A": "1\n2"})
    for target in ["/a:b", "/a,b", "relative"]:
        with pytest.raises(ValueError, match="mountPath"):
            image_ctr(runtime, "busybox", [], mounts=[Mount("volumes/v", target)])
    with pytest.raises(ValueError, match="imagePullPolicy"):
        image_ctr(runtime, "busybox", [], pull_policy="Sometimes")


def test_exec_in_a_runtime_container_is_the_runtimes_exec_with_literal_arguments() -> None:
    line = runtime_exec_command(
        Runtime(["podman", "--runtime", "/usr/sbin/runc"]), "u1", "web", ["sh", "-c", "$(x)"],
        stdin=True, tty=True,
    )  # fmt: skip
    assert shlex.split(line) == [
        "exec", "podman", "--runtime", "/usr/sbin/runc", "exec", "-i", "-t", "vk-u1-web",
        "sh", "-c", "$(x)",
    ]  # fmt: skip


def test_parse_sweep_reads_a_waiting_containers_message() -> None:
    message = base64.b64encode(b"Error: pull refused\n").decode()
    output = (
        "pod u1 1 0\njson\n.\nmain main 0\nstate waiting ErrImagePull 10\n"
        f"message {message}\nend u1\n"
    )
    main = status(parse_sweep(output)["u1"])
    assert (main.reason, main.message, main.backoff_seconds) == (
        "ErrImagePull",
        "Error: pull refused",
        10,
    )


def test_a_runtime_missing_on_the_device_is_create_container_error_naming_the_setting(
    device: Device, tmp_path: Path
) -> None:
    runtime = Runtime([str(tmp_path / "no-such-podman")])
    device.start(pod_plan(image_ctr(runtime, "busybox:1", ["true"]), policy="Always"))
    pod = device.wait(lambda p: status(p).reason == "CreateContainerError")
    assert "no-such-podman is not on the device's PATH" in (status(pod).message or "")
    assert "runtimeCommand" in (status(pod).message or "")
    assert status(pod).restart_count == 0
    device.run(stop_pod_script(ROOT, "u1", 1))
    device.wait(lambda p: not p.supervisor_alive)
