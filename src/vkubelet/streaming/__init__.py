"""Client-side streaming: exec, attach and port-forward against another apiserver or kubelet.

A relay (the cluster provider: a whole lower cluster shown as one node) must carry
`kubectl exec/attach/port-forward/cp` on an upper pod through to the lower pod. This package is
the lower half: it opens the upgraded connection with the credentials of a kubeconfig and speaks
the same protocols kubectl does, on the sans-I/O cores in `vkubelet.protocols` that the kubelet
server uses for the other side.

    endpoint = Endpoint.from_kubeconfig("lower.kubeconfig")
    code = await exec_command(endpoint, "ns", "pod", "ctr", ["sh", "-c", "..."], io)
    await attach(endpoint, "ns", "pod", "ctr", io)
    await port_forward(endpoint, "ns", "pod", 8080, stream)

`io` is the `AttachIO` and `stream` the `ByteStream` a provider receives from the upper
kubelet, so a relay passes them straight on. Transports, as kubectl 1.31+ chooses them:
exec/attach try a WebSocket (``v5.channel.k8s.io``) and fall back to SPDY/3.1; port-forward
tries SPDY tunnelled in a WebSocket, then SPDY directly (a kubelet: SPDY only). Memory stays
bounded whatever the transfer: a slow reader stops the socket being read, never buffers it.

Errors: `UpgradeFailed` when the server refuses (``status`` 404 with ``pods "x" not found``, 400
for an unknown container, 401/403), `RemoteCommandError` when a command cannot run,
`PortForwardError` with the far side's message, `StreamingError` (the base) for the rest.
"""

from ._connect import Endpoint
from ._errors import (
    PortForwardError,
    RemoteCommandError,
    StreamingError,
    UpgradeFailed,
)
from ._exec import Transport, attach, exec_command
from ._portforward import ForwardedConnection, PortForwardSession, port_forward

__all__ = [
    "Endpoint",
    "ForwardedConnection",
    "PortForwardError",
    "PortForwardSession",
    "RemoteCommandError",
    "StreamingError",
    "Transport",
    "UpgradeFailed",
    "attach",
    "exec_command",
    "port_forward",
]
