"""The chart with the cluster provider: the lower cluster's kubeconfig as a Secret file next to
the provider config, and the cluster provider's upper-side RBAC (the upper cluster's identity,
Services, tokens, the objects pods reference) exercised by a real agent run as the chart's pod
(tests/integration/helmchart.py). Separate from test_helm_chart.py because it needs the
session's lower cluster, whose tests share one worker."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import pytest

from vkubelet.devcluster import Cluster, ensure_helm
from vkubelet.testing import Kubectl

from .clusters import LowerCluster
from .helmchart import Installed, PodAgent, agent_as_pod, can_i, installed_chart, pod_runs_and_logs

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def installed(kubectl: Kubectl, lower_cluster: LowerCluster) -> Iterator[Installed]:
    helm = ensure_helm(lambda line: print(line, file=sys.stderr, flush=True))
    values = {
        "provider": "cluster",
        # As the chart's documentation says: a path relative to the config names the Secret's
        # file mounted next to it. No upperClusterID: the agent reads kube-system's UID.
        "providerConfig": {"kubeconfig": "lower.kubeconfig"},
        "secretFiles": {"lower.kubeconfig": lower_cluster.kubeconfig.read_text()},
    }
    node = f"vk-helm-lower-{uuid.uuid4().hex[:6]}"
    with installed_chart(helm, kubectl, node, values) as chart:
        yield chart


@pytest.fixture(scope="module")
def agent(
    installed: Installed,
    kube_cluster: Cluster,
    kubectl: Kubectl,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[PodAgent]:
    with agent_as_pod(installed, kube_cluster, kubectl, tmp_path_factory.mktemp("pod")) as agent:
        yield agent


def test_the_secret_file_is_mounted_next_to_the_config(installed: Installed) -> None:
    assert set(installed.files) == {"provider.yaml", "lower.kubeconfig"}
    volume = installed.deployment["spec"]["template"]["spec"]["volumes"][0]
    sources = [next(iter(s)) for s in volume["projected"]["sources"]]
    assert sources == ["configMap", "secret"]


def test_a_pod_runs_below_with_only_the_charts_rbac(
    agent: PodAgent, installed: Installed, kubectl: Kubectl, lower_cluster: LowerCluster
) -> None:
    assert pod_runs_and_logs(kubectl, installed)
    assert "forbidden" not in agent.log().lower(), agent.log()


@pytest.mark.parametrize(
    ("verb", "resource", "answer"),
    [
        ("get", "namespaces:kube-system", "yes"),  # the upper cluster's identity
        ("get", "namespaces:default", "no"),  # ...and no other namespace
        ("watch", "endpointslices.discovery.k8s.io", "yes"),  # every endpoint of a Service
        ("create", "endpointslices.discovery.k8s.io", "no"),
        ("list", "namespaces", "no"),  # only with the constraint webhook
        ("patch", "mutatingwebhookconfigurations", "no"),
        ("delete", "nodes", "no"),
    ],
)
def test_the_cluster_providers_grants_are_exactly_its_own(
    installed: Installed, kubectl: Kubectl, verb: str, resource: str, answer: str
) -> None:
    assert can_i(kubectl, installed, verb, resource, "") == answer
