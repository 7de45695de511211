"""A configurable fake node: pods "run" in memory. For trying vkubelet out, tests and benchmarks.

The config file is compatible with the Go reference's mock provider (see `_config`), plus options
of our own: a start delay, a failure ratio, a pod CIDR, a state file that makes the fake backend
outlive the agent, and a file whose existence makes the provider unhealthy.

Every kubectl verb works against the mock, so that each can be tested end to end:

- `kubectl exec` runs a small set of built-in commands (`MockProvider.exec_in_container` lists
  them, including a little `sh` and the `tar` that `kubectl cp` needs) against an in-memory
  filesystem per container, created on first use and seeded with the pod's volume files at
  their mount paths. Service-account tokens are requested then (`TokensOnDemand`), not at
  every start: a TokenRequest costs the apiserver about what the pod's status write does, and
  most mock pods are never exec'd into. With `-t` a line discipline echoes what is typed, ^C
  interrupts and the window size is tracked (`stty size`). Nothing there outlives the agent.
- `kubectl attach` reaches a "main process" that echoes stdin upper-cased.
- `kubectl port-forward` connects to the port on 127.0.0.1: the mock's pods "are" the host.
- `kubectl logs -f` prints `mock: tick N` every second until the pod stops.
- `/stats/summary` and `/metrics/resource` report deterministic, plausible usage.

The modules: `_provider` (lifecycle, node, status, persistence), `_config`, `_records` (what is
kept of a pod), `_fs` (a container's files), `_terminal` (session stdio, the pty), `_syntax` and
`_shell` (the little shell and its commands), `_tar`, `_streams` (logs, attach, port-forward)
and `_stats` (stats summary and resource metrics).
"""

from ...sdk import ConfigError
from ._config import MockConfig
from ._fs import FILESYSTEM_LIMIT
from ._provider import FAIL_ANNOTATION, PRINT_ENV_ANNOTATION, MockProvider, create

__all__ = [
    "FAIL_ANNOTATION",
    "FILESYSTEM_LIMIT",
    "PRINT_ENV_ANNOTATION",
    "ConfigError",
    "MockConfig",
    "MockProvider",
    "create",
]
