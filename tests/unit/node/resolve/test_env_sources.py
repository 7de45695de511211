"""envFrom / configMapKeyRef / secretKeyRef: precedence, optional vs mandatory, and the events."""

from __future__ import annotations

from typing import Any

import pytest

from vkubelet.node.resolve import (
    FAILED_TO_READ_MANDATORY_SECRET,
    FAILED_TO_READ_OPTIONAL_CONFIGMAP,
    INVALID_ENVIRONMENT_VARIABLE_NAMES,
    MANDATORY_CONFIGMAP_KEY_NOT_FOUND,
    MANDATORY_CONFIGMAP_NOT_FOUND,
    MANDATORY_SECRET_KEY_NOT_FOUND,
    MANDATORY_SECRET_NOT_FOUND,
    OPTIONAL_CONFIGMAP_KEY_NOT_FOUND,
    OPTIONAL_CONFIGMAP_NOT_FOUND,
    OPTIONAL_SECRET_KEY_NOT_FOUND,
    OPTIONAL_SECRET_NOT_FOUND,
    EnvResolutionError,
    EnvResult,
    resolve_env,
)

from .fakes import ALLOCATABLE, KUBERNETES, FakeSources, configmap, pod, secret


def resolve(container: dict[str, Any], sources: FakeSources, **kwargs: Any) -> EnvResult:
    return resolve_env(
        pod(containers=[container]), container, sources, node_allocatable=ALLOCATABLE, **kwargs
    )


def reasons(result: EnvResult | EnvResolutionError) -> list[str]:
    return [event.reason for event in result.events]


def key_ref(kind: str, name: str, key: str, *, optional: bool | None = None) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": name, "key": key}
    if optional is not None:
        ref["optional"] = optional
    return {kind: ref}


def test_env_from_config_map_and_secret_are_applied_with_their_prefix() -> None:
    sources = FakeSources(
        objects=[configmap("cfg", {"LOG_LEVEL": "debug", "mode": "fast"})],
        secrets=[secret("creds", {"PASSWORD": "hunter2"})],
    )
    container = {
        "name": "app",
        "envFrom": [
            {"configMapRef": {"name": "cfg"}, "prefix": "APP_"},
            {"secretRef": {"name": "creds"}},
        ],
    }
    env = resolve(container, sources).as_dict()
    assert env["APP_LOG_LEVEL"] == "debug"
    assert env["APP_mode"] == "fast"
    assert env["PASSWORD"] == "hunter2"


def test_later_env_from_overrides_earlier_and_env_overrides_env_from() -> None:
    sources = FakeSources(
        objects=[configmap("a", {"X": "from-a", "Y": "from-a"}), configmap("b", {"X": "from-b"})]
    )
    container = {
        "name": "app",
        "envFrom": [{"configMapRef": {"name": "a"}}, {"configMapRef": {"name": "b"}}],
        "env": [{"name": "Y", "value": "from-env"}],
    }
    env = resolve(container, sources).as_dict()
    assert env == {"X": "from-b", "Y": "from-env"}


def test_env_is_ordered_by_first_definition_then_unshadowed_service_links() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"B": "1", "A": "2"})], services=[KUBERNETES])
    container = {
        "name": "app",
        "envFrom": [{"configMapRef": {"name": "cfg"}}],
        "env": [
            {"name": "Z", "value": "z"},
            {"name": "B", "value": "redefined"},
            {"name": "KUBERNETES_SERVICE_HOST", "value": "override"},
        ],
    }
    result = resolve(container, sources)
    names = [name for name, _ in result.env]
    assert names[:4] == ["A", "B", "Z", "KUBERNETES_SERVICE_HOST"]
    assert names.count("KUBERNETES_SERVICE_HOST") == 1
    assert result.as_dict()["B"] == "redefined"
    assert result.as_dict()["KUBERNETES_SERVICE_HOST"] == "override"
    assert "KUBERNETES_SERVICE_PORT" in names[4:]


def test_empty_value_without_source_is_an_empty_variable() -> None:
    env = resolve({"name": "app", "env": [{"name": "EMPTY"}]}, FakeSources()).as_dict()
    assert env == {"EMPTY": ""}


def test_missing_optional_env_from_config_map_is_skipped_with_a_warning() -> None:
    container = {"name": "app", "envFrom": [{"configMapRef": {"name": "gone", "optional": True}}]}
    result = resolve(container, FakeSources())
    assert result.env == ()
    assert reasons(result) == [OPTIONAL_CONFIGMAP_NOT_FOUND]
    assert result.events[0].type == "Warning"
    assert "gone" in result.events[0].message


def test_missing_mandatory_env_from_config_map_fails_the_container() -> None:
    container = {"name": "app", "envFrom": [{"configMapRef": {"name": "gone"}}]}
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, FakeSources())
    assert caught.value.container == "app"
    assert "'app'" in str(caught.value)
    assert "shop/gone" in str(caught.value)
    assert reasons(caught.value) == [MANDATORY_CONFIGMAP_NOT_FOUND]


def test_missing_mandatory_env_from_secret_fails_the_container() -> None:
    container = {"name": "app", "envFrom": [{"secretRef": {"name": "gone"}}]}
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, FakeSources())
    assert reasons(caught.value) == [MANDATORY_SECRET_NOT_FOUND]


def test_missing_optional_config_map_key_skips_the_variable() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"OTHER": "x"})])
    container = {
        "name": "app",
        "env": [
            {"name": "LEVEL", "valueFrom": key_ref("configMapKeyRef", "cfg", "lvl", optional=True)}
        ],
    }
    result = resolve(container, sources)
    assert "LEVEL" not in result.as_dict()
    assert reasons(result) == [OPTIONAL_CONFIGMAP_KEY_NOT_FOUND]


def test_missing_optional_config_map_skips_the_variable() -> None:
    container = {
        "name": "app",
        "env": [{"name": "L", "valueFrom": key_ref("configMapKeyRef", "gone", "k", optional=True)}],
    }
    result = resolve(container, FakeSources())
    assert result.env == ()
    assert reasons(result) == [OPTIONAL_CONFIGMAP_NOT_FOUND]


def test_missing_mandatory_config_map_key_fails_naming_container_and_variable() -> None:
    sources = FakeSources(objects=[configmap("cfg", {})])
    container = {
        "name": "app",
        "env": [{"name": "LEVEL", "valueFrom": key_ref("configMapKeyRef", "cfg", "lvl")}],
    }
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, sources)
    assert caught.value.variable == "env var 'LEVEL'"
    assert "'app'" in str(caught.value)
    assert "LEVEL" in str(caught.value)
    assert "lvl" in str(caught.value)
    assert reasons(caught.value) == [MANDATORY_CONFIGMAP_KEY_NOT_FOUND]


def test_secret_key_ref_is_base64_decoded() -> None:
    sources = FakeSources(secrets=[secret("creds", {"password": "s3cr3t\n"})])
    container = {
        "name": "app",
        "env": [{"name": "PW", "valueFrom": key_ref("secretKeyRef", "creds", "password")}],
    }
    assert resolve(container, sources).as_dict() == {"PW": "s3cr3t\n"}


@pytest.mark.parametrize(
    ("raw", "problem"),
    [(b"\xff\xfehunter2", "is not valid UTF-8"), (b"hunter2\x00tail", "contains a NUL byte")],
)
def test_secret_value_no_environment_can_hold_fails_permanently_naming_the_key_not_the_value(
    raw: bytes, problem: str
) -> None:
    sources = FakeSources(secrets=[secret("creds", {"blob": raw})])
    container = {
        "name": "app",
        "env": [{"name": "B", "valueFrom": key_ref("secretKeyRef", "creds", "blob")}],
    }
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, sources)
    assert caught.value.permanent
    message = str(caught.value)
    assert f"secret \"shop/creds\" key 'blob': value {problem}" in message
    assert "hunter2" not in message
    assert all("hunter2" not in event.message for event in caught.value.events)


def test_secret_in_env_from_with_an_unusable_value_fails_naming_that_key() -> None:
    sources = FakeSources(secrets=[secret("creds", {"good": "ok", "bad": b"\xc3\x28"})])
    container = {"name": "app", "envFrom": [{"secretRef": {"name": "creds"}}]}
    with pytest.raises(EnvResolutionError, match="key 'bad': value is not valid UTF-8") as caught:
        resolve(container, sources)
    assert caught.value.permanent


def test_an_unusable_secret_key_the_container_does_not_read_is_ignored() -> None:
    sources = FakeSources(secrets=[secret("creds", {"good": "ok", "bad": b"\xff"})])
    container = {
        "name": "app",
        "env": [{"name": "G", "valueFrom": key_ref("secretKeyRef", "creds", "good")}],
    }
    assert resolve(container, sources).as_dict()["G"] == "ok"


@pytest.mark.parametrize(
    ("secrets", "optional", "expected"),
    [
        ([], True, OPTIONAL_SECRET_NOT_FOUND),
        ([secret("creds", {})], True, OPTIONAL_SECRET_KEY_NOT_FOUND),
    ],
)
def test_missing_optional_secret_or_key_skips_the_variable(
    secrets: list[dict[str, Any]], optional: bool, expected: str
) -> None:
    container = {
        "name": "app",
        "env": [{"name": "PW", "valueFrom": key_ref("secretKeyRef", "creds", "pw", optional=True)}],
    }
    result = resolve(container, FakeSources(secrets=secrets))
    assert result.env == ()
    assert reasons(result) == [expected]


@pytest.mark.parametrize(
    ("secrets", "expected"),
    [([], MANDATORY_SECRET_NOT_FOUND), ([secret("creds", {})], MANDATORY_SECRET_KEY_NOT_FOUND)],
)
def test_missing_mandatory_secret_or_key_fails_the_container(
    secrets: list[dict[str, Any]], expected: str
) -> None:
    container = {
        "name": "app",
        "env": [{"name": "PW", "valueFrom": key_ref("secretKeyRef", "creds", "pw")}],
    }
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, FakeSources(secrets=secrets))
    assert reasons(caught.value) == [expected]
    assert "PW" in str(caught.value)


def test_unreadable_optional_config_map_still_fails_the_container_like_the_kubelet() -> None:
    sources = FakeSources(unreadable={("ConfigMap", "cfg")})
    container = {"name": "app", "envFrom": [{"configMapRef": {"name": "cfg", "optional": True}}]}
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, sources)
    assert reasons(caught.value) == [FAILED_TO_READ_OPTIONAL_CONFIGMAP]
    assert "connection refused" in str(caught.value)


def test_unreadable_mandatory_secret_fails_the_container() -> None:
    sources = FakeSources(unreadable={("Secret", "creds")})
    container = {
        "name": "app",
        "env": [{"name": "PW", "valueFrom": key_ref("secretKeyRef", "creds", "pw")}],
    }
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, sources)
    assert reasons(caught.value) == [FAILED_TO_READ_MANDATORY_SECRET]


def test_secret_that_does_not_decode_counts_as_unreadable() -> None:
    broken = {"metadata": {"name": "creds", "namespace": "shop"}, "data": {"pw": "not base64!"}}
    container = {"name": "app", "envFrom": [{"secretRef": {"name": "creds"}}]}
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, FakeSources(secrets=[broken]))
    assert reasons(caught.value) == [FAILED_TO_READ_MANDATORY_SECRET]


def test_events_before_the_failure_are_kept_on_the_error() -> None:
    container = {
        "name": "app",
        "envFrom": [
            {"configMapRef": {"name": "maybe", "optional": True}},
            {"secretRef": {"name": "must"}},
        ],
    }
    with pytest.raises(EnvResolutionError) as caught:
        resolve(container, FakeSources())
    assert reasons(caught.value) == [OPTIONAL_CONFIGMAP_NOT_FOUND, MANDATORY_SECRET_NOT_FOUND]


def test_env_from_keys_the_runtime_cannot_take_are_skipped_with_an_event() -> None:
    hostile = {
        "metadata": {"name": "cfg", "namespace": "shop"},
        "data": {"GOOD": "1", "dashed-key.ok": "2", "BAD=KEY": "3", "TAB\tKEY": "4"},
    }
    container = {"name": "app", "envFrom": [{"configMapRef": {"name": "cfg"}}]}
    result = resolve(container, FakeSources(objects=[hostile]))
    assert result.as_dict() == {"GOOD": "1", "dashed-key.ok": "2"}
    assert reasons(result) == [INVALID_ENVIRONMENT_VARIABLE_NAMES]
    assert "BAD=KEY" in result.events[0].message


def test_a_config_map_referenced_many_times_is_read_once_per_container() -> None:
    sources = FakeSources(objects=[configmap("cfg", {"A": "1", "B": "2"})])
    container = {
        "name": "app",
        "envFrom": [{"configMapRef": {"name": "cfg"}}],
        "env": [
            {"name": "X", "valueFrom": key_ref("configMapKeyRef", "cfg", "A")},
            {"name": "Y", "valueFrom": key_ref("configMapKeyRef", "cfg", "B")},
        ],
    }
    assert resolve(container, sources).as_dict()["Y"] == "2"
    assert sources.reads == [("ConfigMap", "shop", "cfg")]


def test_file_key_ref_is_refused_rather_than_silently_empty() -> None:
    container = {
        "name": "app",
        "env": [
            {"name": "F", "valueFrom": {"fileKeyRef": {"volumeName": "v", "path": "e", "key": "k"}}}
        ],
    }
    with pytest.raises(EnvResolutionError, match="fileKeyRef"):
        resolve(container, FakeSources())


def test_env_list_output_is_a_container_env_field() -> None:
    result = resolve({"name": "app", "env": [{"name": "A", "value": "1"}]}, FakeSources())
    assert result.as_env_list() == [{"name": "A", "value": "1"}]


def test_malformed_container_specs_do_not_crash_resolution() -> None:
    container: dict[str, Any] = {
        "name": "app",
        "envFrom": [None, "x", {"configMapRef": "cfg"}],
        "env": [None, {"name": "A", "value": 3}, {"name": "B", "valueFrom": "nope"}],
    }
    assert resolve(container, FakeSources()).as_dict() == {"A": "", "B": ""}
