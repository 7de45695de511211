"""The vm integration modules' shared fixtures: the session's pair of vm nodes (twonodes.py)."""

from .twonodes import session_vm_nodes, vm_node_pair

__all__ = ["session_vm_nodes", "vm_node_pair"]
