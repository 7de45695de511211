"""Volume resolution: the files each configMap/secret/downwardAPI/projected volume holds, with the
kubelet's modes, optional semantics and FailedMount messages."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from vkubelet.node.resolve import (
    FAILED_MOUNT,
    EmptyDirVolume,
    FileContent,
    FilesVolume,
    HostPathVolume,
    OtherVolume,
    TokenFile,
    TokenSource,
    VolumeResult,
    resolve_volumes,
)

from .fakes import ALLOCATABLE, FakeSources, FakeTokens, configmap, pod, secret


def resolve(
    volumes: list[dict[str, Any]],
    sources: FakeSources | None = None,
    *,
    tokens: TokenSource | None = None,
    **pod_spec: Any,
) -> VolumeResult:
    return resolve_volumes(
        pod(volumes=volumes, **pod_spec),
        sources or FakeSources(),
        token_source=tokens,
        node_allocatable=ALLOCATABLE,
    )


def files_of(result: VolumeResult, name: str = "v") -> dict[str, FileContent]:
    assert result.errors == ()
    volume = result.get(name)
    assert isinstance(volume, FilesVolume)
    return dict(volume.files)


def test_config_map_volume_holds_every_key_with_mode_0644_and_decoded_binary_data() -> None:
    cfg = configmap("cfg", {"app.yaml": "a: 1\n"}, binary={"logo": b"\x89PNG"})
    sources = FakeSources(objects=[cfg])
    files = files_of(resolve([{"name": "v", "configMap": {"name": "cfg"}}], sources))
    assert files == {
        "app.yaml": FileContent(b"a: 1\n", 0o644),
        "logo": FileContent(b"\x89PNG", 0o644),
    }


def test_config_map_items_map_keys_to_paths_with_their_own_modes() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"a": "A", "b": "B", "c": "C"})])
    volume = {
        "name": "v",
        "configMap": {
            "name": "cfg",
            "defaultMode": 0o440,
            "items": [{"key": "a", "path": "conf/a.txt", "mode": 0o600}, {"key": "b", "path": "b"}],
        },
    }
    assert files_of(resolve([volume], sources)) == {
        "conf/a.txt": FileContent(b"A", 0o600),
        "b": FileContent(b"B", 0o440),
    }


def test_missing_optional_config_map_gives_an_empty_volume() -> None:
    items = [{"key": "k", "path": "k"}]
    volume = {"name": "v", "configMap": {"name": "gone", "optional": True, "items": items}}
    assert files_of(resolve([volume])) == {}


def test_missing_mandatory_config_map_fails_the_mount_with_the_kubelet_message() -> None:
    result = resolve([{"name": "cfg-vol", "configMap": {"name": "gone"}}])
    assert result.volumes == ()
    (error,) = result.errors
    assert (error.volume, error.reason) == ("cfg-vol", FAILED_MOUNT)
    assert (
        error.message
        == 'MountVolume.SetUp failed for volume "cfg-vol" : configmap "gone" not found'
    )


def test_missing_config_map_key_fails_unless_optional() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"a": "A"})])
    items = [{"key": "a", "path": "a"}, {"key": "missing-key", "path": "m"}]
    failing = resolve([{"name": "v", "configMap": {"name": "cfg", "items": items}}], sources)
    assert failing.errors[0].message.endswith(
        "configmap references non-existent config key: missing-key"
    )
    optional = {"name": "v", "configMap": {"name": "cfg", "items": items, "optional": True}}
    assert files_of(resolve([optional], sources)) == {"a": FileContent(b"A", 0o644)}


def test_unreadable_config_map_fails_the_mount_even_when_optional() -> None:
    sources = FakeSources(unreadable={("ConfigMap", "cfg")})
    result = resolve([{"name": "v", "configMap": {"name": "cfg", "optional": True}}], sources)
    assert "connection refused" in result.errors[0].message


def test_secret_volume_is_decoded_with_default_mode_0644_unless_told_otherwise() -> None:
    sources = FakeSources(secrets=[secret("tls", {"tls.key": "KEY", "tls.crt": "CRT"})])
    files = files_of(resolve([{"name": "v", "secret": {"secretName": "tls"}}], sources))
    assert files == {"tls.crt": FileContent(b"CRT", 0o644), "tls.key": FileContent(b"KEY", 0o644)}
    strict = {"name": "v", "secret": {"secretName": "tls", "defaultMode": 0o400}}
    assert {f.mode for f in files_of(resolve([strict], sources)).values()} == {0o400}


def test_missing_secret_fails_the_mount_unless_optional() -> None:
    result = resolve([{"name": "v", "secret": {"secretName": "tls"}}])
    assert result.errors[0].message.endswith(': secret "tls" not found')
    assert (
        files_of(resolve([{"name": "v", "secret": {"secretName": "tls", "optional": True}}])) == {}
    )


def test_missing_secret_key_fails_the_mount() -> None:
    sources = FakeSources(secrets=[secret("tls", {})])
    volume = {"name": "v", "secret": {"secretName": "tls", "items": [{"key": "k", "path": "k"}]}}
    assert (
        resolve([volume], sources)
        .errors[0]
        .message.endswith("references non-existent secret key: k")
    )


def test_downward_api_volume_writes_metadata_and_resources_as_the_kubelet_does() -> None:
    volume = {
        "name": "v",
        "downwardAPI": {
            "items": [
                {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}},
                {"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}},
                {"path": "name", "fieldRef": {"fieldPath": "metadata.name"}, "mode": 0o400},
                {"path": "tier", "fieldRef": {"fieldPath": "metadata.labels['tier']"}},
                {
                    "path": "cpu_limit_millis",
                    "resourceFieldRef": {
                        "containerName": "app",
                        "resource": "limits.cpu",
                        "divisor": "1m",
                    },
                },
                {
                    "path": "mem_request",
                    "resourceFieldRef": {"containerName": "app", "resource": "requests.memory"},
                },
            ]
        },
    }
    containers = [{"name": "app", "resources": {"requests": {"memory": "1Ki"}}}]
    files = files_of(resolve([volume], containers=containers))
    assert files == {
        "labels": FileContent(b'app="web"\ntier="front"', 0o644),
        "annotations": FileContent(b'owner="team-a"', 0o644),
        "name": FileContent(b"web-0", 0o400),
        "tier": FileContent(b"front", 0o644),
        "cpu_limit_millis": FileContent(b"4000", 0o644),
        "mem_request": FileContent(b"1024", 0o644),
    }


def test_downward_api_volume_only_supports_metadata_fields_like_the_kubelet() -> None:
    volume = {
        "name": "v",
        "downwardAPI": {"items": [{"path": "ip", "fieldRef": {"fieldPath": "status.podIP"}}]},
    }
    assert resolve([volume]).errors[0].message.endswith("unsupported fieldPath: status.podIP")


def kube_api_access(expiration: int | None = 3607) -> dict[str, Any]:
    token: dict[str, Any] = {"path": "token"}
    if expiration is not None:
        token["expirationSeconds"] = expiration
    return {
        "name": "kube-api-access",
        "projected": {
            "defaultMode": 0o644,
            "sources": [
                {"serviceAccountToken": token},
                {
                    "configMap": {
                        "name": "kube-root-ca.crt",
                        "items": [{"key": "ca.crt", "path": "ca.crt"}],
                    }
                },
                {
                    "downwardAPI": {
                        "items": [
                            {
                                "path": "namespace",
                                "fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"},
                            }
                        ]
                    }
                },
            ],
        },
    }


def test_projected_service_account_volume_gets_a_bound_token_ca_and_namespace() -> None:
    tokens = FakeTokens()
    sources = FakeSources(objects=[configmap("kube-root-ca.crt", {"ca.crt": "PEM"})])
    result = resolve([kube_api_access()], sources, tokens=tokens)
    assert files_of(result, "kube-api-access") == {
        "token": FileContent(b"token-for-app-default", 0o644),
        "ca.crt": FileContent(b"PEM", 0o644),
        "namespace": FileContent(b"shop", 0o644),
    }
    assert tokens.requests == [("shop", "app", None, 3607)]
    assert result.token_expiry == tokens.expiry


def test_token_request_defaults_to_one_hour_and_passes_the_audience() -> None:
    tokens = FakeTokens()
    volume = {
        "name": "v",
        "projected": {"sources": [{"serviceAccountToken": {"path": "vault", "audience": "vault"}}]},
    }
    files = files_of(resolve([volume], tokens=tokens))
    assert files["vault"].data == b"token-for-app-vault"
    assert tokens.requests == [("shop", "app", "vault", 3600)]


def test_earliest_token_expiry_is_reported() -> None:
    soon = datetime(2029, 1, 1, tzinfo=UTC)

    class TwoExpiries(FakeTokens):
        def request_token(
            self,
            namespace: str,
            service_account: str,
            audience: str | None,
            expiration_seconds: int,
            pod: Any,
        ) -> tuple[str, datetime]:
            token, expiry = super().request_token(
                namespace, service_account, audience, expiration_seconds, pod
            )
            return token, soon if audience == "early" else expiry

    volume = {
        "name": "v",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "a", "audience": "late"}},
                {"serviceAccountToken": {"path": "b", "audience": "early"}},
            ]
        },
    }
    assert resolve([volume], tokens=TwoExpiries()).token_expiry == soon


def test_token_is_0600_and_owned_by_the_pods_user_when_all_containers_share_one() -> None:
    volume = {"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    containers = [{"name": "a"}, {"name": "b", "securityContext": {"runAsUser": 1000}}]
    result = resolve(
        [volume], tokens=FakeTokens(), containers=containers, securityContext={"runAsUser": 1000}
    )
    files = files_of(result)
    assert files["t"] == FileContent(b"token-for-app-default", 0o600, owner_uid=1000)


def test_token_owner_is_unset_when_containers_run_as_different_users() -> None:
    volume = {"name": "v", "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]}}
    containers = [{"name": "a", "securityContext": {"runAsUser": 1}}, {"name": "b"}]
    files = files_of(resolve([volume], tokens=FakeTokens(), containers=containers))
    assert files["t"] == FileContent(b"token-for-app-default", 0o644, owner_uid=None)


def test_fs_group_makes_every_file_group_readable_and_the_token_0640() -> None:
    sources = FakeSources(
        objects=[configmap("kube-root-ca.crt", {"ca.crt": "PEM"})],
        secrets=[secret("tls", {"key": "K"})],
    )
    volumes = [
        kube_api_access(),
        {"name": "tls", "secret": {"secretName": "tls", "defaultMode": 0o400}},
    ]
    result = resolve(volumes, sources, tokens=FakeTokens(), securityContext={"fsGroup": 2000})
    access = result.get("kube-api-access")
    assert isinstance(access, FilesVolume) and access.fs_group == 2000
    assert access.files["token"].mode == 0o640
    assert access.files["ca.crt"].mode == 0o644
    assert files_of(result, "tls") == {"key": FileContent(b"K", 0o440)}


def test_deferred_tokens_are_left_out_with_the_place_mode_and_owner_they_would_have() -> None:
    tokens = FakeTokens()
    sources = FakeSources(objects=[configmap("kube-root-ca.crt", {"ca.crt": "PEM"})])
    volume = kube_api_access()
    volume["projected"]["sources"][0]["serviceAccountToken"]["path"] = "./sa//token"
    result = resolve_volumes(
        pod(volumes=[volume], securityContext={"runAsUser": 7, "fsGroup": 9}),
        sources,
        token_source=tokens,
        node_allocatable=ALLOCATABLE,
        defer_tokens=True,
    )
    assert tokens.requests == []
    assert set(files_of(result, "kube-api-access")) == {"ca.crt", "namespace"}
    assert result.deferred_tokens == (
        TokenFile("kube-api-access", "sa/token", 0o640, 7, None, 3607),
    )
    assert result.token_expiry is None


def test_a_deferred_token_overwritten_by_a_later_source_is_not_deferred() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"token": "from-config"})])
    volume = {
        "name": "v",
        "projected": {
            "sources": [
                {"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "cfg"}},
            ]
        },
    }
    result = resolve_volumes(
        pod(volumes=[volume]),
        sources,
        token_source=None,
        node_allocatable=ALLOCATABLE,
        defer_tokens=True,
    )
    assert files_of(result)["token"].data == b"from-config"
    assert result.deferred_tokens == ()


def test_token_volume_fails_when_no_token_can_be_had() -> None:
    sources = FakeSources(objects=[configmap("kube-root-ca.crt", {"ca.crt": "x"})])
    without_source = resolve([kube_api_access()], sources)
    assert "not supported" in without_source.errors[0].message
    refused = resolve([kube_api_access()], sources, tokens=FakeTokens(fail=True))
    assert "failed to fetch token" in refused.errors[0].message


def test_projected_errors_are_aggregated_into_one_failed_mount() -> None:
    volume = {
        "name": "v",
        "projected": {
            "sources": [{"configMap": {"name": "gone"}}, {"secret": {"name": "also-gone"}}]
        },
    }
    (error,) = resolve([volume]).errors
    assert error.message == (
        'MountVolume.SetUp failed for volume "v" : '
        '[configmap "gone" not found, secret "also-gone" not found]'
    )


def test_later_projected_sources_overwrite_earlier_paths() -> None:
    sources = FakeSources(
        objects=[configmap("a", {"f": "from-a"})], secrets=[secret("b", {"f": "from-b"})]
    )
    volume = {
        "name": "v",
        "projected": {"sources": [{"configMap": {"name": "a"}}, {"secret": {"name": "b"}}]},
    }
    assert files_of(resolve([volume], sources))["f"].data == b"from-b"


def test_optional_cluster_trust_bundle_is_written_empty_and_mandatory_fails() -> None:
    optional = {
        "name": "v",
        "projected": {
            "sources": [
                {"clusterTrustBundle": {"signerName": "x/y", "path": "ca.pem", "optional": True}}
            ]
        },
    }
    assert files_of(resolve([optional])) == {"ca.pem": FileContent(b"", 0o644)}
    mandatory = {
        "name": "v",
        "projected": {"sources": [{"clusterTrustBundle": {"name": "b", "path": "ca.pem"}}]},
    }
    assert "clusterTrustBundle" in resolve([mandatory]).errors[0].message


def test_unknown_projected_sources_fail_the_mount() -> None:
    volume = {"name": "v", "projected": {"sources": [{"podCertificate": {"signerName": "x"}}]}}
    assert "podCertificate" in resolve([volume]).errors[0].message


def test_non_file_volumes_are_passed_through_as_declarations() -> None:
    volumes: list[dict[str, Any]] = [
        {"name": "scratch", "emptyDir": {}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "logs", "hostPath": {"path": "/var/log", "type": "Directory"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": "data-0"}},
        {"name": "bare"},
    ]
    result = resolve(volumes)
    assert result.ok
    assert result.volumes == (
        EmptyDirVolume("scratch"),
        EmptyDirVolume("shm", "Memory", "64Mi"),
        HostPathVolume("logs", "/var/log", "Directory"),
        OtherVolume("data", "persistentVolumeClaim", {"claimName": "data-0"}),
        EmptyDirVolume("bare"),
    )


def test_one_failing_volume_does_not_hide_the_others() -> None:
    volumes: list[dict[str, Any]] = [
        {"name": "bad", "configMap": {"name": "gone"}},
        {"name": "ok", "emptyDir": {}},
    ]
    result = resolve(volumes)
    assert [e.volume for e in result.errors] == ["bad"]
    assert [v.name for v in result.volumes] == ["ok"]
    assert not result.ok


@pytest.mark.parametrize("mode", [0o4755, -1, 0o1000, "0644", True])
def test_modes_outside_0_to_0777_are_refused(mode: Any) -> None:
    sources = FakeSources(objects=[configmap("cfg", {"a": "A"})])
    volume = {"name": "v", "configMap": {"name": "cfg", "defaultMode": mode}}
    assert "invalid file mode" in resolve([volume], sources).errors[0].message
