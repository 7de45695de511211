"""`kubectl top` numbers: only our pods, under their upper names, the node being their sum."""

from __future__ import annotations

from vkubelet.providers.cluster._stats import merge_resource_metrics, merge_summaries

RENAMES = {
    ("up-shop", "web-0"): ("shop", "web-0", "u-web"),
    ("up-shop", "db-0"): ("shop", "db-0", "u-db"),
}


def pod(namespace: str, name: str, nanocores: int, memory: int) -> dict[str, object]:
    return {
        "podRef": {"namespace": namespace, "name": name, "uid": "lower-uid"},
        "cpu": {
            "time": "2026-11-24T06:00:00Z",
            "usageNanoCores": nanocores,
            "usageCoreNanoSeconds": 10,
        },
        "memory": {"time": "2026-11-24T06:00:01Z", "workingSetBytes": memory, "usageBytes": memory},
        "containers": [],
    }


def test_summaries_keep_our_pods_renamed_and_sum_them_for_the_node() -> None:
    lower_a = {
        "node": {"nodeName": "lower-a", "startTime": "2026-11-24T05:00:00Z"},
        "pods": [pod("up-shop", "web-0", 5_000_000, 100), pod("theirs", "x", 9_000_000_000, 10**9)],
    }
    lower_b = {
        "node": {"nodeName": "lower-b", "startTime": "2026-11-24T04:00:00Z"},
        "pods": [pod("up-shop", "db-0", 7_000_000, 200)],
    }
    summary = merge_summaries("vk-lower", [lower_a, lower_b], RENAMES)
    assert [p["podRef"] for p in summary["pods"]] == [
        {"namespace": "shop", "name": "web-0", "uid": "u-web"},
        {"namespace": "shop", "name": "db-0", "uid": "u-db"},
    ]
    node = summary["node"]
    assert node["nodeName"] == "vk-lower" and node["startTime"] == "2026-11-24T04:00:00Z"
    assert node["cpu"]["usageNanoCores"] == 12_000_000
    assert node["cpu"]["usageCoreNanoSeconds"] == 20
    assert node["memory"]["workingSetBytes"] == 300
    assert node["memory"]["time"] == "2026-11-24T06:00:01Z"


LOWER_METRICS = """\
# HELP container_cpu_usage_seconds_total [STABLE] Cumulative cpu time
# TYPE container_cpu_usage_seconds_total counter
{CPU}{{container="app",namespace="up-shop",pod="web-0"}} 1.5 1764000000000
{CPU}{{container="x",namespace="theirs",pod="x"}} 99 1764000000000
{MEMORY}{{container="app",namespace="up-shop",pod="web-0"}} 1048576 1764000000500
node_cpu_usage_seconds_total 12345.5 1764000000000
scrape_error 0
""".format(CPU="container_cpu_usage_seconds_total", MEMORY="container_memory_working_set_bytes")


def test_resource_metrics_keep_our_containers_renamed_and_the_node_is_their_sum() -> None:
    text = merge_resource_metrics([LOWER_METRICS], RENAMES)
    lines = text.splitlines()
    ours = '{container="app",namespace="shop",pod="web-0"}'
    assert f"container_cpu_usage_seconds_total{ours} 1.5 1764000000000" in lines
    assert f"container_memory_working_set_bytes{ours} 1048576 1764000000500" in lines
    assert "node_cpu_usage_seconds_total 1.5 1764000000500" in lines
    assert "node_memory_working_set_bytes 1048576 1764000000500" in lines
    assert "theirs" not in text and "up-shop" not in text and "12345" not in text
    assert "# TYPE node_cpu_usage_seconds_total counter" in lines
    assert "scrape_error 0" in lines
