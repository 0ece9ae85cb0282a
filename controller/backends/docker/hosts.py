"""The Docker backend's records: the hosts it is configured with, what it knows of each
(reachability, its replicas, its watcher), and each replica it runs. Mutated only by the
backend and its watchers (``watch``), on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base import Launch
from .engine import EngineClient, EngineTls
from .tunnel import SshOptions, Tunnel

__all__ = ["DockerHost", "HostListener", "HostRecord", "HostState", "ReplicaRecord"]


@dataclass(frozen=True, slots=True)
class DockerHost:
    """One engine the backend places replicas on."""

    name: str
    engine: str
    """``unix:///var/run/docker.sock``, ``tcp://host:port`` or ``ssh://user@host[:port]``."""
    address: str = "127.0.0.1"
    """Where the replicas' ports are published, and where the gateway reaches them."""
    capacity: int = 8
    port_range: tuple[int, int] = (21000, 21999)
    gpus: int = 0
    """GPUs the host has for replicas that ask for some."""
    gpu_ids: tuple[str, ...] = ()
    """Their device ids (empty: the indexes ``0`` to ``gpus - 1``)."""
    tls: EngineTls | None = None
    """A ``tcp://`` engine's TLS files; None: plain HTTP."""
    ssh: SshOptions | None = None
    """An ``ssh://`` engine's options (None: ssh's defaults)."""

    @property
    def devices(self) -> tuple[str, ...]:
        """The ids of the host's GPUs, in the order they are given out."""
        return self.gpu_ids or tuple(str(i) for i in range(self.gpus))


@dataclass(frozen=True, slots=True)
class HostState:
    """A host as the backend sees it."""

    name: str
    engine: str
    reachable: bool
    error: str
    """Why it is unreachable; empty while it answers."""
    replicas: int
    capacity: int


HostListener = Callable[[HostState], None]


@dataclass(eq=False)
class ReplicaRecord:
    launch: Launch
    host: HostRecord
    port: int
    done: asyncio.Future[None]
    """Resolved once the exit has been reported."""
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once ``start`` returned or failed: an exit is not reported before."""
    container: str | None = None
    stop_requested: bool = False
    verified: bool = True
    """False for a replica adopted while its engine could not be reached."""
    finishing: asyncio.Task[None] | None = None
    oom: bool = False
    gpus: tuple[str, ...] = ()
    """The device ids of the host's GPUs the replica holds, until its container is gone."""
    reported: bool = False
    """Its exit was handed to the exit handler (before its container is gone, if its stop
    was not answered)."""


@dataclass(eq=False)
class HostRecord:
    config: DockerHost
    client: EngineClient
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)
    reachable: bool = False
    error: str = "not connected yet"
    told: bool | None = None
    """The reachability the listeners last heard of; None before the first answer."""
    answered: asyncio.Event | None = None
    """Set after the first connection attempt, whatever its outcome."""
    watcher: asyncio.Task[None] | None = None
    listing: dict[str, dict[str, Any]] | None = None
    """This host's containers (by id) as last listed, for adoption."""
    since: str | None = None
    next_port: int = 0
    pulls: dict[str, asyncio.Lock] = field(default_factory=dict)
    sweeping: asyncio.Task[None] | None = None
    tunnel: Tunnel | None = None
    """An ``ssh://`` engine's forward, supervised by ``tunneling``."""
    tunneling: asyncio.Task[None] | None = None
    recheck: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to have the watcher ping the engine at once (a call to it found no answer)."""
    unremoved: set[str] = field(default_factory=set)
    """Containers whose exit was reported but that the engine did not remove (it went away,
    or was shutting down): removed at its next (re)connection."""

    @property
    def name(self) -> str:
        return self.config.name

    def state(self) -> HostState:
        """The host as the backend's ``hosts()`` and its host listeners see it."""
        return HostState(
            self.name,
            self.config.engine,
            self.reachable,
            self.error,
            len(self.replicas),
            self.config.capacity,
        )
