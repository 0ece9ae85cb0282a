"""The Docker backend: replicas as containers on one or more Docker Engines (hosts).

Invariants:

- A container carries the labels ``gateway.instance`` (this gateway's id), ``gateway.host``,
  ``gateway.service``, ``gateway.revision`` and ``gateway.replica``. The backend lists, watches
  and adopts only containers with its own instance and host labels.
- A slot of a host and a host port are held from the moment ``start`` places a launch until
  its exit was reported. The container's port is published on the host's ``address`` only, at
  a port of the host's ``port_range``; two replicas of a host never share a port.
- An exit is seen by the host's watcher (``watch``: the engine's events, and a listing after
  each reconnection). It is reported exactly once: after the container's last log lines were
  read (kept in memory, ``logs``) and the container removed. ``stop`` returns after that.
- An engine that cannot be reached (as its watcher alone decides) is skipped by placement; its
  replicas are left as they are and nothing is stopped or reported because of it. A call that
  found no engine has the watcher ping at once.
- An ``ssh://`` host's engine is reached through a local socket forwarded by an ``ssh``
  child (``tunnel``), started at ``connect()``, restarted with backoff, stopped at ``close()``. The
  ``host_listeners`` hear each change of a host's reachability (not its first success).
- A ``stop`` of a replica whose engine cannot be reached (unreachable already, or no answer to
  the stop) reports its exit at once, saying so: the controller replaces it elsewhere, as a
  node's replicas when the node is gone. Its slot, port and GPUs stay held, and the stop is sent
  again once the engine answers; its container's end then reports nothing more.

Adoption is synchronous (the protocol's ``adopt``): ``connect()`` must have been awaited first,
so each reachable host's containers are known; a replica of a host that cannot be reached is
taken back on its handle's word and checked once the engine answers.

Orphans (``orphans``): containers of this instance that this backend neither started nor
adopted. Adoption happens at restore, well within ``orphan_grace``; the state's replicas are
thus exactly the backend's, and the backend needs no view of the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import shutil
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ...errors import BackendError, HostFault, NoCapacity, StartFailed
from ...spec import gpu_count
from ...tasks import guarded_task
from ..base import Exit, ExitHandler, Launch, Running
from .container import LABEL, container_config, container_name, exit_reason, signed_code
from .engine import EngineClient, EngineError, EngineUnreachable
from .hosts import DockerHost, HostListener, HostRecord, HostState, ReplicaRecord
from .orphans import sweep
from .placement import HostLoad, NoRoom, gpus_for, place
from .pulling import PullProgress
from .tunnel import SshOptions, Tunnel
from .watch import HostWatcher

if TYPE_CHECKING:
    from ...spec import ReplicaTemplate
    from ..base import Backend

__all__ = ["DockerBackend", "DockerHost", "HostListener", "HostState", "PullListener"]

log = logging.getLogger(__name__)

NO_CAPACITY_RETRY_AFTER = 5.0
LOG_LINES_KEPT = 1000
"""Lines of a removed container's output kept in memory."""
REMOVAL_WAIT = 10.0
"""How long ``close`` waits for the removal of containers whose exits were reported."""
REPLICAS_WITH_LOGS_KEPT = 256
CONNECT_WAIT = 5.0
"""How long ``connect`` (and so a first ``start``) waits for each engine's first answer."""
PORT_ATTEMPTS = 3
ORPHAN_GRACE = 60.0
"""After the first ``connect()``, how long a container this backend does not know is left be."""
PullListener = Callable[[str, str], None]
"""Hears ``(service, line)``: a line of an image pull for a replica of the service."""
_PORT_TAKEN = re.compile(r"port is already allocated|address already in use", re.I)


def _conforms(backend: DockerBackend) -> Backend:  # pragma: no cover - checked by mypy
    return backend


class DockerBackend:
    """Places each replica on the host with room (``placement``) and runs it there."""

    name: str = "docker"

    def __init__(
        self,
        hosts: Sequence[DockerHost],
        instance: str,
        stop_grace_default: float = 10.0,
        orphan_grace: float = ORPHAN_GRACE,
        node: str | None = None,
    ) -> None:
        if not hosts:
            raise ValueError("the docker backend needs at least one host")
        names = [h.name for h in hosts]
        if len(set(names)) != len(names):
            raise ValueError("host names must be unique")
        self._tunnels_dir: str | None = None
        self._instance = instance
        self._node = node
        """The cluster node talking to the engines (its leader), named in reasons; None: one
        gateway alone."""
        self._hosts = {h.name: self._record(h) for h in hosts}
        self._stop_grace_default = stop_grace_default
        self._orphan_grace = orphan_grace
        self._sweep_at: float | None = None
        """Loop time from which unknown containers are orphans."""
        self._sweeper: asyncio.Task[None] | None = None
        self._removals: set[asyncio.Task[None]] = set()
        """Every exit being reported (``_report``): those whose exit was reported go on to
        remove their container, which ``close`` lets finish."""
        self.host_listeners: list[HostListener] = []
        self.pull_listeners: list[PullListener] = []
        """Hear each image pull, a line every ``SAY_EVERY`` seconds."""
        self._exit_handler: ExitHandler | None = None
        self._kept_logs: OrderedDict[str, list[str]] = OrderedDict()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def _record(self, host: DockerHost) -> HostRecord:
        if not host.engine.startswith("ssh://"):
            client = EngineClient(host.engine, host.tls)
            return HostRecord(host, client, next_port=host.port_range[0])
        if self._tunnels_dir is None:  # made at connect(), removed at close()
            name = f"gateway-ssh-{self._instance[:12]}-{os.getpid()}"
            self._tunnels_dir = os.path.join(tempfile.gettempdir(), name)
        local = os.path.join(self._tunnels_dir, f"{host.name}.sock")
        tunnel = Tunnel(host.engine, local, host.ssh or SshOptions())
        record = HostRecord(host, EngineClient(f"unix://{local}"), next_port=host.port_range[0])
        record.tunnel = tunnel
        return record

    # -- the Backend protocol -------------------------------------------------------------

    @property
    def orphan_grace(self) -> float:
        """Seconds an unknown container of this instance is left before it is removed."""
        return self._orphan_grace

    @property
    def capacity(self) -> int | None:
        return sum(h.config.capacity for h in self._hosts.values())

    @property
    def in_use(self) -> int:
        return sum(len(h.replicas) for h in self._hosts.values())

    def set_exit_handler(self, handler: ExitHandler) -> None:
        self._exit_handler = handler

    async def connect(self) -> None:
        """Start watching every engine; return once each answered or ``CONNECT_WAIT`` passed.
        Idempotent. Await it before ``adopt``."""
        if self._closed:
            raise BackendError("the docker backend is closed")
        self._loop = asyncio.get_running_loop()
        if self._sweep_at is None:
            self._sweep_at = self._loop.time() + self._orphan_grace
            self._sweeper = guarded_task(self._sweep_after_grace(), "docker-orphans")
        tunnels = []
        if self._tunnels_dir is not None:
            os.makedirs(self._tunnels_dir, mode=0o700, exist_ok=True)
        for host in self._hosts.values():
            if host.tunnel is not None and host.tunneling is None:
                host.tunneling = guarded_task(host.tunnel.run(), f"docker-ssh:{host.name}")
                tunnels.append(host.tunnel.ready.wait())
        with contextlib.suppress(TimeoutError):  # a watcher retries a tunnel not up yet
            await asyncio.wait_for(asyncio.gather(*tunnels), CONNECT_WAIT)
        for host in self._hosts.values():
            if host.watcher is None:
                host.answered = asyncio.Event()
                watcher = HostWatcher(
                    host,
                    self._labels(host),
                    finish=self._finish,
                    stop=self._stop_container,
                    stop_grace=self._stop_grace_default,
                    orphans_due=self._orphans_due,
                    listeners=self.host_listeners,
                )
                host.watcher = guarded_task(watcher.run(), f"docker-events:{host.name}")
        waits = [h.answered.wait() for h in self._hosts.values() if h.answered is not None]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*waits), CONNECT_WAIT)

    async def start(self, launch: Launch) -> Running:
        """Place, pull if need be, create and start the container; raises NoCapacity or
        StartFailed. A container that then exits (even at once) is an exit, reported."""
        await self.connect()
        rid = launch.replica_id
        template = launch.template
        if template.image is None:
            raise StartFailed("the template has no image to run")
        if any(rid in h.replicas for h in self._hosts.values()):
            raise StartFailed(f"replica {rid} is already running")
        chosen = place([self._load(h, launch) for h in self._hosts.values()], self._node)
        if isinstance(chosen, NoRoom):
            raise NoCapacity(chosen.reason, retry_after=NO_CAPACITY_RETRY_AFTER)
        host = self._hosts[chosen]
        # Hold the slot, the port and the GPUs before the first await: concurrent starts must
        # not both take the last slot, the same port or the same device.
        replica = ReplicaRecord(
            launch, host, self._allocate_port(host), asyncio.get_running_loop().create_future()
        )
        replica.gpus = self._gpus(host, launch)
        host.replicas[rid] = replica
        try:
            await self._ensure_image(host, template, launch.service)
            await self._run(host, replica)
        except BaseException as exc:
            del host.replicas[rid]
            replica.done.set_result(None)
            if replica.container is not None:
                with contextlib.suppress(EngineError):
                    await host.client.remove(replica.container)
            if isinstance(exc, EngineUnreachable):
                # The watcher alone says whether a host answers (a start that failed on an
                # engine's way out must not mark its successor unreachable): it pings now.
                host.recheck.set()
                raise HostFault(f"host {host.name} unreachable: {exc.message}") from exc
            if isinstance(exc, EngineError) and (exc.status or 0) >= 500:
                # The engine's own failure (one shutting down answers some calls with 500s),
                # not the revision's: a bad image or template is a 4xx.
                raise HostFault(f"host {host.name}: {exc.message}") from exc
            if isinstance(exc, EngineError):
                raise StartFailed(f"host {host.name}: {exc.message}") from exc
            raise
        finally:
            replica.started.set()
        log.info(
            "started replica %s on %s (container %.12s, port %d)",
            rid,
            host.name,
            replica.container,
            replica.port,
        )
        if replica.stop_requested:  # stop() came while we were starting
            guarded_task(self._stop_container(replica, self._stop_grace_default), f"stop:{rid}")
        return self._running(replica)

    async def stop(self, replica_id: str, grace: float) -> None:
        """Stop the container (SIGTERM, SIGKILL after ``grace``), read its last logs, remove
        it; returns once its exit was reported. Unknown or ended replicas: nothing to do."""
        replica = self._find(replica_id)
        if replica is None:
            return
        if replica.finishing is None:
            replica.stop_requested = True
            if replica.container is not None and not replica.host.reachable:
                self._unanswered(replica, replica.host.error)
            elif replica.container is not None:
                await self._stop_container(replica, grace)
        await asyncio.shield(replica.done)

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        """Take back a container of a previous gateway process if it still runs here."""
        if self._closed:
            return None
        rid = launch.replica_id
        known = self._find(rid)
        if known is not None:
            return self._running(known)
        host = self._hosts.get(str(handle.get("host")))
        container, port = handle.get("container"), handle.get("port")
        if host is None or not isinstance(container, str) or type(port) is not int:
            return None
        if host.listing is not None:
            info = host.listing.get(container)
            labels = (info or {}).get("Labels") or {}
            if (
                info is None
                or info.get("State") != "running"
                or labels.get(LABEL + "replica") != rid
            ):
                return None
        replica = ReplicaRecord(launch, host, port, asyncio.get_running_loop().create_future())
        replica.container = container
        replica.verified = host.listing is not None
        # The devices it holds: as its label says (the handle's word while unverified).
        if host.listing is not None:
            held = str(
                ((host.listing.get(container) or {}).get("Labels") or {}).get(LABEL + "gpus") or ""
            )
            replica.gpus = tuple(g for g in held.split(",") if g)
        else:
            replica.gpus = tuple(str(g) for g in handle.get("gpus") or ())
        replica.started.set()
        host.replicas[rid] = replica
        log.info(
            "adopted replica %s on %s (container %.12s%s)",
            rid,
            host.name,
            container,
            "" if replica.verified else ", engine unreachable: checked once it answers",
        )
        return self._running(replica)

    def hosts(self) -> list[HostState]:
        """Every host, in the configured order, with its reachability and load."""
        return [h.state() for h in self._hosts.values()]

    def logs(self, replica_id: str, tail: int) -> list[str]:
        """The last ``tail`` lines of the replica's output: from the engine while it runs (when
        called off the event loop, as the admin API does), else those kept at its end."""
        if tail <= 0:
            return []
        replica = self._find(replica_id)
        loop = self._loop
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        if replica is not None and replica.container is not None and loop and not on_loop:
            future = asyncio.run_coroutine_threadsafe(
                replica.host.client.logs(replica.container, tail), loop
            )
            try:
                return future.result(timeout=10)
            except (EngineError, TimeoutError) as exc:
                log.warning("logs of replica %s: %s", replica_id, exc)
        return self._kept_logs.get(replica_id, [])[-tail:]

    async def close(self) -> None:
        """Stop watching; leave every container running for the next gateway to adopt."""
        self._closed = True
        tasks = []
        if self._sweeper is not None and not self._sweeper.done():
            self._sweeper.cancel()
            tasks.append(self._sweeper)
        for host in self._hosts.values():
            for task in (
                host.watcher,
                host.sweeping,
                *(r.finishing for r in host.replicas.values()),
            ):
                if task is not None and not task.done():
                    task.cancel()
                    tasks.append(task)
            for replica in host.replicas.values():
                if replica.done.done():
                    continue
                if replica.stop_requested:
                    rid = replica.launch.replica_id
                    error = BackendError(f"the docker backend closed while stopping {rid}")
                    replica.done.set_exception(error)
                else:
                    replica.done.cancel()
            host.replicas.clear()
        if tasks:
            await asyncio.wait(tasks)
        if self._removals:  # dead containers: let their removal finish (it is quick)
            await asyncio.wait(set(self._removals), timeout=REMOVAL_WAIT)
        for host in self._hosts.values():
            await host.client.close()
        tunnels = [h.tunneling for h in self._hosts.values() if h.tunneling is not None]
        for task in tunnels:
            task.cancel()
        if tunnels:
            await asyncio.wait(tunnels)
        if self._tunnels_dir is not None:
            shutil.rmtree(self._tunnels_dir, ignore_errors=True)

    def __repr__(self) -> str:
        hosts = ", ".join(
            f"{h.name}: {len(h.replicas)}/{h.config.capacity}"
            + ("" if h.reachable else " unreachable")
            for h in self._hosts.values()
        )
        return f"<DockerBackend in_use={self.in_use} capacity={self.capacity} hosts=[{hosts}]>"

    # -- starting ---------------------------------------------------------------------------

    def _free_gpus(self, host: HostRecord) -> tuple[str, ...]:
        held = {g for r in host.replicas.values() for g in r.gpus}
        return tuple(g for g in host.config.devices if g not in held)

    def _gpus(self, host: HostRecord, launch: Launch) -> tuple[str, ...]:
        """The device ids the launch gets on its host (placement found them free)."""
        load = self._load(host, launch)
        if not load.gpus_needed:
            return ()
        ids = gpus_for(self._free_gpus(host), load.gpus_needed, load.gpus_asked)
        assert ids is not None
        return ids

    def _load(self, host: HostRecord, launch: Launch) -> HostLoad:
        mine = [r for r in host.replicas.values() if r.launch.service == launch.service]
        gpus = host.config.gpus
        needed = gpu_count(launch.template.gpus, gpus)
        asked = launch.template.gpus
        return HostLoad(
            name=host.name,
            capacity=host.config.capacity,
            in_use=len(host.replicas),
            reachable=host.reachable,
            service_replicas=sum(1 for r in mine),
            revision_replicas=sum(1 for r in mine if r.launch.revision == launch.revision),
            gpus=gpus,
            gpus_in_use=sum(len(r.gpus) for r in host.replicas.values()),
            # Asking for GPUs is asking for one at least (``all`` of a host without any).
            gpus_needed=max(needed, 1) if asked is not None else 0,
            gpus_free=self._free_gpus(host),
            gpus_asked=asked if isinstance(asked, tuple) else (),
        )

    def _allocate_port(self, host: HostRecord, skip: frozenset[int] = frozenset()) -> int:
        """The next port of the host's range that none of its replicas holds, round robin (a
        port just given back is taken last)."""
        low, high = host.config.port_range
        held = {r.port for r in host.replicas.values()} | skip
        size = high - low + 1
        for step in range(size):
            port = low + (host.next_port - low + step) % size
            if port not in held:
                host.next_port = low + (port - low + 1) % size
                return port
        raise StartFailed(f"host {host.name}: port range {low}-{high} exhausted")

    async def _ensure_image(
        self, host: HostRecord, template: ReplicaTemplate, service: str
    ) -> None:
        image = template.image
        assert image is not None
        lock = host.pulls.setdefault(image, asyncio.Lock())
        async with lock:  # one pull of an image per host at a time
            pull = template.pull or "if_not_present"
            if pull != "always" and await host.client.image_exists(image):
                return
            if pull == "never":
                raise StartFailed(f"image not found: {image} (pull: never)")
            try:
                log.info("pulling %s on %s", image, host.name)
                progress = PullProgress(image, host.name, service)
                loop = asyncio.get_running_loop()

                def heard(message: dict[str, Any]) -> None:
                    progress.feed(message)
                    if progress.due(loop.time()):
                        self._say_pull(progress)

                await host.client.pull(image, heard)
            except EngineUnreachable:
                raise
            except EngineError as exc:
                if pull == "always":
                    raise StartFailed(f"image pull failed: {image}: {exc.message}") from exc
                raise StartFailed(f"image not found: {image} (pull failed: {exc.message})") from exc

    def _say_pull(self, progress: PullProgress) -> None:
        for listener in list(self.pull_listeners):
            try:
                listener(progress.service, progress.text())
            except Exception:
                log.exception("pull listener failed for %s", progress.image)

    async def _run(self, host: HostRecord, replica: ReplicaRecord) -> None:
        """Create and start the container; on a host port taken by something else, again
        with the next port."""
        tried: set[int] = set()
        for attempt in range(PORT_ATTEMPTS):
            launch = replica.launch
            replica.container = await host.client.create(
                container_name(self._instance, launch),
                container_config(
                    launch, host.config.address, replica.port, self._labels(host), replica.gpus
                ),
            )
            try:
                await host.client.start(replica.container)
                return
            except EngineError as exc:
                if isinstance(exc, EngineUnreachable) or not _PORT_TAKEN.search(exc.message):
                    raise
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                await host.client.remove(replica.container)
                replica.container = None
                tried.add(replica.port)
                replica.port = self._allocate_port(host, frozenset(tried))

    def _labels(self, host: HostRecord) -> dict[str, str]:
        return {LABEL + "instance": self._instance, LABEL + "host": host.name}

    def _running(self, replica: ReplicaRecord) -> Running:
        host = replica.host
        return Running(
            replica_id=replica.launch.replica_id,
            host=host.config.address,
            port=replica.port,
            handle={
                "host": host.name,
                "container": replica.container,
                "port": replica.port,
                **({"gpus": list(replica.gpus)} if replica.gpus else {}),
            },
        )

    def _find(self, replica_id: str) -> ReplicaRecord | None:
        for host in self._hosts.values():
            if replica_id in host.replicas:
                return host.replicas[replica_id]
        return None

    # -- stopping and exits -------------------------------------------------------------------

    async def _stop_container(self, replica: ReplicaRecord, grace: float) -> None:
        assert replica.container is not None
        try:
            await replica.host.client.stop(replica.container, math.ceil(max(grace, 0.0)))
        except EngineUnreachable as exc:
            replica.host.recheck.set()
            self._unanswered(replica, exc.message)
            return
        # Stopped: the die event reports it; this covers an event stream that was down.
        self._finish(replica, None)

    def _unanswered(self, replica: ReplicaRecord, why: str) -> None:
        """A stop its engine did not answer: the exit is reported now; the replica keeps its
        slot, port and GPUs until the watcher, once the engine answers, stops and removes its
        container (``_report`` then reports nothing more)."""
        if replica.reported:
            return
        host, rid = replica.host, replica.launch.replica_id
        reason = (
            f"stopped while host {host.name} is unreachable ({why}): its container is stopped"
            " and removed once the engine answers"
        )
        log.warning("replica %s: %s", rid, reason)
        self._tell_exit(replica, Exit(rid, None, reason, requested=True))
        if not replica.done.done():
            replica.done.set_result(None)

    def _tell_exit(self, replica: ReplicaRecord, event: Exit) -> None:
        """Hand the exit to the exit handler, once per replica."""
        if replica.reported:
            return
        replica.reported = True
        if self._exit_handler is not None:
            try:
                self._exit_handler(event)
            except Exception:
                log.exception("exit handler failed for replica %s", event.replica_id)

    def _finish(self, replica: ReplicaRecord, code: int | None) -> None:
        if replica.finishing is None:
            rid = replica.launch.replica_id
            replica.finishing = task = guarded_task(self._report(replica, code), f"exit:{rid}")
            self._removals.add(task)
            task.add_done_callback(self._removals.discard)

    async def _report(self, replica: ReplicaRecord, code: int | None) -> None:
        """Read the exit status and the last logs (at once, both), report the exit, then
        remove the container: the exit reaches the controller, and the dead replica leaves
        the pool, without waiting for the removal."""
        await replica.started.wait()
        host, rid = replica.host, replica.launch.replica_id
        lines: list[str] = []
        container = replica.container
        if container is not None:
            try:
                info, lines = await asyncio.gather(
                    host.client.inspect(container), host.client.logs(container, LOG_LINES_KEPT)
                )
                if info is not None:
                    state = info.get("State") or {}
                    code = state.get("ExitCode", code)
                    replica.oom = replica.oom or bool(state.get("OOMKilled"))
            except EngineError as exc:
                log.warning("replica %s: container not read: %s", rid, exc.message)
        self._keep_logs(rid, lines)
        if host.replicas.get(rid) is replica:
            del host.replicas[rid]
        reason = exit_reason(replica.stop_requested, replica.oom, code, lines)
        signed = signed_code(code)
        log.info("replica %s: %s", rid, reason)
        self._tell_exit(replica, Exit(rid, signed, reason, replica.stop_requested))
        if container is not None:
            try:
                await host.client.remove(container)
            except EngineError as exc:
                log.warning("replica %s: container not removed: %s", rid, exc.message)
                host.unremoved.add(container)  # an engine shutting down, say
        if not replica.done.done():
            replica.done.set_result(None)

    def _keep_logs(self, replica_id: str, lines: list[str]) -> None:
        self._kept_logs[replica_id] = lines
        self._kept_logs.move_to_end(replica_id)
        while len(self._kept_logs) > REPLICAS_WITH_LOGS_KEPT:
            self._kept_logs.popitem(last=False)

    # -- orphans --------------------------------------------------------------------------------

    async def _sweep_after_grace(self) -> None:
        await asyncio.sleep(self._orphan_grace)
        for host in self._hosts.values():
            if host.reachable:  # the others are swept when they answer again (``watch``)
                await sweep(host, self._labels(host), self._stop_grace_default)

    def _orphans_due(self) -> bool:
        loop = self._loop
        return self._sweep_at is not None and loop is not None and loop.time() >= self._sweep_at
