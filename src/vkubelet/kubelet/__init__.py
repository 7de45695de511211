"""The kubelet HTTPS API of virtual nodes: logs, exec, attach, port-forward, stats, metrics.

The apiserver reaches a node's kubelet port for `kubectl logs/exec/attach/port-forward/cp/top`
and for `nodes/<name>/proxy/...`. This package serves that port with asyncio only: h11 for
HTTP/1.1, the sans-I/O SPDY/3.1 and channel cores of `vkubelet.protocols` for the streaming
verbs (wsproto for WebSocket), and the kubelet's webhook authentication and authorization.
What each verb does is up to the node's provider (`vkubelet.sdk.capabilities`).

Typical use, one server per port for all of an agent's nodes::

    context = server_ssl_context("kubelet.crt", "kubelet.key", client_ca_file="ca.crt")
    auth = KubeletAuth.webhook(kube_client)
    servers = serve_nodes(
        [KubeletNode(name, provider, pods=pod_cache, port=10250, addresses=(ip,)) ...],
        ssl_context=context,
        auth=auth,
    )
    for server in servers:
        await server.start()
"""

from ._auth import (
    AllowAnyone,
    AlwaysAllow,
    Attributes,
    AuthenticationError,
    Authenticator,
    Authorizer,
    Credentials,
    Decision,
    KubeletAuth,
    ReviewClient,
    SubjectAccessReviewAuthorizer,
    TokenReviewAuthenticator,
    UnionAuthenticator,
    UserInfo,
    X509Authenticator,
    request_attributes,
)
from ._context import KubeletNode, ServerConfig
from ._http import Exchange, HttpLimits, serve_connection
from ._logs import log_options
from ._server import KubeletServer, match_route, serve_nodes
from ._tls import server_ssl_context

__all__ = [
    "AllowAnyone",
    "AlwaysAllow",
    "Attributes",
    "AuthenticationError",
    "Authenticator",
    "Authorizer",
    "Credentials",
    "Decision",
    "Exchange",
    "HttpLimits",
    "KubeletAuth",
    "KubeletNode",
    "KubeletServer",
    "ReviewClient",
    "ServerConfig",
    "SubjectAccessReviewAuthorizer",
    "TokenReviewAuthenticator",
    "UnionAuthenticator",
    "UserInfo",
    "X509Authenticator",
    "log_options",
    "match_route",
    "request_attributes",
    "serve_connection",
    "serve_nodes",
    "server_ssl_context",
]
