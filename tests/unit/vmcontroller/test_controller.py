"""The controller process on the fake apiserver: it takes the Lease, a VirtualMachine's watch
event makes its pod, and a change of that pod (not the requeue timer) updates the VM's status."""

from __future__ import annotations

import asyncio
from typing import Any

from vkubelet.testing.fakeapi import FakeApiServer
from vkubelet.testing.harness import cancel_and_wait, eventually
from vkubelet.vmcontroller import NAME_LABEL, ControllerConfig, run_controller
from vkubelet.vmcontroller._controller import LEASE_NAME

VM = {
    "metadata": {"name": "db", "namespace": "ns", "generation": 1},
    "spec": {
        "replicas": 1,
        "template": {
            "metadata": {"labels": {"app": "db"}},
            "spec": {"containers": [{"name": "vm", "image": "vm.vkubelet.io/tiny"}]},
        },
    },
}


def _phase(api: FakeApiServer) -> Any:
    vm = api.get("virtualmachines", "db", "ns")
    return ((vm or {}).get("status") or {}).get("phase")


async def test_the_leader_makes_the_vm_s_pod_and_follows_its_changes() -> None:
    api = FakeApiServer()
    client = api.client()
    task = asyncio.create_task(run_controller(client, ControllerConfig(identity="controller-1")))
    try:
        lease = await eventually(lambda: api.get("leases", LEASE_NAME, "kube-system") or {})
        assert lease["spec"]["holderIdentity"] == "controller-1"
        api.create("virtualmachines", VM)
        (pod,) = await eventually(lambda: api.objects("pods", "ns"))
        assert pod["metadata"]["labels"][NAME_LABEL] == "db"
        await eventually(lambda: _phase(api) == "Starting")
        running = {"name": "vm", "state": {"running": {}}}
        status = {"phase": "Running", "containerStatuses": [running]}
        api.patch("pods", pod["metadata"]["name"], {"status": status}, "ns", subresource="status")
        # Sooner than the 5 s the reconciler asks to look again while a VM starts.
        await eventually(lambda: _phase(api) == "Running", within=3)
        assert len(api.objects("pods", "ns")) == 1
    finally:
        await cancel_and_wait(task)
        await client.aclose()
