"""Orphans: containers with this instance's labels on a host that no replica of the backend
holds (a gateway that died between a start and its record). The backend sweeps a host once
``orphan_grace`` has passed after its first ``connect()``, and at each later (re)connection
of the host; a sweep stops and removes what it finds."""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from .container import LABEL
from .engine import EngineError
from .hosts import HostRecord

log = logging.getLogger(__name__)


async def sweep(host: HostRecord, labels: dict[str, str], stop_grace: float) -> None:
    """Stop (within ``stop_grace`` seconds) and remove the host's containers with ``labels``
    that no replica holds."""
    try:
        found = await host.client.containers(labels)
    except EngineError as exc:
        log.warning("docker host %s: orphans not listed: %s", host.name, exc.message)
        return
    held = {r.container for r in host.replicas.values()}
    orphans = [
        c
        for c in found
        if c["Id"] not in held
        # A start in progress holds its replica id before its container exists.
        and ((c.get("Labels") or {}).get(LABEL + "replica") not in host.replicas)
    ]
    await asyncio.gather(*(_remove(host, c, stop_grace) for c in orphans))


async def _remove(host: HostRecord, info: dict[str, Any], stop_grace: float) -> None:
    container, labels = info["Id"], info.get("Labels") or {}
    log.warning(
        "docker host %s: removing orphan container %.12s (service %s, replica %s)",
        host.name,
        container,
        labels.get(LABEL + "service"),
        labels.get(LABEL + "replica"),
    )
    try:
        if info.get("State") == "running":
            await host.client.stop(container, math.ceil(stop_grace))
        await host.client.remove(container)
    except EngineError as exc:
        log.warning("orphan container %.12s not removed: %s", container, exc.message)
