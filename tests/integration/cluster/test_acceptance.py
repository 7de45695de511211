"""The cluster provider's acceptance (issue 10), driven as a user drives it: `vkubelet run
--provider cluster --provider-config lower.yaml`, real kubectl on both clusters, the lower
cluster's nodes vkubelet mock nodes of different sizes (the session's `lower_cluster`).

- a Deployment of 6 replicas with a ConfigMap env reference, a Secret volume and a Service: spread
  over the lower nodes by the lower scheduler, Running upstairs with the lower IPs, reachable with
  `kubectl logs/exec/cp/port-forward/top`; no Secret value below; a ConfigMap edit reaches the
  lower copy; scaled to 0, no stamped object is left;
- the lower apiserver stopped for 90 s: the virtual node NotReady with the reason within the lease
  duration, no pod deleted or duplicated on either side, Ready again;
- two agents of two upper clusters sharing the lower cluster through create/delete churn: neither
  touches the other's pods or dependency copies, nor the user's own lower objects.

The agent killed with SIGKILL and restarted is in test_e2e.py.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shutil
import socket
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from vkubelet.devcluster import Cluster
from vkubelet.testing import (
    AgentProcess,
    Kubectl,
    create_namespace,
    ephemeral_state,
    interactive_debug,
    node_ready,
    port_forward,
    start_agent,
    wait_for,
)

from ..clusters import TOLERATION, LowerCluster, restart_clients_of_the_apiserver

JSON = dict[str, Any]
OWNER = "vkubelet.io/owner"
UPPER_CLUSTER = "vkubelet.io/upper-cluster"
# Every kind the provider may create below, for "nothing stamped is left".
STAMPED_KINDS = (
    "pods",
    "configmaps",
    "secrets",
    "serviceaccounts",
    "persistentvolumeclaims",
    "services",
    "endpointslices.discovery.k8s.io",
)
OUTAGE_SECONDS = 90  # the issue's figure
LEASE_SECONDS = 40  # the node lease duration: NotReady must show within it
# 40 s in the suite; the issue's hour: VKUBELET_CHURN_SECONDS=3600 pytest -k share_the_lower
CHURN_SECONDS = float(os.environ.get("VKUBELET_CHURN_SECONDS", "40"))


@contextlib.contextmanager
def echo_server() -> Iterator[int]:
    """A TCP echo server on 127.0.0.1 (a thread: test scaffolding), yielding its port."""

    class Echo(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            for line in self.rfile:
                self.wfile.write(line)

    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Echo) as server:
        server.daemon_threads = True
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield server.server_address[1]
        finally:
            server.shutdown()


@dataclass
class VirtualNode:
    name: str
    cluster_id: str
    agent: AgentProcess


@contextlib.contextmanager
def virtual_node(
    upper: Cluster,
    lower: LowerCluster,
    workdir: Path,
    *,
    name: str | None = None,
    cluster_id: str | None = None,
    **options: Any,
) -> Iterator[VirtualNode]:
    """`vkubelet run --provider cluster --provider-config lower.yaml` for `upper`, until Ready
    with a capacity; stopped and its Node deleted afterwards."""
    name = name or f"vk-acc-{uuid.uuid4().hex[:6]}"
    cluster_id = cluster_id or f"acc-{uuid.uuid4().hex[:6]}"
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "lower.yaml"
    config.write_text(
        yaml.safe_dump(
            {"kubeconfig": str(lower.kubeconfig), "upperClusterID": cluster_id, **options}
        )
    )
    kubectl = Kubectl(upper.kubeconfig)
    agent = start_agent(
        upper, workdir, provider="cluster", config=config, name=name, address="127.0.0.1"
    )
    try:
        wait_for(lambda: node_ready(kubectl, name), what=f"node {name} Ready")
        wait_for(
            lambda: int(kubectl.json("get", "node", name)["status"]["allocatable"].get("pods", 0)),
            what="the virtual node's capacity from the lower cluster",
        )
        yield VirtualNode(name, cluster_id, agent)
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")
        print(f"--- agent {name} ---\n{agent.log()[-4000:]}")


@contextlib.contextmanager
def namespace_on_both(kubectl: Kubectl, lower: LowerCluster, prefix: str) -> Iterator[str]:
    namespace = create_namespace(kubectl, f"{prefix}-{uuid.uuid4().hex[:6]}")
    try:
        yield namespace
    finally:
        kubectl("delete", "namespace", namespace, "--wait=false")
        lower.kubectl("delete", "namespace", namespace, "--wait=false", "--ignore-not-found")


def running_pods(kubectl: Kubectl, namespace: str, count: int) -> list[JSON] | None:
    """The namespace's pods once exactly `count` are Running with an IP."""
    pods: list[JSON] = kubectl.json("-n", namespace, "get", "pods")["items"]
    ok = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
    return pods if len(pods) == len(ok) == count else None


def uids(kubectl: Kubectl, namespace: str) -> dict[str, str]:
    items = kubectl.json("-n", namespace, "get", "pods")["items"]
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in items}


def stamped_left(lower: LowerCluster, namespace: str) -> list[str]:
    found = lower.kubectl.json("-n", namespace, "get", ",".join(STAMPED_KINDS), "-l", OWNER)
    return [f"{o['kind']}/{o['metadata']['name']}" for o in found["items"]]


def web_deployment(node: str, replicas: int) -> JSON:
    """Pinned to the virtual node; env from a ConfigMap key, a Secret volume; the mock prints
    the container's environment to its log."""
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": "web"}},
            "template": {
                "metadata": {
                    "labels": {"app": "web"},
                    "annotations": {"mock.vkubelet.io/print-env": "true"},
                },
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "tolerations": [TOLERATION],
                    "containers": [
                        {
                            "name": "app",
                            "image": "registry.example/web:1",
                            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
                            "env": [
                                {
                                    "name": "COLOR",
                                    "valueFrom": {
                                        "configMapKeyRef": {"name": "cfg", "key": "COLOR"}
                                    },
                                }
                            ],
                            "ports": [{"containerPort": 8080}],
                            "volumeMounts": [{"name": "creds", "mountPath": "/creds"}],
                        }
                    ],
                    "volumes": [{"name": "creds", "secret": {"secretName": "creds"}}],
                },
            },
        },
    }


SERVICE = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "web"},
    "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
}


def top_pods(kubectl: Kubectl, namespace: str) -> dict[str, tuple[str, str]] | None:
    """`kubectl top pod`'s figures by pod, once metrics-server has them (two scrapes)."""
    result = kubectl("-n", namespace, "top", "pod", "--no-headers", check=False)
    if result.returncode != 0:
        return None
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()]
    return {name: (cpu, memory) for name, cpu, memory in rows}


def test_a_deployment_of_six_replicas_runs_spread_over_the_lower_nodes_and_kubectl_reaches_it(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> None:
    lk = lower_cluster.kubectl
    secret_value = f"s3cret-{uuid.uuid4().hex}"
    with (
        virtual_node(kube_cluster, lower_cluster, tmp_path / "agent") as node,
        namespace_on_both(kubectl, lower_cluster, "acc") as namespace,
    ):
        kubectl("-n", namespace, "create", "configmap", "cfg", "--from-literal=COLOR=blue")
        kubectl(
            "-n",
            namespace,
            "create",
            "secret",
            "generic",
            "creds",
            f"--from-literal=pw={secret_value}",
        )
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(SERVICE))
        deployment = web_deployment(node.name, 6)
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(deployment))
        pods = wait_for(
            lambda: running_pods(kubectl, namespace, 6), timeout=120, what="6 upper pods Running"
        )

        # Below: one lower pod per upper pod, placed by the lower scheduler on its mock nodes
        # (more than one of them), with the same IP; no Secret value anywhere in its spec.
        below = {p["metadata"]["name"]: p for p in lk.json("-n", namespace, "get", "pods")["items"]}
        assert set(below) == {p["metadata"]["name"] for p in pods}
        lower_nodes = {n.name for n in lower_cluster.nodes.values()}
        placed: dict[str, int] = {}
        for pod in pods:
            lower = below[pod["metadata"]["name"]]
            assert pod["spec"]["nodeName"] == node.name
            assert lower["spec"]["nodeName"] in lower_nodes
            placed[lower["spec"]["nodeName"]] = placed.get(lower["spec"]["nodeName"], 0) + 1
            assert pod["status"]["podIP"] == lower["status"]["podIP"]
            assert pod["status"]["podIPs"] == lower["status"]["podIPs"]
            text = json.dumps(lower)
            assert secret_value not in text
            assert base64.b64encode(secret_value.encode()).decode() not in text
        print(f"lower placement: {placed}")
        assert len(placed) >= 2, f"the lower scheduler put all 6 pods on one node: {placed}"

        # The upper Service's endpoints are the lower pod IPs (a flat network makes them work).
        # (The upper endpointslice controller batches its updates: wait for it to catch up.)
        def endpoint_addresses() -> set[str]:
            slices = kubectl.json(
                "-n", namespace, "get", "endpointslices", "-l", "kubernetes.io/service-name=web"
            )["items"]
            return {a for s in slices for e in s.get("endpoints") or [] for a in e["addresses"]}

        pod_ips = {p["status"]["podIP"] for p in pods}
        wait_for(
            lambda: endpoint_addresses() == pod_ips,
            timeout=60,
            interval=1,
            what=f"the upper Service's endpoints to be the lower pod IPs {sorted(pod_ips)}",
        )

        # kubectl verbs on the upper pods reach the lower ones.
        first = sorted(p["metadata"]["name"] for p in pods)[0]
        assert "COLOR=blue" in kubectl("-n", namespace, "logs", first).stdout
        exec_out = kubectl("-n", namespace, "exec", first, "--", "echo", "hello").stdout
        assert exec_out.strip() == "hello"
        failed = kubectl("-n", namespace, "exec", first, "--", "sh", "-c", "exit 3", check=False)
        assert failed.returncode == 3
        local_file = tmp_path / "note.txt"
        local_file.write_text("carried down\n")
        kubectl("-n", namespace, "cp", str(local_file), f"{first}:/tmp/note.txt")
        copied = kubectl("-n", namespace, "exec", first, "--", "cat", "/tmp/note.txt").stdout
        assert copied == "carried down\n"
        # port-forward: upper apiserver -> agent -> lower apiserver -> lower mock node, whose
        # pods "are" this machine (it dials 127.0.0.1:<port>).
        scoped = tmp_path / "upper-in-namespace.kubeconfig"
        shutil.copy(kubectl.kubeconfig, scoped)
        in_namespace = Kubectl(scoped)
        in_namespace("config", "set-context", "--current", f"--namespace={namespace}")
        with (
            echo_server() as port,
            port_forward(in_namespace, first, port) as local,
            socket.create_connection(("127.0.0.1", local), timeout=10) as conn,
        ):
            conn.sendall(b"ping through two clusters\n")
            assert conn.makefile("rb").readline() == b"ping through two clusters\n"
        # `kubectl debug -it`: the ephemeral container goes to the lower pod's subresource, the
        # lower kubelet (a mock node: its shell) runs it, its status comes up, attach goes down.
        with interactive_debug(kubectl, namespace, first, "dbg") as terminal:
            assert "running" in ephemeral_state(kubectl, namespace, first, "dbg")
            terminal.type('echo "$HOSTNAME"-below')
            wait_for(lambda: f"{first}-below" in terminal.screen(), timeout=30, what="output")
            terminal.type("exit 4")
            ended = wait_for(
                lambda: ephemeral_state(kubectl, namespace, first, "dbg").get("terminated"),
                timeout=30,
                what="the debug container terminated upstairs",
            )
        assert ended["exitCode"] == 4
        lower_debug = lk.json("-n", namespace, "get", "pod", first)["spec"]["ephemeralContainers"]
        assert [c["name"] for c in lower_debug] == ["dbg"]
        # `kubectl top pod`: the upper metrics-server scrapes the virtual node, which reads the
        # lower kubelets' figures through the lower apiserver.
        figures = wait_for(
            lambda: (lambda t: t if t and set(t) == set(below) else None)(
                top_pods(kubectl, namespace)
            ),
            timeout=90,
            interval=2,
            what="kubectl top pod listing the 6 pods",
        )
        for cpu, memory in figures.values():
            assert re.fullmatch(r"\d+m", cpu) and re.fullmatch(r"\d+Mi", memory)
            assert int(memory[:-2]) > 0

        # Editing the ConfigMap reaches the lower copy.
        kubectl("-n", namespace, "patch", "configmap", "cfg", "-p", '{"data":{"COLOR":"red"}}')
        wait_for(
            lambda: any(
                cm["data"].get("COLOR") == "red"
                for cm in lk.json("-n", namespace, "get", "configmaps", "-l", OWNER)["items"]
            ),
            what="the ConfigMap edit in the lower copy",
        )

        # Scaled to zero, nothing stamped is left below.
        kubectl("-n", namespace, "scale", "deployment", "web", "--replicas=0")
        wait_for(
            lambda: not kubectl.json("-n", namespace, "get", "pods")["items"],
            timeout=120,
            what="the upper pods gone",
        )
        wait_for(
            lambda: not stamped_left(lower_cluster, namespace),
            timeout=60,
            what="no stamped object left below",
        )


def test_the_lower_apiserver_down_for_90_s_makes_the_node_not_ready_and_deletes_no_pod(
    kube_cluster: Cluster, kubectl: Kubectl, lower_cluster: LowerCluster, tmp_path: Path
) -> None:
    lk = lower_cluster.kubectl
    reused = bool(os.environ.get("VKUBELET_LOWER_CLUSTER"))
    with (
        # A short pod resync, so that the windows below span several full re-lists.
        virtual_node(
            kube_cluster, lower_cluster, tmp_path / "agent", resync={"pods": 5, "nodes": 5}
        ) as node,
        namespace_on_both(kubectl, lower_cluster, "outage") as namespace,
    ):
        kubectl("-n", namespace, "create", "configmap", "cfg", "--from-literal=COLOR=blue")
        kubectl("-n", namespace, "create", "secret", "generic", "creds", "--from-literal=pw=x")
        kubectl("-n", namespace, "apply", "-f", "-", input=json.dumps(web_deployment(node.name, 3)))
        wait_for(
            lambda: running_pods(kubectl, namespace, 3), timeout=120, what="3 upper pods Running"
        )
        upper_before, lower_before = uids(kubectl, namespace), uids(lk, namespace)
        assert set(upper_before) == set(lower_before)

        def upper_unchanged() -> None:
            pods = kubectl.json("-n", namespace, "get", "pods")["items"]
            assert {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods} == upper_before
            for pod in pods:
                assert pod["status"].get("phase") == "Running", pod["status"]
                assert not pod["metadata"].get("deletionTimestamp"), pod["metadata"]

        def not_ready_reason() -> str | None:
            conditions = kubectl.json("get", "node", node.name)["status"]["conditions"]
            [ready] = [c for c in conditions if c["type"] == "Ready"]
            return ready.get("reason") if ready["status"] == "False" else None

        stopped = time.monotonic()
        lower_cluster.cluster.stop_component("kube-apiserver")
        try:
            reason = wait_for(
                not_ready_reason, timeout=LEASE_SECONDS, interval=1, what="the node NotReady"
            )
            print(f"NotReady ({reason}) {time.monotonic() - stopped:.1f} s after the stop")
            assert reason == "LowerClusterUnreachable"
            # For the rest of the outage, no upper pod is failed, deleted or replaced.
            while time.monotonic() - stopped < OUTAGE_SECONDS:
                upper_unchanged()
                time.sleep(3)
        finally:
            lower_cluster.cluster.start_component("kube-apiserver", tie_to_parent=not reused)
            # The lower scheduler and controller-manager, not the agent under test: theirs is
            # the client-go back-off that kept the next tests waiting up to a minute.
            restart_clients_of_the_apiserver(lower_cluster.cluster, tie_to_parent=not reused)
        restarted = time.monotonic()
        wait_for(lambda: node_ready(kubectl, node.name), timeout=60, what="the node Ready again")
        print(f"Ready again {time.monotonic() - restarted:.1f} s after the restart")
        # Over a window spanning several pod resyncs: the very same pods on both sides, no
        # duplicate, none deleted, all Running.
        window = time.monotonic() + 12
        while time.monotonic() < window:
            upper_unchanged()
            assert uids(lk, namespace) == lower_before
            time.sleep(2)
        wait_for(lower_cluster.all_ready, timeout=60, what="the lower mock nodes Ready again")
        # Leave the shared lower cluster only once a new namespace works again.
        canary = create_namespace(lk, f"canary-{uuid.uuid4().hex[:6]}", timeout=120)
        lk("delete", "namespace", canary, "--wait=false")


@pytest.fixture
def second_upper(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Another upper cluster, for this test only."""
    cluster = Cluster(f"upper-b-{os.getpid()}", root=tmp_path_factory.mktemp("upper-b"))
    cluster.up(
        progress=lambda m: print(f"[upper-b] {m}", file=sys.stderr, flush=True), tie_to_parent=True
    )
    try:
        yield cluster
    finally:
        cluster.down()


def churn_pod(name: str, node: str) -> JSON:
    """A bare pod bound to the virtual node, using its cluster's ConfigMap and Secret."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "annotations": {"mock.vkubelet.io/print-env": "true"}},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "app",
                    "image": "registry.example/app:1",
                    "envFrom": [{"configMapRef": {"name": "app-config"}}],
                    "volumeMounts": [{"name": "s", "mountPath": "/s"}],
                }
            ],
            "volumes": [{"name": "s", "secret": {"secretName": "app-secret"}}],
        },
    }


def test_two_agents_of_two_upper_clusters_share_the_lower_cluster_through_churn(
    kube_cluster: Cluster,
    kubectl: Kubectl,
    second_upper: Cluster,
    lower_cluster: LowerCluster,
    tmp_path: Path,
) -> None:
    """Both upper clusters use the same namespace, ConfigMap and Secret names and the same
    virtual node name (only `upperClusterID` tells them apart), and the user has a pod and a
    ConfigMap of that name in the lower namespace. During the churn, every lower pod belongs to
    the cluster that has it, the long-lived pods and every dependency copy stay the same
    objects (UID and resourceVersion), and the user's objects are untouched."""
    lk = lower_cluster.kubectl
    uppers = {"a": kubectl, "b": Kubectl(second_upper.kubeconfig)}
    namespace = f"shared-{uuid.uuid4().hex[:6]}"
    node_name = f"vk-shared-{uuid.uuid4().hex[:6]}"
    ids = {side: f"upper-{side}-{uuid.uuid4().hex[:6]}" for side in uppers}
    create_namespace(lk, namespace)
    lk("-n", namespace, "create", "configmap", "app-config", "--from-literal=VALUE=user")
    lower_node = next(iter(lower_cluster.nodes.values())).name
    user_pod = churn_pod("user-pod", lower_node)
    user_pod["spec"]["containers"][0]["envFrom"] = []
    user_pod["spec"]["containers"][0]["volumeMounts"] = []
    user_pod["spec"]["volumes"] = []
    lk("-n", namespace, "apply", "-f", "-", input=json.dumps(user_pod))
    with contextlib.ExitStack() as stack:
        for side, upper in uppers.items():
            cluster = kube_cluster if side == "a" else second_upper
            stack.enter_context(
                virtual_node(
                    cluster,
                    lower_cluster,
                    tmp_path / side,
                    name=node_name,
                    cluster_id=ids[side],
                    resync={"pods": 10, "dependencies": 10},
                )
            )
            create_namespace(upper, namespace)
            stack.callback(upper, "delete", "namespace", namespace, "--wait=false")
            upper(
                "-n", namespace, "create", "configmap", "app-config", f"--from-literal=VALUE={side}"
            )
            upper(
                "-n", namespace, "create", "secret", "generic", "app-secret", "--from-literal=k=v"
            )
            upper(
                "-n",
                namespace,
                "apply",
                "-f",
                "-",
                input=json.dumps(churn_pod(f"{side}-steady", node_name)),
            )
        stack.callback(lk, "delete", "namespace", namespace, "--wait=false")

        def lower_objects() -> dict[str, JSON]:
            found = lk.json("-n", namespace, "get", "pods,configmaps,secrets")["items"]
            return {f"{o['kind']}/{o['metadata']['name']}": o for o in found}

        def side_of(obj: JSON) -> str | None:
            cluster_id = (obj["metadata"].get("annotations") or {}).get(UPPER_CLUSTER)
            return next((s for s, i in ids.items() if i == cluster_id), None)

        def steady() -> dict[str, JSON] | None:
            objects = lower_objects()
            pods = [objects.get(f"Pod/{side}-steady") for side in uppers]
            if not all(p and p["status"].get("phase") == "Running" for p in pods):
                return None
            copies = [o for o in objects.values() if side_of(o) and o["kind"] != "Pod"]
            return objects if len(copies) == 4 else None  # a ConfigMap and a Secret each

        baseline = wait_for(steady, timeout=90, what="both steady pods Running with their copies")
        # What must not change: both steady pods, the four copies, the user's pod and ConfigMap.
        fixed = {
            key: (o["metadata"]["uid"], o["metadata"]["resourceVersion"])
            for key, o in baseline.items()
            if o["kind"] != "Pod" or key in ("Pod/a-steady", "Pod/b-steady")
        }
        user_pod_uid = baseline["Pod/user-pod"]["metadata"]["uid"]

        def check_isolation() -> dict[str, JSON]:
            objects = lower_objects()
            for key, (uid, version) in fixed.items():
                assert key in objects, f"{key} was deleted"
                meta = objects[key]["metadata"]
                assert meta["uid"] == uid, f"{key} was re-created"
                if key.startswith(("ConfigMap/", "Secret/")):
                    assert meta["resourceVersion"] == version, f"{key} was modified"
            assert objects["Pod/user-pod"]["metadata"]["uid"] == user_pod_uid
            assert OWNER not in (objects["Pod/user-pod"]["metadata"].get("labels") or {})
            for key, obj in objects.items():
                name = obj["metadata"]["name"]
                if obj["kind"] == "Pod" and name != "user-pod":
                    assert side_of(obj) == name[0], f"{key} carries the wrong owner"
            return objects

        # The churn: each side creates a pod and deletes the one it created three rounds ago.
        started, round_ = time.monotonic(), 0
        alive: dict[str, list[str]] = {side: [] for side in uppers}
        while time.monotonic() - started < CHURN_SECONDS:
            for side, upper in uppers.items():
                name = f"{side}-churn-{round_}"
                upper(
                    "-n",
                    namespace,
                    "apply",
                    "-f",
                    "-",
                    input=json.dumps(churn_pod(name, node_name)),
                )
                alive[side].append(name)
                if len(alive[side]) > 3:
                    upper("-n", namespace, "delete", "pod", alive[side].pop(0), "--wait=false")
            check_isolation()
            round_ += 1
        print(f"churn: {round_} rounds in {CHURN_SECONDS} s, {2 * round_} pods created")

        # Settled: below are exactly the pods alive upstairs, plus the user's.
        expected = {"user-pod", "a-steady", "b-steady", *alive["a"], *alive["b"]}

        def settled() -> bool:
            objects = check_isolation()
            pods = {o["metadata"]["name"] for o in objects.values() if o["kind"] == "Pod"}
            return pods == expected

        wait_for(settled, timeout=90, what="the lower pods matching the upper ones")
        for side, upper in uppers.items():
            names = [f"{side}-steady", *alive[side]]

            def all_running(upper: Kubectl = upper, names: list[str] = names) -> bool:
                pods = upper.json("-n", namespace, "get", "pods")["items"]
                phases = {p["metadata"]["name"]: p["status"].get("phase") for p in pods}
                return all(phases.get(n) == "Running" for n in names)

            wait_for(all_running, what=f"{side}: its pods Running")
            # Each side's pods read their own cluster's ConfigMap.
            assert f"VALUE={side}" in upper("-n", namespace, "logs", f"{side}-steady").stdout

        # Side a leaves: its pods and copies go, b's and the user's stay.
        kubectl("-n", namespace, "delete", "pods", "--all", "--wait=false")

        def a_gone() -> bool:
            return not any(side_of(o) == "a" for o in lower_objects().values())

        wait_for(a_gone, timeout=90, what="side a's lower pods and copies gone")
        fixed = {k: v for k, v in fixed.items() if side_of(baseline[k]) != "a"}
        objects = check_isolation()
        assert {n for n in objects if n.startswith("Pod/")} == {
            "Pod/user-pod",
            "Pod/b-steady",
            *(f"Pod/{n}" for n in alive["b"]),
        }
