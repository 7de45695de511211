"""Container images on SSH devices: real sshd devices (network namespaces) with Debian's podman
or docker, the dev cluster's busybox image loaded into it, `vkubelet run --provider ssh`, the real
control plane and kubectl. One lab for each runtime: two devices with it, one without a runtime
(podman: and one whose podDir and podman storage are small disks).

On docker, CI runs what docker does differently from podman (the last test, on one device's
daemon); the podman scenario passed on docker too (docs/ssh-devices.md) and runs on it with
VKUBELET_TEST_DOCKER=all (about 100 s more)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster, build_image
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    ephemeral_state,
    interactive_debug,
    local_test_address,
    node_ready,
    port_forward,
    terminal_session,
    wait_for,
)
from vkubelet.testing.sshlab import (
    PODMAN_SETTINGS,
    TestDevice,
    docker_daemon,
    docker_unavailable,
    podman_load,
    podman_unavailable,
    ssh_inventory,
    ssh_lab,
)

from .sshagent import TOLERATE, start_agent, status
from .test_kubectl_top import _mebibytes, _millicores, _top
from .test_ssh_devices import HOSTILE

LABEL = "io.vkubelet.pod-uid"
#: The podman scenario on docker too (see the module doc).
_DOCKER_ALL = os.environ.get("VKUBELET_TEST_DOCKER") == "all"


@dataclass
class Lab:
    devices: list[TestDevice]  # [runtime, runtime, no runtime, podman on small disks (podman)]
    agent: AgentProcess
    image: str  # the busybox image as the runtime names it
    archive: Path  # the same image as an OCI archive: `oci-archive:<archive>` pulls it
    small: SmallDisks | None  # podman's: the last device's podDir and podman storage
    runtime: str  # podman | docker
    clis: list[list[str]]  # the runtime's CLI as the host calls it, one per store of containers

    def cli(self, *args: str, store: int = 0) -> str:
        argv = [*self.clis[store], *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout

    def containers(self, uid: str) -> list[dict[str, Any]]:
        """The runtime containers of a pod, as {Id, Image, State}: the devices run them, the
        host's CLI sees them (podman: the host's storage, which the devices share; docker: each
        device's daemon)."""
        if self.runtime == "podman":
            return _containers(uid)
        found = []
        for store in range(len(self.clis)):
            label = f"label={LABEL}={uid}"
            out = self.cli(
                "ps", "--no-trunc", "--format", "{{json .}}", "--filter", label, store=store
            )
            for line in out.splitlines():
                c = json.loads(line)
                found.append({"Id": c["ID"], "Image": c["Image"], "State": c["State"]})
        return found

    def inspect(self, container: str) -> dict[str, Any]:
        for store in range(len(self.clis)):
            with contextlib.suppress(subprocess.CalledProcessError):
                found: dict[str, Any] = json.loads(self.cli("inspect", container, store=store))[0]
                return found
        raise AssertionError(f"no container {container}")


@dataclass
class SmallDisks:
    """A device's podDir and podman storage on small tmpfs mounts of their own, to fill."""

    pods: Path
    storage: Path
    podman: list[str]  # podman as that device calls it (its own storage)

    @contextlib.contextmanager
    def full(self, disk: Path) -> Iterator[None]:
        """`disk` full until the block ends."""
        filler = disk / "filler"
        with filler.open("wb", buffering=0) as out, contextlib.suppress(OSError):
            while True:
                out.write(b"\0" * 65536)
        try:
            yield
        finally:
            filler.unlink()

    @classmethod
    @contextlib.contextmanager
    def mounted(cls, workdir: Path) -> Iterator[SmallDisks]:
        disks = cls(workdir / "small-pods", workdir / "small-storage", [])
        run = Path("/run/vkubelet-lab") / f"small-{uuid.uuid4().hex[:6]}"  # at most 50 characters
        disks.podman = [
            *PODMAN,
            *("--root", str(disks.storage), "--runroot", str(run / "run")),
            *("--tmpdir", str(run / "tmp")),
        ]
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, run, ignore_errors=True)
            for disk, size in ((disks.pods, "4m"), (disks.storage, "48m")):
                disk.mkdir()
                mount = ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs"]
                subprocess.run([*mount, str(disk)], check=True, capture_output=True)
                stack.callback(subprocess.run, ["umount", "-l", str(disk)], capture_output=True)
            stack.callback(_rm_all, disks.podman)
            yield disks


@pytest.fixture(scope="module", params=["podman", "docker"])
def lab(
    request: pytest.FixtureRequest,
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Lab]:
    runtime: str = request.param
    if (
        reason := podman_unavailable() if runtime == "podman" else docker_unavailable()
    ) is not None:
        pytest.skip(reason)
    archive = build_image("busybox", progress=lambda _: None).path
    workdir = tmp_path_factory.mktemp(f"ssh-{runtime}")
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(local_test_address())
        count = 4 if runtime == "podman" else 3
        devices = stack.enter_context(ssh_lab(count, workdir, root=True, containers=True))
        small: SmallDisks | None = None
        if runtime == "podman":
            image = podman_load(archive)
            small = stack.enter_context(SmallDisks.mounted(workdir))
            # The host's storage is shared with other test runs: this lab's containers carry a
            # label of its own, and only they are removed at the end.
            mark = f"lab.vkubelet.io/lab={workdir.name}-{uuid.uuid4().hex[:6]}"
            run_args = [*PODMAN_SETTINGS["runtimeRunArgs"], "--label", mark]
            stack.callback(_rm_all, PODMAN, mark)
            # A prestart hook makes podman take 3 s between creating and starting a container
            # whose command is /bin/busybox (only the lifecycle test's): Running must wait for
            # the start.
            hooks = workdir / "hooks"
            hooks.mkdir()
            (hooks / "slow-start.json").write_text(json.dumps(SLOW_START_HOOK))
            command = [*PODMAN_SETTINGS["runtimeCommand"], "--hooks-dir", str(hooks)]
            podman = {**PODMAN_SETTINGS, "runtimeCommand": command, "runtimeRunArgs": run_args}
            settings = [podman, podman, {}, {**podman, "runtimeCommand": small.podman}]
            settings[3]["podDir"] = str(small.pods)
            clis = [PODMAN]
        else:  # a daemon of each device's own; CI's one docker test needs only the first's
            daemons = [
                stack.enter_context(docker_daemon(d, workdir / f"{d.name}-docker"))
                for d in devices[: 2 if _DOCKER_ALL else 1]
            ]
            image = {daemon.load(archive) for daemon in daemons}.pop()  # the same in both
            settings = [daemon.settings() for daemon in daemons]
            clis = [daemon.command for daemon in daemons]
        # Short pings and reconnects: an SSH drop is seen, and over, within seconds.
        inventory = ssh_inventory(
            devices,
            restartBackoff={"initial": 2, "max": 4},
            reconnectBackoff={"initial": 1, "max": 2},
            pingInterval=1,
            connectTimeout=2,
        )
        for entry, extra in zip(inventory["devices"], settings, strict=False):
            entry.update(extra)
        path = workdir / "inventory.yaml"
        path.write_text(yaml.safe_dump(inventory))
        agent = start_agent(kube_cluster, workdir, path, address)
        try:
            for device in devices:
                wait_for(
                    lambda d=device: node_ready(kubectl, d.name),  # type: ignore[misc]
                    timeout=60,
                    what=f"node {device.name} Ready",
                )
            yield Lab(devices, agent, image, archive, small, runtime, clis)
        finally:
            agent.stop()
            for device in devices:
                kubectl("delete", "node", device.name, "--ignore-not-found", "--wait=false")


SLOW_START_HOOK = {
    "version": "1.0.0",
    "hook": {"path": "/bin/sh", "args": ["sh", "-c", "sleep 3"]},
    "when": {"commands": ["^/bin/busybox$"]},
    "stages": ["prestart"],
}

#: podman as the lab's devices call it (its network lock in the lab's directory, not /etc/cni).
PODMAN = [str(word) for word in PODMAN_SETTINGS["runtimeCommand"]]


def _rm_all(podman: list[str], label: str = LABEL) -> None:
    """What a lab's pods left in a podman storage (the host's is shared with other runs: only
    this lab's `label`)."""
    listed = subprocess.run(
        [*podman, "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True
    )
    if ids := listed.stdout.split():
        subprocess.run([*podman, "rm", "-f", "-t", "0", *ids], capture_output=True, timeout=60)


def _containers(uid: str, podman: list[str] = PODMAN) -> list[dict[str, Any]]:
    """The podman containers of a pod: the device runs them, the host's podman sees them."""
    listed = subprocess.run(
        [*podman, "ps", "--format", "json", "--filter", f"label={LABEL}={uid}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    found: list[dict[str, Any]] = json.loads(listed.stdout or "[]")
    return found


def _by_hand_on_docker(lab: Lab) -> None:
    """Skips the podman scenario on docker unless asked for (see the module doc)."""
    if lab.runtime == "docker" and not _DOCKER_ALL:
        pytest.skip("passed on docker by hand; VKUBELET_TEST_DOCKER=all runs it")


def _pods(kubectl: Kubectl, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = kubectl.json("get", "pods", "-l", selector)["items"]
    return items


def _first(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    first: dict[str, Any] = statuses[0]
    return first


def _pod(
    name: str, node: str, container: dict[str, Any], restart: str = "Always"
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "nodeName": node,
            "restartPolicy": restart,
            "tolerations": TOLERATE,
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "main", **container}],
        },
    }


def test_a_deployment_of_an_image_runs_as_runtime_containers_on_two_devices(
    lab: Lab, kubectl: Kubectl, tmp_path: Path
) -> None:
    _by_hand_on_docker(lab)
    app = f"img-{uuid.uuid4().hex[:6]}"
    port = 18000 + int(uuid.uuid4().hex[:3], 16) % 1000
    devices = [d.name for d in lab.devices[:2]]
    # Serves the ConfigMap (a bind mount), prints its env, and exits 3 once /tmp/stop exists.
    script = (
        f"echo hello $GREETING; httpd -p 127.0.0.1:{port} -h /www; "
        "while [ ! -e /tmp/stop ]; do sleep 0.2; done; exit 3"
    )
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": app},
            "data": {"index.html": f"served by {app}\n"},
        }
    )
    kubectl.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": app},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": app}},
                "template": {
                    "metadata": {"labels": {"app": app}},
                    "spec": {
                        "tolerations": TOLERATE,
                        "terminationGracePeriodSeconds": 1,
                        "affinity": {
                            "nodeAffinity": {
                                "requiredDuringSchedulingIgnoredDuringExecution": {
                                    "nodeSelectorTerms": [
                                        {
                                            "matchExpressions": [
                                                {
                                                    "key": "lab.vkubelet.io/device",
                                                    "operator": "In",
                                                    "values": devices,
                                                }
                                            ]
                                        }
                                    ]
                                }
                            }
                        },
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "lab.vkubelet.io/device",
                                "whenUnsatisfiable": "DoNotSchedule",
                                "labelSelector": {"matchLabels": {"app": app}},
                            }
                        ],
                        "containers": [
                            {
                                "name": "web",
                                "image": lab.image,
                                "imagePullPolicy": "IfNotPresent",
                                "command": ["sh", "-c", script],
                                "env": [{"name": "GREETING", "value": "from a 'device' $HOME"}],
                                "ports": [{"containerPort": port}],
                                "resources": {"limits": {"memory": "64Mi", "cpu": "500m"}},
                                "volumeMounts": [{"name": "www", "mountPath": "/www"}],
                                # only in the container: proves exec probes run in it
                                "readinessProbe": {
                                    "exec": {"command": ["test", "-e", "/www/index.html"]},
                                    "periodSeconds": 1,
                                },
                            }
                        ],
                        "volumes": [{"name": "www", "configMap": {"name": app}}],
                    },
                },
            },
        }
    )
    selector = f"app={app}"
    try:

        def running() -> list[dict[str, Any]]:
            pods = _pods(kubectl, selector)
            ok = len(pods) == 2 and all(_first(p).get("ready") for p in pods)
            return pods if ok else []

        pods = wait_for(running, timeout=120, what="both replicas Running and Ready")
        assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(devices)
        names = [p["metadata"]["name"] for p in pods]
        uids = [p["metadata"]["uid"] for p in pods]
        ids = {}
        for uid in uids:
            [found] = lab.containers(uid)  # one runtime container per pod container
            assert found["Image"] == lab.image and found["State"] == "running"
            ids[uid] = found["Id"]
            inspect = lab.inspect(found["Id"])
            assert inspect["HostConfig"]["Memory"] == 64 * 1024 * 1024
            assert inspect["HostConfig"]["NanoCpus"] == 500_000_000

        # logs: the container's env, literally (no shell expanded it on the device)
        for name in names:
            wait_for(
                lambda n=name: (
                    kubectl("logs", n).stdout  # type: ignore[misc]
                    == "hello from a 'device' $HOME\n"
                ),
                what="the container's output",
            )
        first = names[0]
        # exec: in the container (its file system, its env), with a terminal for -it
        assert kubectl("exec", first, "--", "cat", "/www/index.html").stdout == f"served by {app}\n"
        assert kubectl("exec", first, "--", "sh", "-c", "exit 7", check=False).returncode == 7
        assert kubectl("exec", "-i", first, "--", "cat", input="abc\n").stdout == "abc\n"
        command = f"{kubectl.binary} --kubeconfig {kubectl.kubeconfig} exec -it {first} -- sh"
        with terminal_session(command, cols=120, rows=40) as terminal:
            wait_for(lambda: "#" in terminal.screen(), timeout=30, what="the container's prompt")
            terminal.type("stty size; echo env=$GREETING")
            wait_for(
                lambda: "40 120" in terminal.screen() and "env=from a" in terminal.screen(),
                timeout=30,
                what="a terminal in the container",
            )
            terminal.type("exit")

        # port-forward: the container's server, over the device's network
        with port_forward(kubectl, first, port) as local:

            def fetch() -> bytes:
                try:
                    url = f"http://127.0.0.1:{local}/index.html"
                    with urllib.request.urlopen(url, timeout=5) as reply:
                        return bytes(reply.read())
                except OSError:
                    return b""

            wait_for(lambda: fetch() == f"served by {app}\n".encode(), what="HTTP via forward")

        # a ConfigMap update reaches the running container's bind mount
        kubectl("patch", "configmap", app, "-p", json.dumps({"data": {"index.html": "v2\n"}}))
        wait_for(
            lambda: kubectl("exec", first, "--", "cat", "/www/index.html").stdout == "v2\n",
            what="the update in the container",
        )

        # restart by policy: the container exits 3, a new one runs, the old run's log is kept
        kubectl("exec", first, "--", "touch", "/tmp/stop")

        def restarted() -> dict[str, Any]:
            found = _first(kubectl.json("get", "pod", first))
            return found if found.get("restartCount") == 1 and "running" in found["state"] else {}

        again = wait_for(restarted, timeout=60, what="restarted after its exit")
        assert again["lastState"]["terminated"]["exitCode"] == 3
        assert kubectl("logs", "--previous", first).stdout == "hello from a 'device' $HOME\n"
        [new] = lab.containers(uids[0])
        assert new["Id"] != ids[uids[0]]
        ids[uids[0]] = new["Id"]

        # kill -9 of the agent: the same containers after, none started twice
        lab.agent.stop(9)
        lab.agent.start()
        for device in devices:
            wait_for(lambda d=device: node_ready(kubectl, d), timeout=60, what="Ready again")  # type: ignore[misc]
        pods = wait_for(running, timeout=60, what="both replicas Running after the restart")
        for pod in pods:
            uid = pod["metadata"]["uid"]
            assert [c["Id"] for c in lab.containers(uid)] == [ids[uid]]
        assert [_first(p)["restartCount"] for p in pods if p["metadata"]["uid"] == uids[0]] == [1]

        # an SSH drop: the device is cut off until the agent has found it unreachable
        dropped = lab.devices[0]
        offset = len(lab.agent.log())
        dropped.link_down()
        try:
            wait_for(
                lambda: any(
                    f"device {dropped.name} (" in line and "unreachable" in line
                    for line in lab.agent.log()[offset:].splitlines()
                ),
                timeout=30,
                what="the agent losing the device",
            )
        finally:
            dropped.link_up()

        def reconnected() -> bool:
            lines = lab.agent.log()[offset:].splitlines()
            lost = [i for i, line in enumerate(lines) if "unreachable" in line]
            connected = f"device {dropped.name} connected"
            return bool(lost) and any(connected in line for line in lines[lost[0] :])

        wait_for(reconnected, timeout=60, what="the agent connected to the device again")
        wait_for(lambda: node_ready(kubectl, dropped.name), timeout=60, what="Ready after the drop")
        pods = wait_for(running, timeout=60, what="both replicas Running after the drop")
        for pod in pods:
            uid = pod["metadata"]["uid"]
            assert [c["Id"] for c in lab.containers(uid)] == [ids[uid]]

        # cp: through the runtime's exec and the image's tar
        source = tmp_path / "copied.txt"
        source.write_text("copied in\n")
        kubectl("cp", str(source), f"{first}:/tmp/copied.txt")
        assert kubectl("exec", first, "--", "cat", "/tmp/copied.txt").stdout == "copied in\n"
    finally:
        kubectl("delete", "deployment", app, "--wait=false", "--ignore-not-found")
        kubectl("delete", "configmap", app, "--wait=false", "--ignore-not-found")
    wait_for(lambda: not _pods(kubectl, selector), timeout=60, what="pods deleted")
    wait_for(lambda: not any(lab.containers(uid) for uid in uids), what="containers removed")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by .ci/run")
def test_kubectl_debug_with_an_image_is_a_container_sharing_its_targets_processes(
    lab: Lab, kubectl: Kubectl
) -> None:
    _by_hand_on_docker(lab)
    name = f"dbg-{uuid.uuid4().hex[:6]}"
    command = ["sh", "-c", "exec sleep 3600"]
    kubectl.apply(_pod(name, lab.devices[1].name, {"image": lab.image, "command": command}))
    try:
        wait_for(
            lambda: kubectl.json("get", "pod", name)["status"].get("phase") == "Running",
            timeout=60,
            what=f"{name} Running",
        )
        uid = kubectl.json("get", "pod", name)["metadata"]["uid"]
        with interactive_debug(
            kubectl, "default", name, "dbg", image=lab.image, target="main"
        ) as terminal:
            assert "running" in ephemeral_state(kubectl, "default", name, "dbg")
            assert len(lab.containers(uid)) == 2  # the pod's and the debug container
            terminal.type('ps -o args | grep -q "sleep 360[0]" && echo "SHARED""-PIDS"')
            wait_for(
                lambda: "SHARED-PIDS" in terminal.screen().split(),
                timeout=30,
                what="the target's process seen from the debug container",
            )
            terminal.type("exit 6")
            ended = wait_for(
                lambda: ephemeral_state(kubectl, "default", name, "dbg").get("terminated"),
                timeout=30,
                what="the debug container terminated",
            )
        assert ended["exitCode"] == 6
        wait_for(lambda: len(lab.containers(uid)) == 1, timeout=30, what="the debug container gone")
    finally:
        kubectl("delete", "pod", name, "--wait=false", "--ignore-not-found")


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is installed by .ci/run")
def test_a_tty_container_attaches_to_its_terminal_and_debug_containers_end_with_their_pod(
    lab: Lab, kubectl: Kubectl
) -> None:
    """`tty: true` is `run -t` in a terminal held on the device: `attach -it` reaches the
    container's terminal (`tty`, the client's resize in `stty size`) and `logs` has its output.
    A debug container a killed agent left running is removed by the next agent, its status
    says so; deleting the pod removes another."""
    _by_hand_on_docker(lab)
    name = f"tty-{uuid.uuid4().hex[:6]}"
    container = {"image": lab.image, "imagePullPolicy": "Never", "command": ["sh"]}
    kubectl.apply(_pod(name, lab.devices[1].name, {**container, "stdin": True, "tty": True}))
    uid = kubectl.json("get", "pod", name)["metadata"]["uid"]
    try:
        wait_for(lambda: status(kubectl, name).get("phase") == "Running", what=f"{name} Running")
        command = f"{kubectl.binary} --kubeconfig {kubectl.kubeconfig} attach -it {name}"
        with terminal_session(command, cols=120, rows=40) as terminal:

            def answers(line: str, expected: str) -> bool:
                terminal.type(line)  # again until kubectl has attached and the answer is there
                return expected in terminal.screen()

            wait_for(lambda: answers("tty", "/dev/pts/"), timeout=30, interval=2, what="a tty")
            terminal.resize(100, 30)
            wait_for(lambda: answers("stty size", "30 100"), timeout=30, interval=1, what="resize")
        wait_for(lambda: "30 100" in kubectl("logs", name).stdout, what="the terminal's log")
        assert "/dev/pts/" in kubectl("logs", name).stdout
        assert status(kubectl, name)["phase"] == "Running"

        debug = ["debug", name, f"--image={lab.image}", "--target=main", "--", "sleep", "3600"]
        kubectl(*debug[:2], "-c", "bg", *debug[2:])
        wait_for(lambda: len(lab.containers(uid)) == 2, timeout=30, what="the debug container")
        lab.agent.stop(9)
        lab.agent.start()
        ended = wait_for(
            lambda: ephemeral_state(kubectl, "default", name, "bg").get("terminated"),
            timeout=60,
            what="the debug container's end reported",
        )
        assert ended["reason"] == "ContainerStatusUnknown"
        wait_for(lambda: len(lab.containers(uid)) == 1, timeout=30, what="the debug container gone")
        kubectl(*debug[:2], "-c", "bg2", *debug[2:])
        wait_for(lambda: len(lab.containers(uid)) == 2, timeout=30, what="another debug container")
    finally:
        kubectl("delete", "pod", name, "--wait=false", "--ignore-not-found")
    wait_for(lambda: not lab.containers(uid), timeout=60, what="every container of the pod gone")


def test_kubectl_top_follows_a_cpu_burning_container_from_its_cgroup(
    lab: Lab, kubectl: Kubectl
) -> None:
    """A runtime container's processes run under conmon (docker: a containerd shim), outside
    the supervisor's process groups: its figures are its cgroup's (a busy loop: about a core,
    then nothing once it stops; the 20 MB its shell holds: busybox's sh would exec a last
    command, hence `exit`)."""
    _by_hand_on_docker(lab)
    name = f"top-{uuid.uuid4().hex[:6]}"
    burn = (
        "x=$(head -c 20000000 /dev/zero | tr '\\0' a); "
        "while [ ! -e /tmp/stop ]; do :; done; sleep 3600; exit"
    )
    container = {"image": lab.image, "command": ["sh", "-c", burn]}
    kubectl.apply(_pod(name, lab.devices[0].name, container))
    try:

        def pod_cpu(check: Any) -> list[str] | None:
            figures = _top(kubectl, "pod", name)
            return figures if figures is not None and check(_millicores(figures[1])) else None

        # About a core; at least 200m (four times the idle bound below) while other tests
        # share CI's two cores, as the command-mode test in test_ssh_devices.py asks.
        busy = wait_for(
            lambda: pod_cpu(lambda m: m >= 200), timeout=120, interval=2, what="about a core"
        )
        assert _mebibytes(busy[2]) >= 15
        kubectl("exec", name, "--", "touch", "/tmp/stop")
        idle = wait_for(
            lambda: pod_cpu(lambda m: m < 50), timeout=90, interval=2, what="the CPU falls"
        )
        assert _mebibytes(idle[2]) >= 15  # the shell still holds its variable
    finally:
        kubectl("delete", "pod", name, "--wait=false", "--ignore-not-found")


def test_bad_images_and_hostile_input_get_a_kubelets_reasons(lab: Lab, kubectl: Kubectl) -> None:
    _by_hand_on_docker(lab)
    podman, bare = lab.devices[0], lab.devices[2]
    tag = uuid.uuid4().hex[:6]
    canary = f"/tmp/vk-canary-{tag}"
    args = [h.format(canary=canary) for h in HOSTILE]
    env = [{"name": f"HOSTILE_{i}", "value": a} for i, a in enumerate(args) if "\n" not in a]
    script = 'printf "%s|" "$@" >/tmp/args; exec sleep 3600'
    pods = {
        # the registry refuses at once: the runtime's own words come back
        f"pull-{tag}": _pod(
            f"pull-{tag}",
            podman.name,
            {"image": "localhost:1/nothing:1", "imagePullPolicy": "IfNotPresent"},
        ),
        f"never-{tag}": _pod(
            f"never-{tag}",
            podman.name,
            {"image": "localhost/absent:1", "imagePullPolicy": "Never"},
        ),
        f"opt-{tag}": _pod(f"opt-{tag}", podman.name, {"image": "--privileged"}),
        f"bare-{tag}": _pod(f"bare-{tag}", bare.name, {"image": lab.image}),
        f"nl-{tag}": _pod(
            f"nl-{tag}",
            podman.name,
            {"image": lab.image, "env": [{"name": "TWO", "value": "line1\nline2"}]},
        ),
        f"attach-{tag}": _pod(
            f"attach-{tag}",
            podman.name,
            {
                "image": lab.image,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", "while read -r line; do echo got: $line; done"],
                "stdin": True,
            },
        ),
        f"hostile-{tag}": _pod(
            f"hostile-{tag}",
            podman.name,
            {
                "image": lab.image,
                "imagePullPolicy": "Never",
                "command": ["sh", "-c", script, "sh", *args],
                "env": env,
            },
        ),
    }

    def waiting(name: str, reason: str) -> dict[str, Any]:
        found = _first(kubectl.json("get", "pod", name)).get("state", {}).get("waiting", {})
        return found if found.get("reason") == reason else {}

    try:
        # The pull pod is watched from its start: a runtime that is refused at once (docker)
        # shows ErrImagePull for one back-off (2 s here), then ImagePullBackOff.
        kubectl.apply(pods[f"pull-{tag}"])
        pulled = wait_for(lambda: waiting(f"pull-{tag}", "ErrImagePull"), what="ErrImagePull")
        assert "localhost:1" in pulled["message"]  # the runtime's message
        for manifest in pods.values():
            kubectl.apply(manifest)
        wait_for(lambda: waiting(f"pull-{tag}", "ImagePullBackOff"), what="ImagePullBackOff")
        never = wait_for(lambda: waiting(f"never-{tag}", "ErrImageNeverPull"), what="NeverPull")
        assert "localhost/absent:1" in never["message"]
        for name, reason, words in [
            (f"opt-{tag}", "InvalidImageName", "not an image reference"),
            (f"bare-{tag}", "ImageNotSupported", "containerRuntime"),
            (f"nl-{tag}", "InvalidPod", "line break"),
        ]:
            wait_for(
                lambda n=name: status(kubectl, n).get("phase") == "Failed",  # type: ignore[misc]
                what=f"{name} Failed",
            )
            assert status(kubectl, name).get("reason") == reason
            assert words in status(kubectl, name).get("message", "")
        assert "hostImages" in status(kubectl, f"bare-{tag}")["message"]

        hostile = f"hostile-{tag}"
        wait_for(lambda: status(kubectl, hostile).get("phase") == "Running", what="Running")
        wait_for(
            lambda: kubectl("exec", hostile, "--", "cat", "/tmp/args", check=False).stdout,
            what="its arguments written",
        )
        assert kubectl("exec", hostile, "--", "cat", "/tmp/args").stdout == "".join(
            f"{a}|" for a in args
        )
        seen = kubectl("exec", hostile, "--", "env").stdout.splitlines()
        for variable in env:
            assert f"{variable['name']}={variable['value']}" in seen
        out = kubectl("exec", hostile, "--", "printf", "%s|", *args).stdout
        assert out == "".join(f"{a}|" for a in args)
        assert podman.run(f"test -e {canary} && echo FOUND || echo none").stdout.strip() == "none"

        attach = f"attach-{tag}"
        wait_for(lambda: status(kubectl, attach).get("phase") == "Running", what="Running")
        kubectl("attach", "-i", attach, input="hello attach\n", timeout=30, check=False)
        wait_for(lambda: "got: hello attach" in kubectl("logs", attach).stdout, what="the echo")
        assert status(kubectl, attach)["phase"] == "Running"  # no EOF when the client left
        assert node_ready(kubectl, podman.name)  # bad pods leave the device Ready
    finally:
        kubectl("delete", "pod", *pods, "--wait=false", "--ignore-not-found")


def _events(kubectl: Kubectl, pod: str) -> list[tuple[str, str]]:
    """(reason, message) of the pod's Events."""
    found = kubectl.json("get", "events", "--field-selector", f"involvedObject.name={pod}")
    return [(e.get("reason", ""), e.get("message", "")) for e in found["items"]]


@pytest.mark.parametrize("lab", ["podman"], indirect=True)  # docker has no --pidfile
def test_container_states_are_the_runtimes_as_a_kubelet_reports_them(
    lab: Lab, kubectl: Kubectl
) -> None:
    """Running once podman has started the container (not before `run`), a command podman
    cannot start is StartError (128, podman's words) then CrashLoopBackOff, and each failed
    pull is ErrImagePull then ImagePullBackOff, with the kubelet's Events."""
    node = lab.devices[0].name
    tag = uuid.uuid4().hex[:6]
    slow, bad, pull = f"slow-{tag}", f"nocmd-{tag}", f"pull-{tag}"
    busybox = {"image": lab.image, "imagePullPolicy": "Never"}
    kubectl.apply(_pod(slow, node, {**busybox, "command": ["/bin/busybox", "sleep", "3600"]}))
    kubectl.apply(_pod(bad, node, {**busybox, "command": ["no-such-command"]}))
    kubectl.apply(_pod(pull, node, {"image": "localhost:1/nothing:2", "imagePullPolicy": "Always"}))
    try:
        # Running when podman says the container runs: the API's startedAt is not before
        # podman's (3 s after `run` began, the hook's sleep).
        def running() -> str:
            return str(
                _first(kubectl.json("get", "pod", slow))
                .get("state", {})
                .get("running", {})
                .get("startedAt", "")
            )

        started = wait_for(running, timeout=60, what="Running")
        uid = kubectl.json("get", "pod", slow)["metadata"]["uid"]
        [found] = _containers(uid)
        state = lab.inspect(found["Id"])["State"]
        assert state["Running"] is True
        assert started.rstrip("Z") >= state["StartedAt"][:19]  # to the second: RFC 3339 both

        # A command podman cannot start: StartError with 128 and podman's words, then the
        # restart back-off.
        def start_error() -> dict[str, Any]:
            found = _first(kubectl.json("get", "pod", bad))
            last = found.get("lastState", {}).get("terminated", {})
            waiting = found.get("state", {}).get("waiting", {})
            ok = last.get("reason") == "StartError" and waiting.get("reason") == "CrashLoopBackOff"
            return found if ok else {}

        looping = wait_for(start_error, timeout=60, what="StartError, then CrashLoopBackOff")
        ended = looping["lastState"]["terminated"]
        assert ended["exitCode"] == 128
        assert '"no-such-command": executable file not found' in ended["message"]
        recorded = wait_for(
            lambda: [e for e in _events(kubectl, bad) if e[0] in ("Failed", "BackOff")],
            what="the start's Events",
        )
        assert any("no-such-command" in m for r, m in recorded if r == "Failed")

        # Every failed pull is ErrImagePull (podman's words), then ImagePullBackOff.
        def waiting(reason: str) -> dict[str, Any]:
            found = _first(kubectl.json("get", "pod", pull)).get("state", {}).get("waiting", {})
            return found if found.get("reason") == reason else {}

        for attempt in (1, 2):
            failed = wait_for(lambda: waiting("ErrImagePull"), what=f"ErrImagePull {attempt}")
            assert "localhost:1" in failed["message"]
            backing_off = wait_for(lambda: waiting("ImagePullBackOff"), what="ImagePullBackOff")
            assert backing_off["message"].startswith(
                'Back-off pulling image "localhost:1/nothing:2": ErrImagePull: '
            )
        recorded = _events(kubectl, pull)
        assert any(
            m.startswith('Failed to pull image "localhost:1/nothing:2": ') for _, m in recorded
        )
        assert ("BackOff", 'Back-off pulling image "localhost:1/nothing:2"') in recorded
        assert node_ready(kubectl, node)
    finally:
        kubectl("delete", "pod", slow, bad, pull, "--wait=false", "--ignore-not-found")


@pytest.mark.parametrize("lab", ["podman"], indirect=True)  # its storage on small disks
def test_a_full_disk_on_a_device_is_told_and_the_pods_recover_when_space_is_freed(
    lab: Lab, kubectl: Kubectl
) -> None:
    """Podman's storage full: a pull is ErrImagePull, a creation CreateContainerError, both
    naming "no space left on device", with Events; the podDir full: a command pod is
    CreateContainerError saying so. The node stays Ready, a pod running there runs on, and
    once space is freed every pod starts by itself."""
    device, small = lab.devices[3], lab.small
    assert small is not None
    tag = uuid.uuid4().hex[:6]
    keeper, pulled, created, command = (f"{n}-{tag}" for n in ("keep", "pull", "make", "cmd"))
    sleeping = {"command": ["sleep", "3600"]}
    archive = f"oci-archive:{lab.archive}"
    kubectl.apply(_pod(keeper, device.name, {"image": archive, **sleeping}))
    names = [keeper]
    try:
        wait_for(lambda: status(kubectl, keeper).get("phase") == "Running", what="the keeper")
        uid = kubectl.json("get", "pod", keeper)["metadata"]["uid"]
        [kept] = [c["Id"] for c in _containers(uid, small.podman)]

        def waiting(name: str, reason: str) -> dict[str, Any]:
            found = _first(kubectl.json("get", "pod", name)).get("state", {}).get("waiting", {})
            return found if found.get("reason") == reason else {}

        with small.full(small.storage):
            kubectl.apply(
                _pod(
                    pulled, device.name, {"image": archive, "imagePullPolicy": "Always", **sleeping}
                )
            )
            kubectl.apply(
                _pod(
                    created,
                    device.name,
                    {"image": lab.image, "imagePullPolicy": "Never", **sleeping},
                )
            )
            names += [pulled, created]
            failed = wait_for(lambda: waiting(pulled, "ErrImagePull"), what="ErrImagePull")
            assert "no space left on device" in failed["message"]
            refused = wait_for(
                lambda: waiting(created, "CreateContainerError"), what="CreateContainerError"
            )
            assert "no space left on device" in refused["message"]
            assert any(
                r == "Failed" and "no space left on device" in m
                for r, m in _events(kubectl, created)
            )
            with small.full(small.pods):
                kubectl.apply(_pod(command, device.name, {"image": "host", **sleeping}))
                names.append(command)
                told = wait_for(
                    lambda: waiting(command, "CreateContainerError"), what="the podDir full"
                )
                assert "no space left on device" in told["message"]
                assert any(r == "CreateContainerError" for r, _ in _events(kubectl, command))
                assert node_ready(kubectl, device.name)
                keeping = _first(kubectl.json("get", "pod", keeper))
                assert "running" in keeping["state"] and keeping["restartCount"] == 0
        # space again: each pod starts by itself
        for name in (pulled, created, command):
            wait_for(
                lambda n=name: status(kubectl, n).get("phase") == "Running",  # type: ignore[misc]
                timeout=60,
                what=f"{name} Running once space is freed",
            )
        assert [c["Id"] for c in _containers(uid, small.podman)] == [kept]  # never restarted
    finally:
        kubectl("delete", "pod", *names, "--wait=false", "--ignore-not-found")


@pytest.mark.parametrize("lab", ["docker"], indirect=True)
def test_docker_replaces_a_stale_container_splits_the_command_and_keeps_no_log_of_its_own(
    lab: Lab, kubectl: Kubectl
) -> None:
    """What docker's CLI does unlike podman's: there is no `run --replace` (a container of the
    pod container's name, left by a run whose supervisor died, is removed before the next run),
    `--entrypoint` is one program (the command's other words go before the args), and the
    daemon would keep a second log of every container (`--log-driver none`: the device's log
    files are the logs)."""
    device = lab.devices[0]
    name = f"dk-{uuid.uuid4().hex[:6]}"
    script = 'echo "$GREETING" "$@"; while [ ! -e /tmp/stop ]; do sleep 0.2; done; exit 3'
    container = {
        "image": lab.image,
        "imagePullPolicy": "Never",
        "command": ["sh", "-c", script, "sh"],
        "args": ["-x", "$(id)"],
        "env": [{"name": "GREETING", "value": "it's $HOME"}],
        "resources": {"limits": {"memory": "64Mi", "cpu": "500m"}},
    }
    # Held back by a scheduling gate until the stale container (its uid is the pod's) is there.
    manifest = _pod(name, "", container)
    del manifest["spec"]["nodeName"]
    manifest["spec"]["nodeSelector"] = {"lab.vkubelet.io/device": device.name}
    manifest["spec"]["schedulingGates"] = [{"name": "lab.vkubelet.io/stale-container"}]
    kubectl.apply(manifest)
    try:
        uid = kubectl.json("get", "pod", name)["metadata"]["uid"]
        stale = lab.cli(
            "run", "-d", "--name", f"vk-{uid}-main", "--label", f"{LABEL}={uid}",
            "--network", "host", lab.image, "sleep", "3600",
        ).strip()  # fmt: skip
        kubectl("patch", "pod", name, "--type=json", "-p", json.dumps(
            [{"op": "remove", "path": "/spec/schedulingGates"}]
        ))  # fmt: skip

        def replaced() -> list[dict[str, Any]]:
            found = lab.containers(uid)
            return found if [c["Id"] for c in found] not in ([], [stale]) else []

        [first] = wait_for(
            replaced, timeout=60, what="the pod's container in the stale one's place"
        )
        assert first["State"] == "running"
        wait_for(lambda: status(kubectl, name).get("phase") == "Running", what=f"{name} Running")
        wait_for(lambda: kubectl("logs", name).stdout, what="its output")
        assert kubectl("logs", name).stdout == "it's $HOME -x $(id)\n"
        inspect = lab.inspect(first["Id"])
        assert inspect["Name"] == f"/vk-{uid}-main"
        assert inspect["HostConfig"]["LogConfig"]["Type"] == "none"
        assert inspect["HostConfig"]["Memory"] == 64 * 1024 * 1024
        assert inspect["HostConfig"]["NanoCpus"] == 500_000_000
        assert kubectl("exec", name, "--", "sh", "-c", "exit 7", check=False).returncode == 7

        # exits 3: the run's `--rm` removed it, a new run of the same name starts
        kubectl("exec", name, "--", "touch", "/tmp/stop")

        def restarted() -> dict[str, Any]:
            found = _first(kubectl.json("get", "pod", name))
            return found if found.get("restartCount") == 1 and "running" in found["state"] else {}

        again = wait_for(restarted, timeout=60, what="restarted after its exit")
        assert again["lastState"]["terminated"]["exitCode"] == 3
        wait_for(
            lambda: [c["Id"] for c in lab.containers(uid)] not in ([], [first["Id"]]),
            what="a new container of the same name",
        )
        assert kubectl("logs", "--previous", name).stdout == "it's $HOME -x $(id)\n"
    finally:
        kubectl("delete", "pod", name, "--wait=false", "--ignore-not-found")
    wait_for(lambda: not lab.containers(uid), what="its container removed with the pod")
