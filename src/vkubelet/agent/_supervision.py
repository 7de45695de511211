"""Node agents run supervised: a node that crashes is logged and restarted with back-off, and
never takes the process or the other nodes with it."""

from __future__ import annotations

import asyncio
import logging

from ..node import NodeAgent
from ..sdk.tasks import run_supervised

log = logging.getLogger(__name__)


async def run_node(node: NodeAgent, *, delay: float = 0.0) -> None:
    """Run one node agent forever (restarted when it fails), after `delay` seconds."""
    await asyncio.sleep(delay)
    await run_supervised(node.run, name=f"node {node.settings.name}", logger=log)
