"""The VM controller's leader election: the shared elector (`vkubelet.kube`) over the
controller's lightkube client."""

from __future__ import annotations

from typing import Any, Final, cast

from lightkube import AsyncClient
from lightkube.core.exceptions import ApiError
from lightkube.resources.coordination_v1 import Lease

from ..kube import LeaderElector, LeaseConflict, LeaseTiming

__all__ = ["LEASE_NAME", "LeaderElector", "LeaseTiming", "LightkubeLeases"]

LEASE_NAME: Final = "vkubelet-vm-controller"

JSON = dict[str, Any]


class LightkubeLeases:
    """`LeaseStore` over a lightkube client."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def get(self, namespace: str, name: str) -> JSON | None:
        try:
            lease = await self._client.get(Lease, name, namespace=namespace)
        except ApiError as e:
            if e.status.code == 404:
                return None
            raise
        return cast(JSON, lease.to_dict())

    async def create(self, lease: JSON) -> JSON:
        try:
            stored = await self._client.create(cast(Lease, Lease.from_dict(lease)))
            return cast(JSON, stored.to_dict())
        except ApiError as e:
            if e.status.code == 409:
                raise LeaseConflict(str(e)) from e
            raise

    async def replace(self, lease: JSON) -> JSON:
        try:
            stored = await self._client.replace(cast(Lease, Lease.from_dict(lease)))
            return cast(JSON, stored.to_dict())
        except ApiError as e:
            if e.status.code == 409:
                raise LeaseConflict(str(e)) from e
            raise
