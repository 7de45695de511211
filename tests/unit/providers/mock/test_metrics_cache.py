"""The mock's per-pod work is done once, not per scrape or per report: `/metrics/resource`
keeps what never changes in a pod's samples (a scrape after pods started, stopped or changed
their containers is the text a fresh node would print), and a running pod's status is built in
two replay steps, not three."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
from lightkube.models.core_v1 import Container, PodSpec, PodStatus

from vkubelet.providers.mock._provider import _status
from vkubelet.providers.mock._records import MockContainer, MockPod, format_time
from vkubelet.providers.mock._stats import NodeStats
from vkubelet.sdk.status import ContainerReport, Running, Terminated, build_pod_status

BASE = datetime.now(UTC) - timedelta(hours=1)


def mock_pod(name: str, *containers: str, namespace: str = "ns", init: str = "") -> MockPod:
    started = format_time(BASE + timedelta(seconds=len(name)))
    running = [MockContainer(c, "img", []) for c in containers]
    inits = [MockContainer(init, "img", [], init=True)] if init else []
    return MockPod(
        namespace,
        name,
        f"uid-{namespace}-{name}",
        "n1",
        "10.0.0.1",
        inits + running,
        started,
        started=started,
    )


def pod_lines(text: str) -> list[str]:
    """The samples about pods and containers (the node's own CPU counter depends on the
    node's age, not on pods)."""
    return [line for line in text.splitlines() if not line.startswith(("node_", "#"))]


def scrape_from_scratch(pods: list[MockPod], now: datetime) -> list[str]:
    return pod_lines(NodeStats("n1", "4Ti").resource_metrics(pods, now))


def test_a_scrape_after_pods_start_stop_and_change_is_what_a_fresh_node_prints() -> None:
    stats = NodeStats("n1", "4Ti")
    pods = [
        mock_pod("b", "web"),
        mock_pod("a", "web", "sidecar", init="setup"),
        mock_pod("a", "app", namespace="other"),
        mock_pod("a-long-name", "web"),
        mock_pod("not-started", "web"),
    ]
    pods[-1].started = None
    now = BASE + timedelta(minutes=30)
    assert pod_lines(stats.resource_metrics(pods, now)) == scrape_from_scratch(pods, now)

    later = now + timedelta(seconds=15)  # CPU counters moved on, the rest is as it was
    first, second = stats.resource_metrics(pods, now), stats.resource_metrics(pods, later)
    assert first != second
    assert pod_lines(second) == scrape_from_scratch(pods, later)

    pods[0].containers = [MockContainer("web", "img", []), MockContainer("aaa", "img", [])]
    stopped = pods.pop(2)
    stats.retire(stopped)
    pods.append(mock_pod("c", "web"))
    pods[-2].started = format_time(BASE)  # the pod that was not started is now
    later += timedelta(seconds=15)
    assert pod_lines(stats.resource_metrics(pods, later)) == scrape_from_scratch(pods, later)

    gone = pods.pop(0)  # stopped without being retired: its samples go all the same
    assert gone.name == "b"
    text = stats.resource_metrics(pods, later)
    assert 'pod="b"' not in text
    assert pod_lines(text) == scrape_from_scratch(pods, later)


def test_samples_of_each_family_are_sorted_by_their_labels() -> None:
    pods = [mock_pod(f"p{i}", "z", "a") for i in (3, 1, 20, 2)]
    text = NodeStats("n1", "4Ti").resource_metrics(pods, BASE + timedelta(minutes=5))
    families: dict[str, list[str]] = {}
    for line in pod_lines(text):
        if "{" not in line:
            continue  # resource_scrape_error
        name, _, rest = line.partition("{")
        families.setdefault(name, []).append(rest.partition("}")[0])
    assert len(families) == 5
    for labels in families.values():
        assert labels == sorted(labels)
        assert len(labels) in (4, 8)


def test_a_running_pods_status_is_the_replays_fixed_point() -> None:
    """The replay skips its last step for a pod without restarts or probe verdicts: building
    that step on top of the status changes nothing (same reports, same moment)."""
    mock = mock_pod("web", "app", "sidecar", init="setup")
    mock.created = format_time(BASE - timedelta(seconds=5))
    status = _status(mock, "10.0.0.9")
    spec = PodSpec(
        containers=[Container(name=c.name, image=c.image) for c in mock.containers if not c.init],
        initContainers=[Container(name=c.name, image=c.image) for c in mock.containers if c.init],
    )
    again = build_pod_status(
        spec,
        _reports(status),
        host_ip="10.0.0.9",
        pod_ips=[mock.ip],
        start_time=datetime.fromisoformat(mock.created),
        previous=status,
        now=datetime.fromisoformat(str(mock.started)),
    )
    assert msgspec.to_builtins(again) == msgspec.to_builtins(status)
    conditions = {c.type: c.lastTransitionTime for c in status.conditions or []}
    assert conditions["PodScheduled"] != conditions["Ready"]  # both steps still replayed


def _reports(status: PodStatus) -> dict[str, ContainerReport]:
    reports = {}
    for statuses, init in ((status.initContainerStatuses, True), (status.containerStatuses, False)):
        for c in statuses or []:
            state = c.state
            assert state is not None
            if init:
                assert state.terminated is not None
                run: Running | Terminated = Terminated(
                    0, state.terminated.startedAt, state.terminated.finishedAt
                )
            else:
                assert state.running is not None and state.running.startedAt is not None
                run = Running(state.running.startedAt)
            reports[c.name] = ContainerReport(
                state=run,
                restart_count=0,
                ready=c.ready,
                started=bool(c.started),
                container_id=c.containerID,
                image_id=c.imageID,
            )
    return reports
