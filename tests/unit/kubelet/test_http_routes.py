"""Plain HTTPS routes: pods, stats, metrics, errors, and the security gate in front of them."""

from __future__ import annotations

import asyncio
import ssl

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from vkubelet.kubelet import (
    AllowAnyone,
    AlwaysAllow,
    KubeletAuth,
    KubeletNode,
    ServerConfig,
    serve_nodes,
    server_ssl_context,
)

from .harness import (
    CONTAINER,
    NAMESPACE,
    POD,
    FakeProvider,
    HttpClient,
    Kubelet,
    LifecycleOnly,
    Pki,
    StartKubelet,
    client_context,
    fetch,
    make_pod,
)


async def test_healthz_answers_ok_without_credentials(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/healthz", cert=False)
    assert (reply.status, reply.text) == (200, "ok")


async def test_request_without_credentials_is_401(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/pods", cert=False)
    assert reply.status == 401
    assert "Unauthorized" in reply.text
    assert kubelet.authorizer.asked == []


async def test_apiserver_client_certificate_is_authenticated_by_cn_and_o(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/pods")
    assert reply.status == 200
    user, attributes = kubelet.authorizer.asked[0]
    assert user == "kube-apiserver-kubelet-client"
    assert (attributes.verb, attributes.resource, attributes.subresource, attributes.node) == (
        "get",
        "nodes",
        "proxy",
        "n1",
    )


async def test_certificate_from_an_untrusted_ca_fails_the_handshake(kubelet: Kubelet) -> None:
    context = client_context(kubelet.pki, rogue=True)
    # TLS 1.3 reports a rejected client certificate only on the first read, as an alert or EOF.
    with pytest.raises((ssl.SSLError, ConnectionError)):
        await fetch(kubelet.port, context, "/pods")


async def test_valid_bearer_token_is_accepted_and_bad_one_is_401(kubelet: Kubelet) -> None:
    assert (await kubelet.get("/pods", token="good-token")).status == 200
    assert kubelet.authorizer.asked[-1][0] == "alice"
    assert (await kubelet.get("/pods", token="forged")).status == 401


async def test_user_the_authorizer_denies_gets_403(kubelet: Kubelet) -> None:
    kubelet.authorizer.deny.add("bob")
    reply = await kubelet.get("/containerLogs/default/web/app", token="bob-token")
    assert reply.status == 403
    assert "user=bob" in reply.text and "subresource=proxy" in reply.text


@pytest.mark.parametrize(
    ("path", "method", "verb", "subresource"),
    [
        ("/stats/summary", "GET", "get", "stats"),
        ("/metrics/resource", "GET", "get", "metrics"),
        ("/metrics", "GET", "get", "metrics"),
        ("/pods", "GET", "get", "proxy"),
        ("/run/default/web/app?cmd=echo+hi", "POST", "create", "proxy"),
    ],
)
async def test_authorizer_is_asked_with_subresource_from_the_path(
    kubelet: Kubelet, path: str, method: str, verb: str, subresource: str
) -> None:
    await kubelet.get(path, method=method)
    _, attributes = kubelet.authorizer.asked[-1]
    assert (attributes.verb, attributes.subresource) == (verb, subresource)


async def test_anonymous_is_allowed_only_when_enabled(start_kubelet: StartKubelet) -> None:
    kubelet = await start_kubelet(allow_anonymous=True)
    reply = await kubelet.get("/pods", cert=False)
    assert reply.status == 200
    assert kubelet.authorizer.asked[-1][0] == "system:anonymous"
    # A bad token never falls back to anonymous.
    assert (await kubelet.get("/pods", token="forged")).status == 401


async def test_unknown_path_is_404_with_a_message(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/configz")
    assert reply.status == 404
    assert "/configz" in reply.text


async def test_wrong_method_is_405(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/pods", method="DELETE")
    assert reply.status == 405
    assert reply.headers["allow"] == "GET"


async def test_pods_lists_the_pods_bound_to_the_node(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/pods/")
    body = reply.json()
    assert (body["kind"], body["apiVersion"]) == ("PodList", "v1")
    assert [p["metadata"]["name"] for p in body["items"]] == [POD]


async def test_runningpods_lists_the_provider_pods(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/runningpods/")
    assert reply.status == 200
    assert [p["metadata"]["uid"] for p in reply.json()["items"]] == ["uid-web"]


async def test_stats_summary_is_the_provider_json(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/stats/summary")
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    assert reply.json()["node"]["cpu"]["usageNanoCores"] == 5


async def test_metrics_resource_is_prometheus_text(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/metrics/resource")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "node_cpu_usage_seconds_total 1.5" in reply.text


async def test_agent_metrics_count_requests_by_route_and_code(kubelet: Kubelet) -> None:
    await kubelet.get("/stats/summary")
    await kubelet.get("/pods", cert=False)
    text = (await kubelet.get("/metrics")).text
    assert 'vkubelet_kubelet_http_requests_total{code="200",port=' in text
    assert 'route="stats"' in text
    assert 'vkubelet_kubelet_auth_failures_total{code="401"' in text


@pytest.mark.parametrize(
    ("path", "capability"),
    [
        ("/stats/summary", "StatsProvider"),
        ("/metrics/resource", "MetricsProvider"),
        ("/containerLogs/default/web/app", "ContainerLogs"),
        ("/exec/default/web/app?command=ls&output=1", "ContainerExec"),
        ("/attach/default/web/app?output=1", "ContainerAttach"),
        ("/portForward/default/web", "PortForwarder"),
    ],
)
async def test_missing_capability_is_501_naming_it(
    start_kubelet: StartKubelet, path: str, capability: str
) -> None:
    kubelet = await start_kubelet(provider=LifecycleOnly([make_pod()]))
    reply = await kubelet.get(path)
    assert reply.status == 501
    assert capability in reply.text and "n1" in reply.text


async def test_run_returns_the_command_output(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/run/default/web/app?cmd=echo+hello+world", method="POST")
    assert (reply.status, reply.text) == (200, "hello world\n")


async def test_run_with_a_failing_command_is_500_with_output_and_code(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/run/default/web/app?cmd=fail+3", method="POST")
    assert reply.status == 500
    assert reply.text == "partial\noops\ncommand terminated with non-zero exit code: 3\n"


async def test_run_of_a_command_that_cannot_be_started_is_500_with_its_message_and_127(
    kubelet: Kubelet,
) -> None:
    reply = await kubelet.get("/run/default/web/app?cmd=nope", method="POST")
    assert reply.status == 500
    assert reply.text == (
        'exec: "nope": executable file not found\ncommand terminated with non-zero exit code: 127\n'
    )


async def test_run_in_an_unknown_pod_is_404(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/run/default/nope/app?cmd=echo", method="POST")
    assert reply.status == 404


async def test_provider_error_is_500_with_its_message(kubelet: Kubelet) -> None:
    reply = await kubelet.get("/run/default/web/app?cmd=boom", method="POST")
    assert reply.status == 500
    assert "cannot run ['boom']" in reply.text


async def test_keep_alive_connection_serves_several_requests(kubelet: Kubelet) -> None:
    client = await HttpClient.connect(kubelet.port, kubelet.context())
    try:
        for _ in range(3):
            await client.request("GET", "/healthz")
            assert (await client.response()).status_code == 200
            assert await client.body() == b"ok"
            client.conn.start_next_cycle()
    finally:
        await client.close()


async def test_connections_over_the_limit_are_closed(start_kubelet: StartKubelet) -> None:
    kubelet = await start_kubelet(config=ServerConfig(host="127.0.0.1", max_connections=1))
    first = await HttpClient.connect(kubelet.port, kubelet.context())
    try:
        await first.request("GET", "/healthz")
        assert (await first.response()).status_code == 200
        with pytest.raises((ConnectionError, ssl.SSLError)):
            await fetch(kubelet.port, kubelet.context(), "/healthz")
    finally:
        await first.close()
    await asyncio.sleep(0.05)
    assert (await kubelet.get("/healthz")).status == 200


async def test_several_nodes_on_one_port_are_told_apart(start_kubelet: StartKubelet) -> None:
    one, two = FakeProvider([make_pod("a", node="n1")]), FakeProvider([make_pod("b", node="n2")])
    nodes = [
        KubeletNode("n1", one, pods=lambda: list(one.pods.values()), addresses=("10.0.0.1",)),
        # n2's pods come as JSON, as the agent's compact pod cache keeps them.
        KubeletNode(
            "n2",
            two,
            pods=lambda: [msgspec.json.encode(p) for p in two.pods.values()],
            addresses=("10.0.0.2",),
        ),
    ]
    kubelet = await start_kubelet(nodes=nodes)
    # By Host header for node-wide routes ...
    reply = await kubelet.get("/pods", headers=[("Host", "10.0.0.2:10250")])
    assert [p["metadata"]["name"] for p in reply.json()["items"]] == ["b"]
    assert kubelet.authorizer.asked[-1][1].node == "n2"
    # ... by the pod's node for pod routes ...
    reply = await kubelet.get(f"/containerLogs/{NAMESPACE}/b/{CONTAINER}")
    assert reply.status == 200
    assert kubelet.authorizer.asked[-1][1].node == "n2"
    # ... and a clear refusal when neither says.
    reply = await kubelet.get("/stats/summary", headers=[("Host", "elsewhere")])
    assert reply.status == 421
    assert "n1, n2" in reply.text


async def test_silent_connection_is_closed_after_the_header_timeout(
    start_kubelet: StartKubelet,
) -> None:
    kubelet = await start_kubelet(config=ServerConfig(host="127.0.0.1", header_timeout=0.2))
    client = await HttpClient.connect(kubelet.port, kubelet.context())
    async with asyncio.timeout(2):
        assert await client.reader.read() == b""
    await client.close()


async def test_oversized_request_head_is_431(start_kubelet: StartKubelet) -> None:
    kubelet = await start_kubelet(config=ServerConfig(host="127.0.0.1", max_header_bytes=4096))
    reply = await kubelet.get("/pods", headers=[("X-Padding", "x" * 8000)])
    assert reply.status == 431


def test_serve_nodes_makes_one_server_per_port(pki: Pki) -> None:
    provider = FakeProvider()
    servers = serve_nodes(
        [
            KubeletNode("a", provider, port=10250),
            KubeletNode("b", provider, port=10251),
            KubeletNode("c", provider, port=10250),
        ],
        ssl_context=server_ssl_context(pki.server_cert, pki.server_key, pki.ca),
        auth=KubeletAuth(AllowAnyone(), AlwaysAllow()),
        registry=CollectorRegistry(),
    )
    assert sorted((s.requested_port, [n.name for n in s.nodes]) for s in servers) == [
        (10250, ["a", "c"]),
        (10251, ["b"]),
    ]
