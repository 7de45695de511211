"""vkubelet: a virtual kubelet in Python. Kubernetes API on top, programmable back.

The public API is the provider SDK, re-exported here from `vkubelet.sdk`: a provider needs
nothing else (`from vkubelet import ResolvedPod, ProviderError, ...`). Modules whose names start
with `_` are private; `vkubelet.node` (the agent's controllers), `vkubelet.kubelet` (the kubelet
API server) and `vkubelet.agent` are the agent's own, not for providers.
"""

from .sdk import *  # noqa: F403 - the facade re-exports the SDK as it is
from .sdk import __all__ as _sdk_all

__version__ = "0.1.0"

__all__ = ["__version__", *_sdk_all]
