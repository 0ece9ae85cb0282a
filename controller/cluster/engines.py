"""The Docker Engines of a cluster: the leader alone talks to them.

Each term of a node as leader has a Docker backend of its own (``open``), made with the
cluster's id as its instance label, connected before the state is restored (so adoption finds
every container of the cluster by its labels, whoever started it), and closed when the term
ends: the containers keep running for the next leader to adopt. A node that follows talks to
no engine, so it never sweeps the leader's containers as orphans.

The cluster's id is the key ``<prefix>cluster``, written once by the first node that needs it
(a transaction: put if absent) and read by every later one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from controller.errors import StoreUnavailable
from controller.etcd import Compare, EtcdClient, EtcdError, EtcdUnavailable, Get, Put

if TYPE_CHECKING:
    from controller.backends.docker import DockerBackend

__all__ = ["Engines", "cluster_id"]


async def cluster_id(client: EtcdClient, prefix: str) -> str:
    """The cluster's id: read, or made now if no node made it yet. Raises StoreUnavailable."""
    key = f"{prefix}cluster".encode()
    made = uuid.uuid4().hex.encode()
    try:
        result = await client.txn(
            [Compare(key, "CREATE", "EQUAL", 0)], [Put(key, made)], [Get(key)]
        )
    except (EtcdUnavailable, EtcdError) as e:
        raise StoreUnavailable(f"the cluster's id not read: {e}") from e
    if result.succeeded:
        return made.decode()
    return result.ranges[0][0].value.decode()


class Engines:
    """The Docker backend of the current term (``current``: empty while following)."""

    def __init__(
        self, client: EtcdClient, prefix: str, make: Callable[[str], DockerBackend]
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.make = make
        """A new Docker backend labelling its containers with the given instance id."""
        self.current: list[DockerBackend] = []
        """The backend of this term, if the node leads (a list: the metrics read it)."""

    async def open(self) -> DockerBackend:
        """The backend for a term that begins, connected: each engine answered, or its
        ``connect`` wait passed (an engine down is a host fault, not a reason not to lead)."""
        await self.close()
        backend = self.make(await cluster_id(self.client, self.prefix))
        self.current.append(backend)
        await backend.connect()
        return backend

    async def close(self) -> None:
        """Stop talking to the engines; the containers keep running."""
        while self.current:
            await self.current.pop().close()

    def __repr__(self) -> str:
        return f"<Engines current={self.current!r}>"
