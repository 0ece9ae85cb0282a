"""A feed of the keys under one etcd prefix: loaded whole, then watched (never polled).

``Feed.run`` hands the keys as they are (``on_load``, once and after each compaction), then
each change in revision order (``on_change``). With etcd unreachable it hands nothing (what
the owner knows stays as it is) and tries again, doubling its pause; when etcd answers it
resumes the watch after the last revision seen, so nothing is missed and nothing is read
twice, or loads everything again when that revision was compacted away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Literal

from controller.etcd import Compacted, EtcdClient, EtcdError, EtcdUnavailable

log = logging.getLogger(__name__)

RETRY = (0.1, 2.0)
"""The first and the longest pause before trying etcd again (doubling in between)."""

Status = Literal["starting", "watching", "unreachable", "stopped"]
"""``watching``: loaded and the watch asked for; ``unreachable``: the last call failed."""


class Feed:
    """The keys under ``prefix`` (bytes), named by what follows the prefix."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: bytes,
        on_load: Callable[[dict[str, bytes]], object],
        on_change: Callable[[str, bytes | None], object],
        *,
        on_status: Callable[[Status], object] | None = None,
        retry: tuple[float, float] = RETRY,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.on_load = on_load
        """Every key's value now (the owner forgets the keys not in it)."""
        self.on_change = on_change
        """One key's new value, None when it was deleted."""
        self.on_status = on_status
        self.retry = retry
        self.status: Status = "starting"
        self.revision = 0
        """The etcd revision the keys are known at (0: not loaded yet)."""
        self.requests = 0
        """etcd requests made: loads and watches opened."""
        self.loaded = asyncio.Event()
        """Set once the keys were loaded (``on_load`` called), and from then on."""

    def set_status(self, status: Status) -> None:
        if status != self.status:
            self.status = status
            if self.on_status is not None:
                self.on_status(status)

    def _name(self, key: bytes) -> str:
        return key[len(self.prefix) :].decode()

    async def run(self) -> None:
        """Load (unless loaded before: then resume the watch), watch; never returns."""
        pause = self.retry[0]
        load = not self.revision
        while True:
            try:
                if load:
                    self.requests += 1
                    kvs, revision = await self.client.get(self.prefix, prefix=True)
                    self.on_load({self._name(kv.key): kv.value for kv in kvs})
                    self.revision = revision
                    self.loaded.set()
                    load = False
                self.requests += 1
                watch = self.client.watch(
                    self.prefix, prefix=True, start_revision=self.revision + 1
                )
                self.set_status("watching")
                pause = self.retry[0]
                async for events in watch:
                    for event in events:
                        value = None if event.type == "DELETE" else event.kv.value
                        self.on_change(self._name(event.kv.key), value)
                        self.revision = max(self.revision, event.kv.mod_revision)
            except Compacted:
                log.info("%s: revision %d compacted, loading again", self.prefix, self.revision)
                load = True
            except (EtcdUnavailable, EtcdError) as exc:
                self.set_status("unreachable")
                log.warning("%s: etcd: %s; again in %.1f s", self.prefix, exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, self.retry[1])

    def __repr__(self) -> str:
        return (
            f"<Feed {self.prefix!r} {self.status} revision={self.revision} "
            f"requests={self.requests}>"
        )
