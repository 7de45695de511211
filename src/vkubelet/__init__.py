"""vkubelet: a virtual kubelet in Python. Kubernetes API on top, programmable back.

The public API is re-exported here; modules whose names start with `_` are private.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
