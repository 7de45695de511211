"""The VM provider end to end (issue 12's acceptance): a real control plane, real kubectl, real
QEMU under TCG, the small test guest from Debian packages.

Booting is the expensive part (TCG on two shared cores), so one Deployment of two VMs is booted
per module and the tests take turns on it, in the order written: the last ones restart the
agent and scale the Deployment to zero.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    delete_namespace,
    ephemeral_state,
    interactive_debug,
    local_test_address,
    node_ready,
    start_agent,
    terminal_session,
    wait_for,
)

from ...unit.agent.units import unit_settings
from .vmlab import TOLERATION, alive, clean_up, require_vm_host, start_vm_agent

pytestmark = pytest.mark.integration

BOOT_TIMEOUT = 420  # two TCG boots on a busy 2-core machine
# The console's log rotation of this module's agent: small, so that a guest fills it quickly.
# Five files, as the kubelet's default: `logs -f` reads a rotated file it has not finished, but
# not one already deleted (as the kubelet's); with two, a follower 64 KiB behind under CI's load
# lost a file.
LOG_MAX_SIZE, LOG_MAX_FILES = 64 * 1024, 5


@dataclass
class VMNode:
    name: str
    agent: AgentProcess
    workdir: Path
    config: Path
    cluster: Cluster
    address: str

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    def restart_agent(self) -> None:
        self.agent = start_agent(
            self.cluster,
            self.workdir,
            provider="vm",
            config=self.config,
            name=self.name,
            address=self.address,
        )

    def qemu_pids(self) -> dict[str, int]:
        """Pod uid -> the pid of its QEMU, from the machines' pid files."""
        pids = {}
        for pid_file in self.state.glob("vms/*/m/*.pid"):
            pids[pid_file.parents[1].name] = int(pid_file.read_text().split()[0])
        for pid_file in self.state.glob("vms/*/m/pid"):
            pids[pid_file.parents[1].name] = int(pid_file.read_text().split()[0])
        return pids


@dataclass
class VMs:
    namespace: str
    kubectl: Kubectl

    def pods(self) -> list[dict[str, Any]]:
        items = self.kubectl.json("-n", self.namespace, "get", "pods", "-l", "app=vm")
        return [p for p in items["items"] if not p["metadata"].get("deletionTimestamp")]


@pytest.fixture(scope="module")
def vm_node(kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path) -> Iterator[VMNode]:
    require_vm_host()
    # Short: QEMU's unix sockets live below it (108-byte limit).
    workdir = Path(tempfile.mkdtemp(prefix="vkvm-", dir="/tmp"))
    name = f"hv-{uuid.uuid4().hex[:6]}"
    config = workdir / "vm.yaml"
    cidr = f"10.213.{random.randrange(1, 250)}.0/24"  # noqa: S311
    with contextlib.ExitStack() as stack:
        # Not loopback: the apiserver proxies nodes/<name>/proxy/... (stats) to none.
        address = stack.enter_context(local_test_address())
        agent = start_vm_agent(
            kube_cluster, workdir, name=name, address=address, cidr=cidr, image=vm_guest_image,
            guestAgentTimeoutSeconds=300,
            containerLogMaxSize=LOG_MAX_SIZE, containerLogMaxFiles=LOG_MAX_FILES,
            translationConfigMap={
                "namespace": "default",
                "name": f"{name}-images",
                "kubeconfig": str(kube_cluster.kubeconfig),
                "intervalSeconds": 1,
            },
        )  # fmt: skip
        node = VMNode(name, agent, workdir, config, kube_cluster, address)
        try:
            wait_for(lambda: node_ready(kubectl, name), timeout=90, what=f"node {name} Ready")
            yield node
        finally:
            node.agent.stop()
            clean_up(node.state, cidr)
            kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
            kubectl("-n", "default", "delete", "configmap", f"{name}-images", check=False)


@pytest.fixture(scope="module")
def vms(vm_node: VMNode, kubectl: Kubectl) -> Iterator[VMs]:
    namespace = create_namespace(kubectl, f"vm-{uuid.uuid4().hex[:6]}")
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "vm"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "vm"}},
            "template": {
                "metadata": {
                    "labels": {"app": "vm"},
                    "annotations": {"vm.vkubelet.io/root-size": "1Gi"},
                },
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": vm_node.name},
                    "tolerations": [TOLERATION],
                    "terminationGracePeriodSeconds": 60,
                    "volumes": [
                        {"name": "cfg", "configMap": {"name": "greeting"}},
                        {"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}},
                    ],
                    "containers": [
                        {
                            "name": "vm",
                            "image": "vm.vkubelet.io/tiny",
                            "resources": {"limits": {"cpu": "1", "memory": "256Mi"}},
                            "env": [{"name": "WHO", "value": "a VM"}],
                            "volumeMounts": [{"name": "cfg", "mountPath": "/etc/app"}],
                            # exec probes run through the guest agent, httpGet and tcpSocket
                            # reach the pod IP (readiness waits for the startup probe); the
                            # liveness probe fails until the guest serves on 8080, and never
                            # restarts the VM for it (the threshold is out of reach)
                            "startupProbe": {
                                "exec": {"command": ["test", "-f", "/etc/hostname"]},
                                "periodSeconds": 2,
                            },
                            "readinessProbe": {
                                "httpGet": {"path": "/", "port": 8080},
                                "periodSeconds": 2,
                            },
                            "livenessProbe": {
                                "tcpSocket": {"port": 8080},
                                "periodSeconds": 2,
                                "failureThreshold": 1000000,
                            },
                        }
                    ],
                },
            },
        },
    }
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "greeting"},
        "data": {"greeting": "hello"},
    }
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(config_map))
    kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))
    handle = VMs(namespace, kubectl)

    def both_running() -> bool:
        pods = handle.pods()
        return len(pods) == 2 and all(
            p["status"].get("phase") == "Running"
            and p["status"].get("podIP")
            and (p["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("running")
            for p in pods
        )

    wait_for(both_running, timeout=BOOT_TIMEOUT, interval=2, what="two VM pods Running")
    try:
        yield handle
    finally:  # the VMs stop gracefully while the agent still runs
        delete_namespace(kubectl, namespace, timeout=180)


def _names(vms: VMs) -> list[str]:
    return sorted(p["metadata"]["name"] for p in vms.pods())


def test_a_deployment_of_two_vms_runs_with_pod_ips(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    pods = vms.pods()
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2 and all(ip.startswith("10.213.") for ip in ips)
    node = kubectl.json("get", "node", vm_node.name)
    conditions = {c["type"]: c for c in node["status"]["conditions"]}
    assert conditions["Accelerator"]["status"] == "True"
    assert conditions["Accelerator"]["reason"] == "TCG"

    def reasons(*selector: str) -> set[str]:
        events = kubectl.json("get", "events", "-A", "--field-selector", ",".join(selector))
        return {e.get("reason") for e in events["items"]}

    node_events = f"involvedObject.kind=Node,involvedObject.name={vm_node.name}"
    wait_for(lambda: "Accelerator" in reasons(node_events), timeout=30, what="the node Event")
    pod_events = f"involvedObject.namespace={vms.namespace}"
    assert {"Pulling", "Pulled", "Created", "Started"} <= reasons(pod_events)
    assert len(vm_node.qemu_pids()) == 2


def test_kubectl_logs_shows_the_boot_console(vms: VMs, kubectl: Kubectl) -> None:
    for name in _names(vms):
        text = kubectl("-n", vms.namespace, "logs", name).stdout
        assert f"vkubelet-guest: booted hostname={name}" in text
        assert "\r" not in text


def test_exec_reads_the_hostname_the_seed_gave_and_exit_codes_propagate(
    vms: VMs, kubectl: Kubectl
) -> None:
    name = _names(vms)[0]
    out = kubectl("-n", vms.namespace, "exec", name, "--", "cat", "/etc/hostname").stdout
    assert out.strip() == name
    failed = kubectl("-n", vms.namespace, "exec", name, "--", "sh", "-c", "exit 3", check=False)
    assert failed.returncode == 3


def test_exec_with_a_terminal_is_refused_and_attach_reaches_the_serial_console(
    vms: VMs, kubectl: Kubectl
) -> None:
    name = _names(vms)[0]
    exec_tty = shlex.join([*_kubectl_argv(kubectl, vms.namespace), "exec", "-it", name, "--", "sh"])
    attach = shlex.join([*_kubectl_argv(kubectl, vms.namespace), "attach", "-it", name])
    # One terminal for both (tmux's server may still be exiting when a second session starts).
    with terminal_session(f"{exec_tty}; echo EXEC-DONE; {attach}; sleep 60", cols=400) as terminal:
        wait_for(
            lambda: "exec -t is not supported by the VM provider" in terminal.screen(),
            timeout=30,
            what="the refusal of exec -t",
        )

        def echoed() -> bool:
            # kubectl attach prints nothing until the console does: type until it is connected.
            terminal.type("echo ATTACHED-$((6 * 7))")
            return "ATTACHED-42" in terminal.screen()

        wait_for(echoed, timeout=30, interval=2, what="the console's echo")


def test_kubectl_debug_runs_a_command_through_the_guest_agent_and_it_is_the_console(
    vms: VMs, kubectl: Kubectl
) -> None:
    """Without stdin the command runs through the guest agent, its output its log; `debug
    -it` is the serial console (as `attach -it`), ended when the client detaches."""
    name, ns = _names(vms)[0], vms.namespace
    kubectl("-n", ns, "debug", name, "--image=busybox", "-c", "once", "--", "cat", "/etc/hostname")
    ended = wait_for(
        lambda: ephemeral_state(kubectl, ns, name, "once").get("terminated"),
        timeout=60,
        what="the guest agent's command ended",
    )
    assert ended["exitCode"] == 0
    assert kubectl("-n", ns, "logs", name, "-c", "once").stdout.strip() == name
    with interactive_debug(kubectl, ns, name, "console") as terminal:
        assert "running" in ephemeral_state(kubectl, ns, name, "console")
        terminal.type('echo "$((6 * 7))"-debugged')
        wait_for(lambda: "42-debugged" in terminal.screen(), timeout=30, what="the console")
    wait_for(
        lambda: ephemeral_state(kubectl, ns, name, "console").get("terminated"),
        timeout=30,
        what="the console session ended with its client",
    )


def test_disks_volume_files_and_env_reach_the_guest_and_config_map_changes_follow(
    vms: VMs, kubectl: Kubectl
) -> None:
    name = _names(vms)[0]

    def cat(path: str) -> str:
        return str(kubectl("-n", vms.namespace, "exec", name, "--", "cat", path).stdout)

    sizes = kubectl(
        "-n", vms.namespace, "exec", name, "--", "sh", "-c", "cat /sys/block/vd*/size"
    ).stdout.split()
    assert str(2**30 // 512) in sizes  # the root disk, grown by the annotation
    assert str(64 * 2**20 // 512) in sizes  # the emptyDir's blank disk
    assert cat("/etc/app/greeting") == "hello"
    assert "WHO='a VM'" in cat("/etc/vkubelet/env")
    patch = json.dumps({"data": {"greeting": "bye"}})
    kubectl("-n", vms.namespace, "patch", "configmap", "greeting", "-p", patch)
    wait_for(lambda: cat("/etc/app/greeting") == "bye", timeout=90, what="the new greeting")


def _serve(kubectl: Kubectl, namespace: str, name: str) -> None:
    """busybox httpd on port 8080 in the guest (once)."""
    script = (
        "pidof httpd >/dev/null || { mkdir -p /tmp/www && echo hello-from-the-vm > "
        "/tmp/www/index.html && httpd -p 8080 -h /tmp/www; }"
    )
    kubectl("-n", namespace, "exec", name, "--", "sh", "-c", script)


def test_probes_gate_ready_exec_through_the_guest_agent_http_to_the_pod_ip(
    vms: VMs, kubectl: Kubectl
) -> None:
    name = _names(vms)[0]

    def container() -> dict[str, Any]:
        pod = kubectl.json("-n", vms.namespace, "get", "pod", name)
        return dict((pod["status"].get("containerStatuses") or [{}])[0])

    wait_for(lambda: container().get("started"), timeout=60, what="the exec startup probe")
    deadline = time.monotonic() + 8  # several probe periods: a broken gate would open
    while time.monotonic() < deadline:
        assert not container().get("ready")
        time.sleep(1)
    _serve(kubectl, vms.namespace, name)
    wait_for(lambda: container().get("ready"), timeout=60, what=f"{name} Ready once it serves")


def _tcp_probe_failures(kubectl: Kubectl, namespace: str, name: str) -> int:
    """How many times the tcpSocket liveness probe failed (the Events' aggregated counts)."""
    selector = f"involvedObject.name={name},reason=Unhealthy"
    events = kubectl.json("-n", namespace, "get", "events", "--field-selector", selector)
    return sum(
        int(e.get("count") or 1)
        for e in events["items"]
        if str(e.get("message", "")).startswith("Liveness probe failed: dial tcp")
    )


def test_a_tcp_socket_probe_reaches_the_guest_s_port(vms: VMs, kubectl: Kubectl) -> None:
    """Refused by the guest's kernel at the pod IP until a server listens, then a success."""
    pod = next(p for p in vms.pods() if p["metadata"]["name"] == _names(vms)[0])
    name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
    selector = f"involvedObject.name={name},reason=Unhealthy"
    refusal = f"Liveness probe failed: dial tcp {ip}:8080: connect: connection refused"

    def refused() -> bool:
        events = kubectl.json("-n", vms.namespace, "get", "events", "--field-selector", selector)
        return any(e.get("message") == refusal for e in events["items"])

    wait_for(refused, timeout=60, what="a refused tcpSocket probe before the guest served")
    _serve(kubectl, vms.namespace, name)  # idempotent: the readiness test started it already

    def failures() -> int:
        return _tcp_probe_failures(kubectl, vms.namespace, name)

    def unchanged_for(seconds: float) -> bool:
        first = failures()
        time.sleep(seconds)
        return failures() == first

    # The last failures may still be in the agent's event queue: wait until they are written.
    wait_for(lambda: unchanged_for(4), timeout=60, what="the tcpSocket probe failures to stop")
    count = failures()
    deadline = time.monotonic() + 10  # five probe periods: a failing probe would add events
    while time.monotonic() < deadline:
        assert failures() == count
        time.sleep(1)


def test_port_forward_reaches_a_server_in_the_guest(vms: VMs, kubectl: Kubectl) -> None:
    name = _names(vms)[0]
    _serve(kubectl, vms.namespace, name)
    with _port_forward(kubectl, vms.namespace, name, 8080) as local:

        def fetch() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{local}/", timeout=10) as r:
                return str(r.read().decode())

        assert wait_for(fetch, timeout=60, what="the guest's httpd").strip() == "hello-from-the-vm"


def test_kubectl_cp_both_ways_through_the_guest_s_tar(
    vms: VMs, kubectl: Kubectl, tmp_path: Path
) -> None:
    name = _names(vms)[0]
    local = tmp_path / "note.txt"
    local.write_text("copied into a VM\n")
    kubectl("-n", vms.namespace, "cp", str(local), f"{name}:/tmp/note.txt")
    copied = kubectl("-n", vms.namespace, "exec", name, "--", "cat", "/tmp/note.txt").stdout
    assert copied == "copied into a VM\n"
    back = tmp_path / "hostname"
    kubectl("-n", vms.namespace, "cp", f"{name}:/etc/hostname", str(back))
    assert back.read_text().strip() == name


def test_a_guest_poweroff_boots_it_again_with_restart_count_1(vms: VMs, kubectl: Kubectl) -> None:
    name = _names(vms)[1]
    # /sbin/poweroff by path: busybox sh prefers its own applet to PATH, and busybox's poweroff
    # only signals PID 1 (a plain shell in the test guest); the guest's /sbin/poweroff powers off.
    kubectl(
        "-n",
        vms.namespace,
        "exec",
        name,
        "--",
        "sh",
        "-c",
        "(sleep 1; /sbin/poweroff) >/dev/null 2>&1 &",
    )

    def rebooted() -> bool:
        pod = kubectl.json("-n", vms.namespace, "get", "pod", name)
        status = (pod["status"].get("containerStatuses") or [{}])[0]
        return status.get("restartCount") == 1 and bool(status.get("state", {}).get("running"))

    wait_for(rebooted, timeout=BOOT_TIMEOUT, interval=2, what=f"{name} booted again")
    previous = kubectl("-n", vms.namespace, "logs", "-p", name).stdout
    assert "vkubelet-guest: shutdown requested" in previous
    current = kubectl("-n", vms.namespace, "logs", name).stdout
    assert f"booted hostname={name}" in current and "shutdown requested" not in current


def test_stats_summary_and_resource_metrics_report_each_vm_s_qemu(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    path = f"/api/v1/nodes/{vm_node.name}/proxy/stats/summary"
    summary = json.loads(kubectl("get", "--raw", path).stdout)
    pods = {p["podRef"]["name"]: p for p in summary["pods"]}
    assert set(pods) == set(_names(vms))
    for pod in pods.values():
        assert pod["memory"]["workingSetBytes"] > 16 * 2**20  # QEMU and the guest RAM it touched
        assert pod["cpu"]["usageCoreNanoSeconds"] > 0
    metrics = kubectl("get", "--raw", f"/api/v1/nodes/{vm_node.name}/proxy/metrics/resource").stdout
    for name in _names(vms):
        assert (
            f'pod_memory_working_set_bytes{{namespace="{vms.namespace}",pod="{name}"}}' in metrics
        )


def test_a_sigkilled_agent_adopts_the_same_qemu_processes_and_logs_go_on(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    """The same QEMU processes, restart counts and start times, the console log going on; a
    debug container that ran before is not run a second time (its status stays as it was)."""
    names = _names(vms)
    ns = vms.namespace
    kubectl("-n", ns, "debug", names[0], "--image=busybox", "-c", "before", "--", "true")
    wait_for(
        lambda: ephemeral_state(kubectl, ns, names[0], "before").get("terminated"),
        timeout=60,
        what="the debug command ended",
    )

    def debugged() -> dict[str, dict[str, Any]]:
        found = {}
        for pod in vms.pods():
            for status in pod["status"].get("ephemeralContainerStatuses") or []:
                found[f"{pod['metadata']['name']}/{status['name']}"] = status["state"]
        return found

    debug_states = debugged()
    before = vm_node.qemu_pids()
    restarts = {
        p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in vms.pods()
    }
    times = {p["metadata"]["name"]: _start_times(p) for p in vms.pods()}
    for name in names:
        kubectl(
            "-n", vms.namespace, "exec", name, "--", "sh", "-c", "echo MARK-BEFORE >/dev/console"
        )
    wait_for(
        lambda: all("MARK-BEFORE" in kubectl("-n", vms.namespace, "logs", n).stdout for n in names),
        timeout=30,
        what="the first mark in the logs",
    )
    vm_node.agent.stop(signal.SIGKILL)
    assert all(alive(pid) for pid in before.values())
    vm_node.restart_agent()  # appends to the same log: count the second "listening"
    wait_for(lambda: node_ready(kubectl, vm_node.name), timeout=90, what="node Ready again")
    wait_for(
        lambda: vm_node.agent.log().count("listening on port") >= 2,
        timeout=60,
        what="the restarted agent's kubelet API",
    )

    def mark(name: str) -> bool:
        command = "echo MARK-AFTER >/dev/console"
        kubectl("-n", vms.namespace, "exec", name, "--", "sh", "-c", command)
        return True

    def logged(name: str) -> bool:
        return "MARK-AFTER" in kubectl("-n", vms.namespace, "logs", name).stdout

    for name in names:
        wait_for(lambda: mark(name), timeout=60, what=f"exec into {name} after the restart")  # noqa: B023
        wait_for(lambda: logged(name), timeout=30, what="the second mark in the logs")  # noqa: B023
        text = kubectl("-n", vms.namespace, "logs", name).stdout
        assert text.count("MARK-BEFORE") == 1 and text.count("MARK-AFTER") == 1
        assert text.count(f"booted hostname={name}") == 1  # not rebooted
    assert vm_node.qemu_pids() == before
    after = {
        p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in vms.pods()
    }
    assert after == restarts
    # The restarted agent has published its status (it answered the execs): a kubelet keeps
    # the pod's startTime and the running container's startedAt.
    assert {p["metadata"]["name"]: _start_times(p) for p in vms.pods()} == times
    # One added now is handed after those of before (in the pod's order): they were handed too.
    kubectl("-n", ns, "debug", names[0], "--image=busybox", "-c", "after", "--", "true")
    wait_for(
        lambda: ephemeral_state(kubectl, ns, names[0], "after").get("terminated"),
        timeout=60,
        what="a debug command after the restart ended",
    )
    assert {k: v for k, v in debugged().items() if not k.endswith("/after")} == debug_states


def test_a_sigtermed_agent_exits_within_10_s_and_the_next_start_adopts_both_vms(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    """Issue 27: SIGTERM with VMs running hung the agent in asyncio's final cancellation."""
    before = vm_node.qemu_pids()
    assert len(before) == 2
    restarts = _restart_counts(vms)
    stopped, code = _sigterm(vm_node.agent)
    survived = all(alive(pid) for pid in before.values())
    log = vm_node.agent.log()
    vm_node.restart_agent()  # first: the module's later tests and clean-up need an agent
    assert stopped <= 10.0, f"the agent took {stopped:.1f} s to exit after SIGTERM"
    assert code == 0, log[-3000:]
    assert survived
    _assert_adopted(vms, vm_node, kubectl, before, restarts)


def test_the_host_install_s_service_stops_and_starts_again_with_both_vms_adopted(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    """docs/host-install.md: the unit `vkubelet host install` writes, its ExecStart run exactly
    as written, stopped the way its KillMode and KillSignal say (the agent's process only),
    started again. (systemd is not PID 1 here: `systemd-analyze verify` checks the unit in
    tests/unit/agent/test_host_install.py.)"""
    agent_yaml = vm_node.workdir / "agent.yaml"
    node: dict[str, Any] = {"name": vm_node.name, "provider": "vm", "providerConfig": "vm.yaml"}
    node |= {"kubeletPort": 0, "internalIP": vm_node.address}
    settings = {"kubeconfig": str(vm_node.cluster.kubeconfig), "certDir": "pki"}
    agent_yaml.write_text(json.dumps({**settings, "approveOwnCSRs": True, "nodes": [node]}))
    units = vm_node.workdir / "units"
    vkubelet = str(Path(sys.prefix) / "bin" / "vkubelet")
    install = [vkubelet, "host", "install", "--config", str(agent_yaml), "--no-start"]
    subprocess.run([*install, "--unit-dir", str(units)], check=True, timeout=60)
    service = unit_settings((units / "vkubelet.service").read_text(), "Service")
    assert service["KillMode"] == "process"  # the VMs are not the service's to stop
    argv = shlex.split(service["ExecStart"])
    environment = dict(item.split("=", 1) for item in shlex.split(service["Environment"]))
    stop_signal = signal.Signals[service["KillSignal"]]
    before, restarts = vm_node.qemu_pids(), _restart_counts(vms)
    assert len(before) == 2
    vm_node.agent.stop()  # the agent the module started
    for start in ("first", "second"):
        agent = AgentProcess(vm_node.cluster.kubeconfig, argv[2:], vm_node.workdir / "agent.log")
        with agent.log_path.open("ab") as log:
            agent.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **environment}
            )
        vm_node.agent = agent
        _assert_adopted(vms, vm_node, kubectl, before, restarts)
        if start == "first":
            stopped, code = _sigterm(agent, stop_signal)
            assert stopped <= 10.0 and code == 0, agent.log()[-3000:]
            assert all(alive(pid) for pid in before.values())


def _sigterm(agent: AgentProcess, sig: int = signal.SIGTERM) -> tuple[float, int]:
    """Send SIGTERM (or `sig`) and wait for the exit (SIGKILL after 30 s); the seconds it took
    and the exit code."""
    assert agent.proc is not None and agent.running
    started = time.monotonic()
    agent.proc.send_signal(sig)
    try:
        code = agent.proc.wait(30)
    except subprocess.TimeoutExpired:
        agent.proc.kill()
        code = agent.proc.wait()
    return time.monotonic() - started, code


def _restart_counts(vms: VMs) -> dict[str, int]:
    return {
        p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
        for p in vms.pods()
    }


def _assert_adopted(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl, before: dict[str, int], restarts: dict[str, int]
) -> None:
    """The restarted agent serves the same QEMUs: node Ready, both pods Running without a
    restart, `kubectl exec` into each answers."""
    wait_for(lambda: node_ready(kubectl, vm_node.name), timeout=90, what="node Ready again")

    def answers(name: str) -> bool:
        command = ["-n", vms.namespace, "exec", name, "--", "cat", "/etc/hostname"]
        return kubectl(*command, check=False).stdout.strip() == name

    for name in _names(vms):
        wait_for(functools.partial(answers, name), timeout=60, what=f"exec into {name}")
    assert vm_node.qemu_pids() == before
    for pod in vms.pods():
        status = pod["status"]["containerStatuses"][0]
        assert pod["status"]["phase"] == "Running" and "running" in status["state"]
    assert _restart_counts(vms) == restarts


def test_a_chatty_console_stays_within_the_log_rotation_and_logs_f_misses_no_line(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    name = _names(vms)[0]
    uid = kubectl.json("-n", vms.namespace, "get", "pod", name)["metadata"]["uid"]
    logs, console = vm_node.state / "logs" / uid, vm_node.state / "vms" / uid / "m" / "console.log"
    follower = subprocess.Popen(
        [*_kubectl_argv(kubectl, vms.namespace), "logs", "-f", name],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert follower.stdout is not None and follower.stdout.readline()  # connected
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(follower.stdout or ()), daemon=True)
    reader.start()
    count = 2000  # ~420 KB of console, ~500 KB of CRI log: 7 rotations of 64 KiB
    loop = f"i=0; while [ $i -lt {count} ]; do echo chatty $i {'x' * 200}; i=$((i+1)); done"
    loop += "; echo chatty-end"
    kubectl("-n", vms.namespace, "exec", name, "--", "sh", "-c", f"({loop}) >/dev/console 2>&1 &")
    largest = {"logs": 0, "console": 0}

    def ended() -> bool:
        files = [f for f in logs.rglob("*") if f.is_file()]
        with contextlib.suppress(FileNotFoundError):  # (a file rotated away meanwhile)
            largest["logs"] = max(largest["logs"], sum(f.stat().st_size for f in files))
        largest["console"] = max(largest["console"], console.stat().st_blocks * 512)
        return any("chatty-end" in line for line in lines)

    wait_for(ended, timeout=300, interval=0.05, what="the guest's last chatty line")
    try:
        assert largest["logs"] <= LOG_MAX_SIZE * LOG_MAX_FILES, largest
        assert largest["console"] <= 256 * 1024, largest  # copied bytes are given back
        assert console.stat().st_size > count * 200  # (QEMU wrote them all)
        # `kubectl logs -f` went on across every rotation: each line once, in order.
        # (The first may follow the shell's prompt on the console, without a newline.)
        chatty = [m[1] for line in lines if (m := re.search(r"chatty (\d+) x", line))]
        assert chatty == [str(i) for i in range(count)]
        assert len(list(logs.rglob("*.log.*"))) == LOG_MAX_FILES - 1
        current = kubectl("-n", vms.namespace, "logs", name).stdout  # the current file's
        assert "chatty-end" in current and f"chatty {count - 1} " in current
        assert "chatty 0 " not in current
    finally:
        follower.kill()
        follower.wait()


def _start_times(pod: dict[str, Any]) -> tuple[str, str]:
    """The pod's startTime and its running container's startedAt."""
    running = pod["status"]["containerStatuses"][0]["state"]["running"]
    return pod["status"]["startTime"], running["startedAt"]


def test_scale_to_zero_powers_the_guests_off_gracefully(
    vms: VMs, vm_node: VMNode, kubectl: Kubectl
) -> None:
    names = _names(vms)
    pids = vm_node.qemu_pids()
    followers = [
        subprocess.Popen(
            [*_kubectl_argv(kubectl, vms.namespace), "logs", "-f", name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in names
    ]
    for follower in followers:  # connected once the console's earlier lines arrive
        assert follower.stdout is not None and follower.stdout.readline()
    kubectl("-n", vms.namespace, "scale", "deployment/vm", "--replicas=0")
    wait_for(lambda: not vms.pods(), timeout=180, interval=2, what="both VM pods gone")
    for follower in followers:
        out, _ = follower.communicate(timeout=60)
        assert "vkubelet-guest: shutdown requested" in out
    wait_for(lambda: not any(alive(pid) for pid in pids.values()), timeout=30, what="QEMU gone")


def test_an_image_without_a_rule_waits_in_image_pull_back_off(
    vm_node: VMNode, kubectl: Kubectl, vms: VMs
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "nope"},
        "spec": {
            "nodeName": vm_node.name,
            "tolerations": [TOLERATION],
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/nope"}],
        },
    }
    kubectl("-n", vms.namespace, "apply", "-f", "-", input=json.dumps(pod))

    def waiting_reason() -> str:
        status = kubectl.json("-n", vms.namespace, "get", "pod", "nope")["status"]
        waiting = (status.get("containerStatuses") or [{}])[0].get("state", {}).get("waiting")
        return str(waiting.get("reason")) if waiting else ""

    wait_for(lambda: waiting_reason() == "ImagePullBackOff", timeout=60, what="ImagePullBackOff")
    status = kubectl.json("-n", vms.namespace, "get", "pod", "nope")["status"]
    assert "no translation rule" in status["containerStatuses"][0]["state"]["waiting"]["message"]
    kubectl("-n", vms.namespace, "delete", "pod", "nope", "--wait=true", timeout=60)


@contextlib.contextmanager
def _port_forward(kubectl: Kubectl, namespace: str, pod: str, remote: int) -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        local: int = s.getsockname()[1]
    proc = subprocess.Popen(
        [*_kubectl_argv(kubectl, namespace), "port-forward", pod, f"{local}:{remote}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield local
    finally:
        proc.terminate()
        proc.wait(10)


def _kubectl_argv(kubectl: Kubectl, namespace: str) -> list[str]:
    return [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "-n", namespace]


def test_a_translation_rule_added_to_the_config_map_lets_a_waiting_pod_boot(
    vm_node: VMNode, kubectl: Kubectl, vms: VMs, vm_guest_image: Path
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "from-cm"},
        "spec": {
            "nodeName": vm_node.name,
            "tolerations": [TOLERATION],
            "containers": [{"name": "vm", "image": "vm.vkubelet.io/from-config-map"}],
        },
    }
    kubectl("-n", vms.namespace, "apply", "-f", "-", input=json.dumps(pod))

    def state() -> dict[str, Any]:
        status = kubectl.json("-n", vms.namespace, "get", "pod", "from-cm")["status"]
        return dict((status.get("containerStatuses") or [{}])[0].get("state") or {})

    def reason() -> str:
        return str((state().get("waiting") or {}).get("reason"))

    wait_for(lambda: reason() == "ImagePullBackOff", timeout=60, what="ImagePullBackOff")
    rules = {"translations": [{"name": "from-config-map", "url": vm_guest_image.as_uri()}]}
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{vm_node.name}-images", "namespace": "default"},
        "data": {"rules.yaml": json.dumps(rules)},
    }
    kubectl("apply", "-f", "-", input=json.dumps(config_map))
    wait_for(lambda: state().get("running"), timeout=180, interval=2, what="the VM running")
    kubectl("-n", vms.namespace, "delete", "pod", "from-cm", "--wait=true", timeout=120)


def test_a_vm_larger_than_the_node_is_refused_naming_the_field(
    vm_node: VMNode, kubectl: Kubectl, vms: VMs
) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "huge"},
        "spec": {
            "nodeName": vm_node.name,
            "tolerations": [TOLERATION],
            "containers": [
                {
                    "name": "vm",
                    "image": "vm.vkubelet.io/tiny",
                    "resources": {"limits": {"memory": "4Ti"}},
                }
            ],
        },
    }
    kubectl("-n", vms.namespace, "apply", "-f", "-", input=json.dumps(pod))

    def refused() -> dict[str, Any] | None:
        status: dict[str, Any] = kubectl.json("-n", vms.namespace, "get", "pod", "huge")["status"]
        return status if status.get("reason") == "InvalidVMSpec" else None

    status = wait_for(refused, timeout=60, what="the refusal")
    assert "spec.containers[0].resources.limits.memory" in status["message"]
    kubectl("-n", vms.namespace, "delete", "pod", "huge", "--wait=false")
