"""The documented example providers (examples/local_provider.py, and the 50-line
examples/tiny_provider.py of docs/providers.md), on the SDK's helpers, against the real control
plane: a Deployment becomes Available, a Job Complete, restarts show in the status, and
`kubectl logs` (--tail, --since, -f, -p) reads the CRI log files they write."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import Kubectl, ephemeral_state, node_ready, start_agent, wait_for

EXAMPLES = Path(__file__).parents[2] / "examples"
PY = sys.executable  # the example runs commands as they are, without a PATH


@pytest.fixture(scope="module", params=["local", "tiny"])
def node(
    request: pytest.FixtureRequest,
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """A node run by an example provider, loaded the way its docstring says: `local` by an entry
    point (here a throw-away distribution on the agent's PYTHONPATH), `tiny` by its file path.
    One per provider for the module: each test uses pods of its own names."""
    tmp_path = tmp_path_factory.mktemp(request.param)
    dist = tmp_path / "site" / "local_provider_example-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: local-provider-example\n")
    (dist / "entry_points.txt").write_text("[vkubelet.providers]\nlocal = local_provider:create\n")
    name = f"vk-local-{uuid.uuid4().hex[:6]}"
    config = tmp_path / "none.json"
    config.write_text("{}")
    provider = "local" if request.param == "local" else str(EXAMPLES / "tiny_provider.py")
    with pytest.MonkeyPatch.context() as env:  # the agent inherits it
        # After the caller's own (a worktree's src before the installed one).
        inherited = os.environ.get("PYTHONPATH", "")
        env.setenv("PYTHONPATH", f"{inherited}:{tmp_path / 'site'}:{EXAMPLES}".lstrip(":"))
        agent = start_agent(
            kube_cluster, tmp_path, provider=provider, config=config, name=name, address="127.0.0.1"
        )
    try:
        wait_for(lambda: node_ready(kubectl, name), timeout=60, what=f"node {name} Ready")
        wait_for(lambda: "listening on port" in agent.log(), timeout=60, what="kubelet API")
        yield name
    finally:
        agent.stop()
        kubectl("delete", "node", name, "--ignore-not-found", "--wait=false")


def pod_spec(node: str, code: str, policy: str = "Always") -> dict[str, Any]:
    return {
        "nodeName": node,
        "restartPolicy": policy,
        "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "local", "command": [PY, "-u", "-c", code]}],
    }


def test_a_deployment_becomes_available(node: str, kubectl: Kubectl) -> None:
    name = f"web-{uuid.uuid4().hex[:6]}"
    labels = {"app": name}
    kubectl.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": pod_spec(node, "import time; time.sleep(600)"),
                },
            },
        }
    )
    try:
        kubectl("wait", f"deployment/{name}", "--for=condition=Available", "--timeout=90s")
        pods = kubectl.json("get", "pods", "-l", f"app={name}")["items"]
        assert len(pods) == 2
        for pod in pods:
            ready = {c["type"]: c["status"] for c in pod["status"]["conditions"]}
            assert ready["Ready"] == "True" and ready["Initialized"] == "True"
    finally:
        kubectl("delete", "deployment", name, "--wait=false")


def test_a_job_completes_and_its_log_is_readable(node: str, kubectl: Kubectl) -> None:
    name = f"job-{uuid.uuid4().hex[:6]}"
    kubectl.apply(
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": name},
            "spec": {
                "backoffLimit": 0,
                "template": {"spec": pod_spec(node, "print('job done')", "Never")},
            },
        }
    )
    try:
        kubectl("wait", f"job/{name}", "--for=condition=Complete", "--timeout=90s")
        assert kubectl("logs", f"job/{name}").stdout == "job done\n"
        [pod] = kubectl.json("get", "pods", "-l", f"job-name={name}")["items"]
        assert pod["status"]["phase"] == "Succeeded"
        terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
        assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed")
    finally:
        kubectl("delete", "job", name, "--wait=false", "--cascade=foreground")


def test_a_failing_container_restarts_with_back_off_and_keeps_its_previous_log(
    node: str, kubectl: Kubectl
) -> None:
    name = f"crash-{uuid.uuid4().hex[:6]}"
    code = "import time; print('one'); print('two'); time.sleep(1); raise SystemExit(3)"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": pod_spec(node, code),
        }
    )
    try:

        def status() -> dict[str, Any]:
            return kubectl.json("get", "pod", name)["status"]["containerStatuses"][0]  # type: ignore[no-any-return]

        wait_for(lambda: status().get("restartCount", 0) >= 2, timeout=60, what="two restarts")
        found = status()
        assert found["lastState"]["terminated"]["exitCode"] == 3
        assert found["lastState"]["terminated"]["reason"] == "Error"
        wait_for(
            lambda: status()["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff",
            timeout=30,
            what="CrashLoopBackOff",
        )
        assert status()["state"]["waiting"]["message"].startswith("back-off ")
        assert kubectl("get", "pod", name, "-o", "jsonpath={.status.phase}").stdout == "Running"
        assert kubectl("logs", name, "-p").stdout == "one\ntwo\n"
        assert kubectl("logs", name, "-p", "--tail=1").stdout == "two\n"
        stamped = kubectl("logs", name, "-p", "--timestamps").stdout.splitlines()
        assert stamped[0].endswith("Z one") and stamped[0][:4].isdigit()
    finally:
        kubectl("delete", "pod", name, "--wait=false")


def test_logs_follow_a_running_container_and_since_filters(node: str, kubectl: Kubectl) -> None:
    name = f"ticker-{uuid.uuid4().hex[:6]}"
    code = "import time\nfor i in range(600): print('tick', i); time.sleep(0.5)"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": pod_spec(node, code),
        }
    )
    try:
        kubectl("wait", f"pod/{name}", "--for=condition=Ready", "--timeout=60s")
        follower = subprocess.Popen(
            [kubectl.binary, "--kubeconfig", str(kubectl.kubeconfig), "logs", "-f", name],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert follower.stdout is not None
            lines = [follower.stdout.readline() for _ in range(4)]
            assert lines == [f"tick {i}\n" for i in range(4)]  # from the start, then live
        finally:
            follower.kill()
            follower.wait()
        wait_for(lambda: "tick 8" in kubectl("logs", name).stdout, timeout=30, what="tick 8")
        recent = kubectl("logs", name, "--since=2s").stdout.splitlines()
        assert recent and len(recent) <= 6 and "tick 0" not in recent
        assert kubectl("logs", name, "--tail=2").stdout.count("\n") == 2
    finally:
        kubectl("delete", "pod", name, "--wait=false")


def test_debug_on_a_provider_without_ephemeral_containers_says_so(
    node: str, kubectl: Kubectl
) -> None:
    """Neither example runs ephemeral containers: `kubectl debug` is told why instead of
    waiting forever for a container that never comes."""
    name = f"sleeper-{uuid.uuid4().hex[:6]}"
    kubectl.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": pod_spec(node, "import time; time.sleep(600)"),
        }
    )
    try:
        kubectl("wait", f"pod/{name}", "--for=condition=Ready", "--timeout=60s")
        kubectl("debug", name, "--image=busybox", "-c", "dbg", "--", "sh")
        waiting = wait_for(
            lambda: ephemeral_state(kubectl, "default", name, "dbg").get("waiting"),
            timeout=30,
            what="the ephemeral container's waiting reason",
        )
        assert waiting["reason"] == "EphemeralContainersNotSupported"
        assert node in waiting["message"]
        assert kubectl.json("get", "pod", name)["status"]["phase"] == "Running"  # untouched
    finally:
        kubectl("delete", "pod", name, "--wait=false")
