"""Two vm nodes on this machine (two hypervisor hosts, as far as the cluster can tell): two
agents against one cluster, each with its own state directory, pod CIDR and node address.

Their pod networks cannot collide: every netns and link name is derived from the pod's UID
(cluster-unique), each node routes its own CIDR (and the /32 of a VM that moved to it from the
other: both share `SHARED`, so a VM keeps its address), and the gateway address each node puts
on its host links is the first of its own CIDR. What one machine does share is the host's
routing table, so the two CIDRs must differ (they do: one random /24 each).

Started once per test session, as the dev cluster and the guest image are, and lent to one
module at a time (`vm_node_pair`). Both fixtures are registered in this folder's conftest.py (a
session fixture imported into each test module would be one per module again), and
tests/parallel.py runs every test that uses the pair in one worker. Between modules both nodes
are cordoned: another module's unpinned VM (the VirtualMachine tests let the scheduler place
theirs) never lands on them. A module that stops an agent starts it again; should it fail
before, the next module starts it.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vkubelet.devcluster import Cluster
from vkubelet.testing import AgentProcess, Kubectl, local_test_address, node_ready, wait_for

from .vmlab import clean_up, require_vm_host, start_vm_agent

SHARED = "10.212.0.0/16"  # both nodes' /24s: the range whose addresses a moved VM keeps


@dataclass
class VMNode:
    name: str
    agent: AgentProcess
    workdir: Path
    cidr: str
    address: str

    @property
    def state(self) -> Path:
        return self.workdir / "state"

    def qemu_pid(self, pod_uid: str) -> int | None:
        """The pid of a pod's QEMU, from its machine's pid file."""
        with contextlib.suppress(OSError, ValueError):
            return int((self.state / "vms" / pod_uid / "m" / "pid").read_text().split()[0])
        return None


@pytest.fixture(scope="session")
def session_vm_nodes(
    kube_cluster: Cluster, kubectl: Kubectl, vm_guest_image: Path
) -> Iterator[tuple[VMNode, VMNode]]:
    """hv-1 and hv-2 (names with a random suffix), both Ready, for the session."""
    require_vm_host()
    suffix = uuid.uuid4().hex[:5]
    thirds = random.sample(range(1, 250), 2)
    nodes: list[VMNode] = []
    with contextlib.ExitStack() as stack:
        try:
            for index, third in enumerate(thirds, start=1):
                # Short: QEMU's unix sockets live below it (108-byte limit).
                workdir = Path(tempfile.mkdtemp(prefix=f"vkmg{index}-", dir="/tmp"))
                name = f"hv-{index}-{suffix}"
                cidr = f"10.212.{third}.0/24"
                address = stack.enter_context(local_test_address())
                agent = start_vm_agent(
                    kube_cluster, workdir, name=name, address=address, cidr=cidr,
                    image=vm_guest_image, sharedPodCIDRs=[SHARED],
                )  # fmt: skip
                nodes.append(VMNode(name, agent, workdir, cidr, address))
            for node in nodes:
                wait_for(
                    lambda node=node: node_ready(kubectl, node.name),  # type: ignore[misc]
                    timeout=90,
                    what=f"node {node.name} Ready",
                )
            yield nodes[0], nodes[1]
        finally:
            for node in nodes:
                node.agent.stop()
                clean_up(node.state, node.cidr)
                kubectl("delete", "node", node.name, "--ignore-not-found", "--wait=false")
                shutil.rmtree(node.workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def vm_node_pair(
    session_vm_nodes: tuple[VMNode, VMNode], kubectl: Kubectl
) -> Iterator[tuple[VMNode, VMNode]]:
    """The session's hv-1 and hv-2, both agents running and both nodes Ready and schedulable
    for this module; cordoned again after it."""
    for node in session_vm_nodes:
        if not node.agent.running:  # an earlier module failed between an agent's stop and start
            node.agent.start()
        wait_for(
            lambda node=node: node_ready(kubectl, node.name),  # type: ignore[misc]
            timeout=90,
            what=f"node {node.name} Ready",
        )
        kubectl("uncordon", node.name)
    try:
        yield session_vm_nodes
    finally:
        for node in session_vm_nodes:
            kubectl("cordon", node.name, check=False)
