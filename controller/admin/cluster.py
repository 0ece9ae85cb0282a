"""The admin API in a cluster: every node answers, the leader carries out.

Only the node that leads runs the controller, so it alone knows the live state of services
and rollouts and alone writes the state. Every other node **forwards** each ``/api/`` request
to the leader (reads too, so that every node gives the same answer), with the same bearer
token, and streams the leader's answer back with ``X-Gateway-Leader: <name>``. Why forward
rather than write to etcd from any node: one writer keeps revision numbering, the one active
rollout and every rule of the planner in one place, with no write race between nodes to
settle.

Answered by the node itself, never forwarded: ``GET /api/cluster`` (the nodes, who leads),
the certificate and TLS routes (each node has its own listeners), ``/healthz``, ``/readyz``,
``/metrics``.

With no leader (an election under way, or etcd unreachable) a forwarded request gets 503
``no_leader`` with ``Retry-After``; on the leader, a write while etcd is unreachable gets 503
``store_unavailable`` before anything is changed, and a write is answered only once what it
changed is in etcd.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..unreachable import unreachable_reason
from .handlers import ApiError
from .openapi import Operation
from .origin import BROWSER_HEADERS
from .schemas import ClusterNodeView, ClusterView

log = logging.getLogger("gateway.admin")

LOCAL_PATHS = ("/api/cluster", "/api/tls", "/api/certificates")
"""Prefixes of the routes every node answers itself."""
FORWARDED_BY = "X-Gateway-Forwarded-By"
LEADER_HEADER = "X-Gateway-Leader"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "host",
        *BROWSER_HEADERS,  # checked here (origin.py), and not of the leader's origin
    }
)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    address: str
    leader: bool
    started_at: float
    replicas: int | None = None
    capacity: int | None = None


class Membership(Protocol):
    """What the admin API needs to know of the cluster (``controller.cluster.runtime``)."""

    @property
    def node(self) -> str: ...

    def leading(self) -> bool: ...

    def leader(self) -> NodeInfo | None:
        """The node that leads, as last seen (None: nobody leads now)."""

    def nodes(self) -> Sequence[NodeInfo]:
        """The live nodes (their lease is held)."""

    def store_reachable(self) -> bool: ...

    def store_reason(self) -> str:
        """Why the store is unreachable (empty while it is reachable)."""

    async def committed(self) -> None:
        """Return once what was written so far is in etcd; raise ``StoreUnavailable`` (or
        ``Deposed``) when it cannot be."""


def _local(path: str) -> bool:
    return not path.startswith("/api/") or any(
        path == p or path.startswith(p + "/") for p in LOCAL_PATHS
    )


def cluster_middleware(
    membership: Membership, session: Callable[[], aiohttp.ClientSession]
) -> Middleware:
    """Forward what the leader carries out; refuse writes the store cannot take now."""

    @web.middleware
    async def cluster(request: web.Request, handler: Handler) -> web.StreamResponse:
        if _local(request.path):
            return await handler(request)
        if membership.leading():
            if request.method in WRITE_METHODS and not membership.store_reachable():
                raise ApiError(
                    503,
                    "store_unavailable",
                    f"etcd is unreachable, so nothing can be changed now:"
                    f" {membership.store_reason()}",
                    headers={"Retry-After": "2"},
                )
            response = await handler(request)
            if request.method in WRITE_METHODS:
                # A write answered here is in etcd: the leader's store writes locally first.
                await membership.committed()
            response.headers[LEADER_HEADER] = membership.node
            return response
        leader = membership.leader()
        if leader is None or leader.name == membership.node or FORWARDED_BY in request.headers:
            if FORWARDED_BY in request.headers:
                why = "the leader changed while the request was forwarded"
            elif leader is not None:
                why = "this node is taking the lead: it is loading the state"
            else:
                why = "an election is under way or etcd is unreachable"
            raise ApiError(
                503,
                "no_leader",
                f"no node leads the cluster now ({why}): try again in a few seconds",
                headers={"Retry-After": "2"},
            )
        return await _forward(request, leader, membership.node, session())

    return cluster


async def _forward(
    request: web.Request, leader: NodeInfo, node: str, session: aiohttp.ClientSession
) -> web.StreamResponse:
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
    headers[FORWARDED_BY] = node
    body = await request.read() if request.body_exists else None
    url = leader.address + request.path_qs
    try:
        upstream = await session.request(
            request.method,
            url,
            headers=headers,
            data=body,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None),
        )
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise ApiError(
            503,
            "leader_unreachable",
            f"the leader {leader.name} ({leader.address}) did not answer: {unreachable_reason(e)}",
            headers={"Retry-After": "2"},
        ) from None
    async with upstream:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        for key, value in upstream.headers.items():
            if key.lower() not in _HOP_BY_HOP:
                response.headers.add(key, value)
        response.headers[LEADER_HEADER] = leader.name
        await response.prepare(request)
        async for chunk in upstream.content.iter_any():
            await response.write(chunk)
        await response.write_eof()
    return response


def cluster_view(membership: Membership | None) -> ClusterView:
    if membership is None:
        return ClusterView(store="sqlite", node=None, leader=None, nodes=[])
    leader = membership.leader()
    return ClusterView(
        store="etcd",
        node=membership.node,
        leader=None if leader is None else leader.name,
        store_reachable=membership.store_reachable(),
        store_reason=membership.store_reason(),
        nodes=[
            ClusterNodeView(
                name=n.name,
                address=n.address,
                leader=n.leader,
                started_at=n.started_at,
                replicas=n.replicas,
                capacity=n.capacity,
            )
            for n in membership.nodes()
        ],
    )


def cluster_operations(membership: Membership | None) -> list[Operation]:
    """``GET /api/cluster``: the store, the live nodes and which one leads."""

    async def get_cluster(request: web.Request) -> web.Response:
        return web.json_response(cluster_view(membership).model_dump(mode="json"))

    return [
        Operation(
            "GET",
            "/api/cluster",
            get_cluster,
            "The state store, the live nodes of the cluster and which one leads",
            {200: ClusterView},
        )
    ]
