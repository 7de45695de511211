"""`serviceAccountTokens: upper`: short-lived upper tokens in a per-pod Secret, never a copy of
an upper token Secret, refreshed before 80 % of their life and removed with the pod."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from lightkube.resources.core_v1 import Pod

from vkubelet.node import ConfigError
from vkubelet.providers.cluster import (
    ClusterProvider,
    LowerCluster,
    load_lower_config,
    plan_dependencies,
    translate_pod,
)
from vkubelet.providers.cluster._tokens import (
    is_token_secret,
    refresh_at,
    token_secret,
    token_secret_name,
    token_sources,
)
from vkubelet.providers.cluster._translate import needed_references
from vkubelet.sdk import ProviderContext, ResolvedPod
from vkubelet.testing.fakeapi import FakeApiServer, now_rfc3339

from .fakes import lower_yaml
from .pods import OWNER, how, upper_pod

JSON = dict[str, Any]


def test_upper_mode_keeps_the_token_volume_reading_the_pods_token_secret() -> None:
    upper = upper_pod()
    lower = translate_pod(upper, how(service_account_tokens="upper"))
    spec = lower["spec"]
    [volume] = [v for v in spec["volumes"] if v["name"].startswith("kube-api-access-")]
    secret_name = token_secret_name(upper["metadata"]["uid"])
    sources = volume["projected"]["sources"]
    assert sources[0] == {
        "secret": {
            "name": secret_name,
            "items": [{"key": "kube-api-access-x7k2p.0", "path": "token"}],
        }
    }
    assert sources[1]["configMap"]["name"].startswith("kube-root-ca.crt-"), "the upper CA copy"
    assert spec["automountServiceAccountToken"] is False, "no lower token at the same path"
    assert "serviceAccountToken" not in json.dumps(lower)
    mounts = spec["containers"][0]["volumeMounts"]
    assert any(m["name"] == "kube-api-access-x7k2p" for m in mounts)
    needed = {
        (r.kind, r.name) for r in needed_references(upper, how(service_account_tokens="upper"))
    }
    assert ("ConfigMap", "kube-root-ca.crt") in needed
    assert not any(name == secret_name for _, name in needed), "not an upper object to copy"


def test_lower_mode_drops_the_upper_token_volume_as_before() -> None:
    lower = translate_pod(upper_pod(), how())
    assert not any(v["name"].startswith("kube-api-access-") for v in lower["spec"]["volumes"])


def test_sources_carry_audience_and_lifetime_at_least_the_apis_minimum() -> None:
    volume = {
        "name": "vault",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"audience": "vault", "expirationSeconds": 60}},
                {"serviceAccountToken": {"path": "t2", "expirationSeconds": 7200}},
            ]
        },
    }
    [first, second] = token_sources({"volumes": [volume]})
    assert (first.key, first.audience, first.seconds) == ("vault.0", "vault", 600)
    assert (second.key, second.audience, second.seconds) == ("vault.1", None, 7200)


def test_the_token_secret_is_stamped_and_marked_and_a_refresh_comes_at_80_percent() -> None:
    secret = token_secret(OWNER, "shop", upper_pod(), {"kube-api-access-x7k2p.0": "tok"})
    assert is_token_secret(secret)
    assert secret["metadata"]["labels"]["vkubelet.io/owner"] == OWNER.key
    assert base64.b64decode(secret["data"]["kube-api-access-x7k2p.0"]) == b"tok"
    assert refresh_at(1000.0, 4600.0) == pytest.approx(1000.0 + 0.8 * 3600)


def test_the_dependency_planner_never_deletes_a_token_secret() -> None:
    secret = token_secret(OWNER, "shop", upper_pod(), {"k": "tok"})
    secret["metadata"]["uid"] = "lower-uid"
    key = ("Secret", "shop", secret["metadata"]["name"])
    plan = plan_dependencies([], {}, {key: secret}, how())
    assert key not in plan.delete


def test_an_upper_object_labelled_as_a_token_secret_is_copied_as_an_ordinary_one() -> None:
    """A user's label must not make the provider keep a copy for ever, or delete it as a
    token Secret of a pod that does not exist."""
    impostor = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": "db",
            "namespace": "shop",
            "uid": "uid-db",
            "resourceVersion": "1",
            "labels": {"vkubelet.io/role": "upper-token", "app": "web"},
        },
        "data": {},
    }
    pod = upper_pod()
    pod["spec"]["containers"][0]["envFrom"] = [{"secretRef": {"name": "db"}}]
    [copy] = [
        o
        for o in plan_dependencies([pod], {("Secret", "shop", "db"): impostor}, {}, how()).create
        if o["metadata"]["name"].startswith("db")
    ]
    assert copy["metadata"]["labels"].get("vkubelet.io/role") is None
    assert copy["metadata"]["labels"]["app"] == "web"
    copy["metadata"]["labels"]["vkubelet.io/role"] = "upper-token"  # even if it were set below
    assert not is_token_secret(copy)
    key = ("Secret", "shop", copy["metadata"]["name"])
    copy["metadata"]["uid"] = "lower-uid"
    assert key in plan_dependencies([], {}, {key: copy}, how()).delete  # an unused copy goes


def test_upper_tokens_need_a_service_account(tmp_path: Path) -> None:
    path = lower_yaml(tmp_path, serviceAccounts="none", serviceAccountTokens="upper")
    with pytest.raises(ConfigError, match="serviceAccountTokens: upper tokens need"):
        load_lower_config(path)


class TokenMinter:
    """The upper API's TokenRequest, as far as the provider uses it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, JSON]] = []

    async def get(self, path: str, params: Any = None) -> JSON:
        return {"metadata": {"uid": "upper-ks-uid"}}

    async def create(self, path: str, body: Any) -> JSON:
        self.requests.append((path, body))
        seconds = body["spec"]["expirationSeconds"]
        return {
            "status": {
                "token": f"t{len(self.requests)}",
                "expirationTimestamp": now_rfc3339(seconds),
            }
        }

    def watch(self, path: str, params: Any, *, timeout_seconds: int) -> Any:
        raise AssertionError("not used")


def test_tokens_are_minted_bound_to_the_pod_refreshed_when_due_and_removed_with_it(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        config = load_lower_config(lower_yaml(tmp_path, serviceAccountTokens="upper"))
        lower_api = FakeApiServer()
        context = ProviderContext(
            node_name="vk-lower", config_path=None, internal_ip="10.0.0.9", kubelet_port=0
        )
        provider = ClusterProvider(
            config, context, LowerCluster(lower_api.client(), config), background=False
        )
        minter = TokenMinter()
        provider.use_upper_api(minter)
        await provider._ensure_owner()
        upper = upper_pod()
        pod = ResolvedPod(msgspec.convert(upper, Pod))
        provider._pods["shop/" + pod.name] = pod

        def token_in_secret() -> str | None:
            found = lower_api.get("secrets", token_secret_name(pod.uid), "shop")
            if found is None:
                return None
            return base64.b64decode(found["data"]["kube-api-access-x7k2p.0"]).decode()

        await provider.tokens.deliver(pod)
        assert token_in_secret() == "t1"
        path, request = minter.requests[0]
        assert path == "/api/v1/namespaces/shop/serviceaccounts/web/token"
        assert request["spec"]["boundObjectRef"] == {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.name,
            "uid": pod.uid,
        }
        assert request["spec"]["expirationSeconds"] == 3607
        uid, due = provider.tokens.due["shop/" + pod.name]
        assert uid == pod.uid and time.time() + 2800 < due < time.time() + 2900

        await provider.tokens.refresh_due()
        assert token_in_secret() == "t1", "not due yet"
        provider.tokens.due["shop/" + pod.name] = (pod.uid, time.time() - 1)
        await provider.tokens.refresh_due()
        assert token_in_secret() == "t2"

        provider.tokens.drop("shop/" + pod.name, pod.uid)
        for _ in range(100):
            if token_in_secret() is None:
                break
            await asyncio.sleep(0.01)
        assert token_in_secret() is None
        await provider.aclose()

    asyncio.run(run())
