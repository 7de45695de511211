"""The measured-usage formats: counters that never go back, and the kubelet's two answers."""

from __future__ import annotations

from vkubelet.sdk.stats import (
    ContainerUsage,
    CpuCounters,
    NodeUsage,
    PodUsage,
    Usage,
    resource_metrics,
    summary,
)


def test_a_counter_never_goes_back_and_rates_follow_what_it_counts() -> None:
    counters = CpuCounters()
    assert counters.update("c", 1_000, 10.0) == (1_000, 0)
    assert counters.update("c", 3_000, 12.0) == (3_000, 1_000)
    # A process left its group with its CPU time: the counter stays, then grows from there.
    assert counters.update("c", 500, 14.0) == (3_000, 0)
    assert counters.update("c", 2_500, 16.0) == (5_000, 1_000)
    counters.keep_only(["other"])
    assert counters.update("c", 100, 18.0) == (100, 0)  # forgotten: a fresh counter


def test_summary_and_metrics_carry_one_sample_s_figures() -> None:
    container = ContainerUsage("main", 1_700_000_100.0, Usage(2_500_000_000, 900_000_000, 4096))
    pod = PodUsage("ns", "web", "u1", 1_700_000_000.0, [container], container.usage)
    node = NodeUsage("dev", 1_600_000_000.0, Usage(9_000_000_000, 1_000_000_000, 8192), 100)
    when = 1_700_000_200.5
    got = summary(node, [pod], when)
    assert got["node"]["memory"] == {
        "time": "2023-11-14T22:16:40Z",
        "availableBytes": 100,
        "usageBytes": 8192,
        "workingSetBytes": 8192,
    }
    [entry] = got["pods"]
    assert entry["containers"][0]["cpu"]["usageNanoCores"] == 900_000_000
    text = resource_metrics(node, [pod], when).splitlines()
    labels = 'container="main",namespace="ns",pod="web"'
    assert f"container_cpu_usage_seconds_total{{{labels}}} 2.5 1700000200500" in text
    assert f"container_start_time_seconds{{{labels}}} 1700000100.0" in text
    assert "node_memory_working_set_bytes 8192.0 1700000200500" in text
    assert "resource_scrape_error 0.0" in text
