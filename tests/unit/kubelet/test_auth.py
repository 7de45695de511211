"""The webhook authenticator and authorizer: what they send, what they cache, how they fail."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from vkubelet.kube import ApiError, KubeClient
from vkubelet.kubelet import (
    Attributes,
    AuthenticationError,
    Credentials,
    KubeletAuth,
    ReviewClient,
    SubjectAccessReviewAuthorizer,
    TokenReviewAuthenticator,
    UnionAuthenticator,
    UserInfo,
    X509Authenticator,
    request_attributes,
)


class FakeApi:
    """Answers TokenReviews and SubjectAccessReviews from tables; records the requests."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.tokens: dict[str, dict[str, Any]] = {}
        self.allowed: set[tuple[str, str]] = set()  # (user, subresource)
        self.fail = False

    async def create(self, path: str, body: Any) -> dict[str, Any]:
        self.requests.append((path, body))
        if self.fail:
            raise ApiError(500, "InternalError", "etcd is on fire")
        spec = body["spec"]
        if body["kind"] == "TokenReview":
            user = self.tokens.get(spec["token"])
            if user is None:
                return {"status": {"authenticated": False, "error": "invalid bearer token"}}
            return {"status": {"authenticated": True, "user": user}}
        key = (spec["user"], spec["resourceAttributes"]["subresource"])
        return {"status": {"allowed": key in self.allowed, "reason": "test table"}}


def _kube_client_is_a_review_client(client: KubeClient) -> ReviewClient:
    return client  # checked by mypy: the real client fits the protocol


async def test_token_review_request_and_user() -> None:
    api = FakeApi()
    api.tokens["t1"] = {"username": "alice", "uid": "42", "groups": ["devs"], "extra": {"k": ["v"]}}
    authenticator = TokenReviewAuthenticator(api, audiences=("https://kubernetes.default.svc",))
    user = await authenticator.authenticate(Credentials(bearer_token="t1"))
    assert user == UserInfo("alice", "42", ("devs", "system:authenticated"), {"k": ("v",)})
    path, body = api.requests[0]
    assert path == "/apis/authentication.k8s.io/v1/tokenreviews"
    assert body == {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": "t1", "audiences": ["https://kubernetes.default.svc"]},
    }


async def test_token_reviews_are_cached_and_rejections_too() -> None:
    api = FakeApi()
    api.tokens["t1"] = {"username": "alice"}
    authenticator = TokenReviewAuthenticator(api)
    for _ in range(3):
        await authenticator.authenticate(Credentials(bearer_token="t1"))
        with pytest.raises(AuthenticationError, match="invalid bearer token"):
            await authenticator.authenticate(Credentials(bearer_token="bad"))
    assert len(api.requests) == 2


async def test_token_review_errors_are_not_cached() -> None:
    api = FakeApi()
    api.fail = True
    authenticator = TokenReviewAuthenticator(api)
    for _ in range(2):
        with pytest.raises(AuthenticationError, match="etcd is on fire"):
            await authenticator.authenticate(Credentials(bearer_token="t1"))
    assert len(api.requests) == 2


async def test_token_cache_is_bounded() -> None:
    api = FakeApi()
    authenticator = TokenReviewAuthenticator(api, max_entries=2)
    for token in ("a", "b", "c", "a"):
        with pytest.raises(AuthenticationError):
            await authenticator.authenticate(Credentials(bearer_token=token))
    assert len(api.requests) == 4  # "a" was evicted by "c"


async def test_x509_user_is_cn_and_groups_are_o() -> None:
    cert = {
        "subject": (
            (("organizationName", "system:nodes"),),
            (("organizationName", "ops"),),
            (("commonName", "system:node:n1"),),
        )
    }
    user = await X509Authenticator().authenticate(Credentials(peer_certificate=cert))
    assert user == UserInfo(
        "system:node:n1", groups=("system:nodes", "ops", "system:authenticated")
    )
    assert await X509Authenticator().authenticate(Credentials()) is None


async def test_union_prefers_the_certificate_and_keeps_anonymous_off_by_default() -> None:
    api = FakeApi()
    api.tokens["t1"] = {"username": "alice"}
    union = UnionAuthenticator(X509Authenticator(), TokenReviewAuthenticator(api))
    cert = {"subject": ((("commonName", "apiserver"),),)}
    both = Credentials(peer_certificate=cert, bearer_token="t1")
    assert (await union.authenticate(both)) == UserInfo(
        "apiserver", groups=("system:authenticated",)
    )
    assert api.requests == []
    assert await union.authenticate(Credentials()) is None
    union.allow_anonymous = True
    anonymous = await union.authenticate(Credentials())
    assert anonymous is not None and anonymous.name == "system:anonymous"


async def test_subject_access_review_request_and_caching() -> None:
    api = FakeApi()
    api.allowed.add(("alice", "stats"))
    authorizer = SubjectAccessReviewAuthorizer(api)
    alice = UserInfo("alice", "7", ("devs",), {"scopes": ("a",)})
    stats = request_attributes("GET", "/stats/summary", "n1")
    for _ in range(2):
        assert (await authorizer.authorize(alice, stats)).allowed
    proxy = request_attributes("POST", "/exec/ns/p/c", "n1")
    for _ in range(2):
        assert not (await authorizer.authorize(alice, proxy)).allowed
    assert len(api.requests) == 2
    path, body = api.requests[0]
    assert path == "/apis/authorization.k8s.io/v1/subjectaccessreviews"
    assert body["spec"] == {
        "user": "alice",
        "uid": "7",
        "groups": ["devs"],
        "extra": {"scopes": ["a"]},
        "resourceAttributes": {
            "verb": "get",
            "group": "",
            "version": "v1",
            "resource": "nodes",
            "subresource": "stats",
            "name": "n1",
        },
    }


@pytest.mark.parametrize(
    ("method", "path", "verb", "subresource"),
    [
        ("GET", "/stats/summary", "get", "stats"),
        ("GET", "/stats", "get", "stats"),
        ("GET", "/metrics", "get", "metrics"),
        ("GET", "/metrics/resource", "get", "metrics"),
        ("GET", "/metricsfoo", "get", "proxy"),
        ("GET", "/logs/kubelet.log", "get", "log"),
        ("GET", "/containerLogs/ns/p/c", "get", "proxy"),
        ("POST", "/exec/ns/p/c", "create", "proxy"),
        ("PUT", "/pods", "update", "proxy"),
        ("PATCH", "/pods", "patch", "proxy"),
        ("DELETE", "/pods", "delete", "proxy"),
    ],
)
def test_request_attributes_follow_the_kubelet(
    method: str, path: str, verb: str, subresource: str
) -> None:
    assert request_attributes(method, path, "n1") == Attributes(verb, "n1", subresource, path)


async def test_insecure_mode_warns_loudly_and_allows_anyone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        auth = KubeletAuth.insecure_allow_all()
    assert "DISABLED" in caplog.text
    user = await auth.authenticator.authenticate(Credentials())
    assert user is not None
    assert (await auth.authorizer.authorize(user, request_attributes("GET", "/pods", "n"))).allowed
