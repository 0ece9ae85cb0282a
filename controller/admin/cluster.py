"""The admin API in a cluster: every node answers, the leader carries out.

Only the node that leads runs the controller, so it alone knows the live state of services
and rollouts and alone writes the state. Every other node **forwards** each ``/api/`` request
to the leader (reads too, so that every node gives the same answer), with the same bearer
token, and streams the leader's answer back with ``X-Gateway-Leader: <name>``. Why forward
rather than write to etcd from any node: one writer keeps revision numbering, the one active
rollout and every rule of the planner in one place, with no write race between nodes to
settle.

Answered by the node itself, never forwarded: ``GET /api/cluster`` (the nodes, who leads),
``GET /api/cluster/replicas/{replica}/logs`` (this node's own log of a replica), the
certificate and TLS routes (each node has its own listeners), ``/healthz``, ``/readyz``,
``/metrics``.

A replica's log is a file on the node that runs it. ``GET .../replicas/{replica}/logs``
through a node that does not lead goes to the node that runs the replica, as the state it
follows says (this node itself, or that node's own logs route), not to the leader. A replica
the state has no record of (it ended) goes to the leader, which checks it is the service's
and asks every live node for its log: the node that ran it holds one.

With no leader (an election under way, or etcd unreachable) a forwarded request gets 503
``no_leader`` with ``Retry-After``; on the leader, a write while etcd is unreachable gets 503
``store_unavailable`` before anything is changed, and a write is answered only once what it
changed is in etcd.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from ..unreachable import unreachable_reason
from .bodies import ClusterNodeView, ClusterView, LogsView, NodeLogsView
from .handlers import TAIL, ApiError, ReplicaLogs, respond, tail_query
from .openapi import Operation
from .origin import BROWSER_HEADERS

log = logging.getLogger("gateway.admin")

LOCAL_PATHS = ("/api/cluster", "/api/tls", "/api/certificates")
"""Prefixes of the routes every node answers itself."""
FORWARDED_BY = "X-Gateway-Forwarded-By"
LEADER_HEADER = "X-Gateway-Leader"
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOGS_ROUTE = "/api/services/{name}/replicas/{replica}/logs"
NODE_LOGS_ROUTE = "/api/cluster/replicas/{replica}/logs"
NODE_TIMEOUT = 10.0
"""Seconds another node has to answer for its log of a replica."""
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

    def node_address(self, name: str) -> str | None:
        """A live node's admin API (``http://host:port``); None if it is not live."""

    def replica_node(self, service: str, replica_id: str) -> str | None:
        """The node that runs the replica, as the cluster's state says; None if the state has
        no record of it (it ended, or never started)."""

    def local_logs(self, replica_id: str, tail: int) -> list[str] | None:
        """The last ``tail`` lines of this node's log of the replica; None if this node holds
        none. Reads files: called off the event loop."""


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
        if request.method == "GET" and _route(request) == LOGS_ROUTE:
            answer = await _logs_where_running(request, membership, session())
            if answer is not None:
                return answer
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


def _route(request: web.Request) -> str | None:
    """The path pattern of the route the request matched (None: no route)."""
    route = request.match_info.route
    resource = None if route is None else route.resource
    return None if resource is None else resource.canonical


async def _logs_where_running(
    request: web.Request, membership: Membership, session: aiohttp.ClientSession
) -> web.Response | None:
    """A follower's answer to a replica's logs, from the node that runs it; None when the
    state it follows does not say (the leader's to answer)."""
    service, replica = request.match_info["name"], request.match_info["replica"]
    node = membership.replica_node(service, replica)
    if node is None:
        return None
    lines = await node_logs(request, membership, session, node, replica, tail_query(request))
    if lines is None:  # that node is gone, or holds no log of it
        return None
    return respond(LogsView(service=service, replica=replica, lines=lines, node=node))


async def node_logs(
    request: web.Request,
    membership: Membership,
    session: aiohttp.ClientSession,
    node: str,
    replica: str,
    tail: int,
) -> list[str] | None:
    """``node``'s log of the replica (its last ``tail`` lines): read here if ``node`` is this
    one, else asked of it with the caller's token. None if the node is not live or holds no
    log of it; ``ApiError`` 503 if it does not answer."""
    if node == membership.node:
        return await asyncio.to_thread(membership.local_logs, replica, tail)
    address = membership.node_address(node)
    if address is None:
        return None
    headers = {FORWARDED_BY: membership.node}
    if "Authorization" in request.headers:
        headers["Authorization"] = request.headers["Authorization"]
    url = address + NODE_LOGS_ROUTE.format(replica=quote(replica, safe=""))
    try:
        async with session.get(
            url,
            params={"tail": str(tail)},
            headers=headers,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=NODE_TIMEOUT),
        ) as answer:
            status = answer.status
            text = await answer.text()
    except (aiohttp.ClientError, OSError, TimeoutError) as e:
        raise ApiError(
            503,
            "node_unreachable",
            f"node {node} ({address}) did not answer for the log of {replica}:"
            f" {unreachable_reason(e)}",
            headers={"Retry-After": "2"},
        ) from None
    body = _json(text)
    if status != 200 or not isinstance(body.get("lines"), list):
        why = body.get("message") or text[:200]
        raise ApiError(
            503,
            "node_refused",
            f"node {node} ({address}) did not give the log of {replica}: {status} {why}",
            headers={"Retry-After": "2"},
        )
    if not body.get("found"):
        return None
    return [str(line) for line in body["lines"]]


def _json(text: str) -> dict[str, Any]:
    try:
        body = json.loads(text)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def cluster_logs(
    membership: Membership, session: Callable[[], aiohttp.ClientSession]
) -> ReplicaLogs:
    """The leader's reading of a process replica's log (``handlers.LOGS_ELSEWHERE``): from the
    node the state says runs it; else (it ended) from whichever live node holds a log of it,
    this node first. No node holding one: no lines. A node that did not answer while none
    holding one did: 503."""

    async def logs(
        request: web.Request, service: str, replica: str, tail: int
    ) -> tuple[list[str], str | None]:
        node = membership.replica_node(service, replica)
        if node is not None:
            lines = await node_logs(request, membership, session(), node, replica, tail)
            if lines is not None:
                return lines, node
        lines = await node_logs(request, membership, session(), membership.node, replica, tail)
        if lines is not None:
            return lines, membership.node
        others = [n.name for n in membership.nodes() if n.name not in (membership.node, node)]
        answers = await asyncio.gather(
            *(node_logs(request, membership, session(), n, replica, tail) for n in others),
            return_exceptions=True,
        )
        silent: list[str] = []
        for name, answer in zip(others, answers, strict=True):
            if isinstance(answer, list):
                return answer, name
            if isinstance(answer, ApiError):
                silent.append(answer.message)
            elif isinstance(answer, BaseException):
                raise answer
        if silent:
            raise ApiError(503, "node_unreachable", "; ".join(silent), headers={"Retry-After": "2"})
        return [], None

    return logs


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
    """``GET /api/cluster``: the store, the live nodes and which one leads. In a cluster, ``GET
    /api/cluster/replicas/{replica}/logs`` too: this node's own log of a replica."""

    async def get_cluster(request: web.Request) -> web.Response:
        return web.json_response(cluster_view(membership).model_dump(mode="json"))

    operations = [
        Operation(
            "GET",
            "/api/cluster",
            get_cluster,
            "The state store, the live nodes of the cluster and which one leads",
            {200: ClusterView},
        )
    ]
    if membership is None:
        return operations
    here = membership

    async def node_replica_logs(request: web.Request) -> web.Response:
        replica = request.match_info["replica"]
        lines = await asyncio.to_thread(here.local_logs, replica, tail_query(request))
        found = lines is not None
        return respond(
            NodeLogsView(node=here.node, replica=replica, found=found, lines=lines or [])
        )

    operations.append(
        Operation(
            "GET",
            NODE_LOGS_ROUTE,
            node_replica_logs,
            "The last lines of a replica's output as this node holds them (the node that runs"
            " or ran it); never forwarded",
            {200: NodeLogsView},
            errors=(422,),
            query=(TAIL,),
        )
    )
    return operations
