"""Worker processes: N processes serve traffic on one port, from the controller's pool.

``Supervisor`` takes the place of ``TrafficServer`` in the controller's process when
``workers`` > 1 (same ``bind``/``start``/``stop``/``port``). It reserves the listening port
(``bind``: a socket bound with SO_REUSEPORT that never listens, so port 0 resolves once and the
port stays ours while workers come and go), starts the workers (``python -OO -X
no_debug_ranges -m gateway.workers``: nothing a worker runs reads a docstring, its asserts only
narrow types, and its code objects keep line numbers but not the columns a traceback's ``^^^``
markers are drawn from) and then:

- sends each worker every pool change as a whole snapshot of the service (``ipc.Install``),
  coalesced per service within one loop iteration, in order on one channel per worker;
- makes every worker a *peer* of the pool, so a drain completes only when each worker said it
  holds no lease of the upstream (``ipc.Idle``) or is gone; a drain timeout is sent on to the
  workers (``ipc.Abort``) to cut off what they still have in flight;
- takes the workers' ejection proposals to the pool (``Pool.eject``), and their reports:
  in-flight counts (status, ``gateway_inflight_requests``) and request counts, which
  ``GatewayMetrics.merge`` adds so that ``/metrics`` shows the whole gateway;
- restarts a worker that exits, with a growing delay (0.5 s doubling up to 30 s, reset once a
  worker has served for a minute). Connections the dead worker had accepted are lost with it;
  the others serve on. A worker whose reports stop for ``hang_after`` seconds (its event loop
  is stuck, or it was stopped) gets SIGKILL and so is started again: a hung worker would
  otherwise keep taking its share of new connections and answer none of them.

Stop: ``ipc.Stop`` to every worker (each stops accepting and finishes what is in flight, up
to ``shutdown_timeout``), then SIGKILL for any that has not exited 5 s after that.
Invariant: only processes this supervisor started are ever signalled, by their pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from dataclasses import dataclass, field

from .. import native
from ..config import ProxyConfig, parse_address
from ..observability.metrics import GatewayMetrics
from ..observability.span_buffer import SpanBuffer
from ..pool.events import PoolEvent
from ..pool.inference import ReplicaLoad
from ..pool.pool import Pool
from ..tls import Termination
from . import ipc

log = logging.getLogger(__name__)

START_TIMEOUT = 20.0
"""How long the first start of the workers may take before the gateway gives up."""
RESTART_DELAY = (0.5, 30.0)
STABLE_AFTER = 60.0


@dataclass(eq=False)
class _Worker:
    index: int
    process: asyncio.subprocess.Process
    writer: asyncio.StreamWriter
    reader: asyncio.StreamReader
    started: float
    ready: asyncio.Future[None]
    task: asyncio.Task[None] | None = None
    connections: int = 0
    parked: int = 0
    http2: int = 0
    served: int = 0
    """Requests answered, as of its last report."""
    reports: int = 0
    heard: float = 0.0
    """Loop time of its last message."""

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, message: ipc.ToWorker) -> None:
        if not self.writer.is_closing():
            self.writer.write(ipc.encode(message))


@dataclass
class WorkerSettings:
    """What the workers serve with, besides the proxy settings."""

    count: int
    access_log: tuple[str, str | None] | None = None
    log_level: str = "info"
    report_interval: float = 1.0
    hang_after: float = 10.0
    """No report for this long: the worker is hung, killed and started again."""
    python: str = field(default_factory=lambda: sys.executable)


class Supervisor:
    """``settings.count`` worker processes serving ``config.listen`` from ``pool``."""

    def __init__(
        self,
        pool: Pool,
        config: ProxyConfig,
        settings: WorkerSettings,
        metrics: GatewayMetrics | None = None,
        tls: Termination | None = None,
        spans: SpanBuffer | None = None,
    ) -> None:
        self.pool = pool
        self.spans = spans
        """Where the workers' spans go, to be exported (``tracing.otlp_endpoint``)."""
        self.tls = tls
        """The main process's certificates (status, metrics) and the workers' handshake
        counts, merged from their reports; each worker serves from certificates of its own."""
        self.config = config
        self.settings = settings
        self.metrics = metrics
        self.workers: dict[int, _Worker] = {}
        """Index -> the running worker of that slot."""
        self._reservation: socket.socket | None = None
        self._tls_reservations: list[socket.socket] = []
        self._tls_addresses: list[tuple[str, int]] = []
        self._port = 0
        self._host = ""
        self._stopping = False
        self._dirty: dict[str, bool] = {}
        """Services whose snapshot is to be sent (True) or that were removed (False)."""
        self._flush: asyncio.Handle | None = None
        self._failures = [0] * settings.count
        self._restarts: set[asyncio.Task[None]] = set()
        self._watchdog: asyncio.Task[None] | None = None
        self._waiting: list[asyncio.Future[None]] = []
        """``changed`` futures, resolved at the next change."""
        self.restarted = 0
        """Workers started again after one exited (``gateway_worker_restarts``)."""

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("Supervisor is not started")
        return self._port

    @property
    def serving(self) -> int:
        """Workers started and ready (``gateway_workers``)."""
        return sum(w.ready.done() for w in self.workers.values())

    @property
    def connections(self) -> int:
        """Client connections open in the workers, as of their last reports."""
        return sum(w.connections for w in self.workers.values())

    @property
    def parked(self) -> int:
        """Of ``connections``, those parked (``proxy.parking``)."""
        return sum(w.parked for w in self.workers.values())

    @property
    def http2(self) -> int:
        """Of ``connections``, those that speak HTTP/2."""
        return sum(w.http2 for w in self.workers.values())

    # -- life cycle ---------------------------------------------------------------------------

    def bind(self) -> None:
        """Reserve the traffic port and the HTTPS ports (``_reserve``), before ``start``
        starts the workers on them. If one fails, none is held."""
        if self._reservation is not None:
            return
        self._host, port = parse_address(self.config.listen, listen=True)
        reservation = _reserve(self._host, port)
        reservations, addresses = [], []
        if self.tls is not None:
            try:
                for address in self.config.listen_tls:
                    host, tls_port = parse_address(address, listen=True)
                    held = _reserve(host, tls_port)
                    reservations.append(held)
                    addresses.append((host, held.getsockname()[1]))
            except BaseException:
                for held in (reservation, *reservations):
                    held.close()
                raise
        self._reservation = reservation
        self._port = reservation.getsockname()[1]
        self._tls_reservations = reservations
        self._tls_addresses = addresses

    def unbind(self) -> None:
        """Release the reserved ports (``stop`` does, once the workers are gone)."""
        if self._reservation is not None:
            self._reservation.close()
            self._reservation = None
        for held in self._tls_reservations:
            held.close()
        self._tls_reservations.clear()

    async def start(self) -> None:
        if self._watchdog is not None:
            return
        self.bind()
        if self.tls is not None:
            self.tls.start()
        self.pool.subscribe(self)
        try:
            workers = [await self._spawn(i) for i in range(self.settings.count)]
            await asyncio.wait_for(asyncio.gather(*(w.ready for w in workers)), START_TIMEOUT)
        except BaseException:
            await self.stop()
            raise
        self._watchdog = asyncio.create_task(self._watch(), name="worker-watchdog")
        log.info(
            "%d workers serving %s:%d: pids %s",
            len(workers),
            self._host,
            self._port,
            ", ".join(str(w.pid) for w in workers),
        )
        if len(workers) > 1 and migrate_req_off():
            log.info(
                "net.ipv4.tcp_migrate_req is 0: connections queued on a worker that dies are"
                " lost with it; 1 moves them to the other workers (docs/workers.md)"
            )

    async def stop(self) -> None:
        """Stop every worker (in-flight requests finish), then release the port."""
        self._stopping = True
        for task in [*self._restarts, self._watchdog]:
            if task is not None:
                task.cancel()
        workers = list(self.workers.values())
        for worker in workers:
            worker.send(ipc.Stop())
        # Each worker's _run ends once the worker has exited (and was reaped).
        tasks = [w.task for w in workers if w.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=self.config.shutdown_timeout + 5)
            for worker in workers:
                if worker.process.returncode is None:
                    log.warning("worker %d (pid %d) did not stop: kill", worker.index, worker.pid)
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGKILL)
            if pending:
                await asyncio.wait(pending, timeout=5)
        self.pool.unsubscribe(self)
        if self._flush is not None:
            self._flush.cancel()
        self.unbind()
        if self.tls is not None:
            await self.tls.stop()

    @property
    def tls_ports(self) -> list[int]:
        """The bound ports of the HTTPS listeners, in ``listen_tls`` order."""
        return [port for _, port in self._tls_addresses]

    def reload_tls(self) -> None:
        """Every worker loads the certificates that changed on disk."""
        for worker in self.workers.values():
            worker.send(ipc.ReloadTls())

    async def _spawn(self, index: int) -> _Worker:
        # The sources' digest made here (the main process holds hashlib anyway): a worker
        # that checks the compiled modules against it need not import hashlib.
        sources = native.sources()
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            process = await asyncio.create_subprocess_exec(
                self.settings.python,
                "-OO",
                "-X",
                "no_debug_ranges",
                "-m",
                "gateway.workers",
                str(child.fileno()),
                *([sources] if sources is not None else []),
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        loop = asyncio.get_running_loop()
        reader, writer = await asyncio.open_unix_connection(sock=parent)
        worker = _Worker(index, process, writer, reader, loop.time(), loop.create_future())
        self.workers[index] = worker
        self.pool.peer_joined(worker.pid)
        self._changed()
        worker.send(
            ipc.Setup(
                worker=index,
                proxy=self.config,
                host=self._host,
                port=self._port,
                access_log=self.settings.access_log,
                log_level=self.settings.log_level,
                report_interval=self.settings.report_interval,
                services=tuple(self._installs()),
                tls_addresses=tuple(self._tls_addresses),
                workers=self.settings.count,
            )
        )
        worker.task = asyncio.create_task(self._run(worker), name=f"worker-{index}")
        return worker

    def _installs(self) -> list[ipc.Install]:
        return [ipc.Install(sp.routing, sp.snapshot) for sp in self.pool.services.values()]

    async def _run(self, worker: _Worker) -> None:
        """Read the worker's messages until it is gone; then restart it unless stopping."""
        try:
            while True:
                message = await ipc.receive(worker.reader)
                if message is None:
                    break
                self._take(worker, message)
        except Exception:
            log.exception("worker %d (pid %d): broken channel", worker.index, worker.pid)
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGKILL)
        finally:
            worker.writer.close()
            code = await worker.process.wait()
            self.pool.peer_left(worker.pid)
            if not worker.ready.done():
                worker.ready.set_exception(
                    RuntimeError(f"worker {worker.index} exited with {code} before serving")
                )
                worker.ready.exception()  # retrieved: start() reports it, a restart logs it
            if self.workers.get(worker.index) is worker:
                del self.workers[worker.index]
            self._changed()
            if not self._stopping:
                self._restart_later(worker, code)

    async def _watch(self) -> None:
        """Kill a worker that stopped reporting; ``_run`` then starts it again."""
        loop = asyncio.get_running_loop()
        hang_after = self.settings.hang_after
        while True:
            await asyncio.sleep(min(1.0, hang_after / 4))
            now = loop.time()
            for worker in list(self.workers.values()):
                if (
                    worker.ready.done()
                    and worker.process.returncode is None
                    and now - worker.heard > hang_after
                ):
                    log.error(
                        "worker %d (pid %d) has not reported for %.1fs: killing it",
                        worker.index,
                        worker.pid,
                        now - worker.heard,
                    )
                    worker.heard = now  # once: the kill is on its way
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGKILL)

    def _take(self, worker: _Worker, message: ipc.ToWorker | ipc.FromWorker) -> None:
        worker.heard = asyncio.get_running_loop().time()
        if isinstance(message, ipc.Report):
            worker.reports += 1
            worker.connections = message.connections
            worker.parked = message.parked
            worker.http2 = message.http2
            worker.served += sum(message.tally.outcomes.values())
            self.pool.peer_report(worker.pid, message.inflight, message.held, message.counts)
            for service, (counters, queued) in message.guards.items():
                sp = self.pool.services.get(service)
                if sp is not None:
                    sp.peer_counted(worker.pid, counters, queued)
            if self.metrics is not None and message.tally:
                self.metrics.merge(message.tally)
            if self.tls is not None and message.handshakes is not None:
                self.tls.tally.merge(message.handshakes)
        elif isinstance(message, ipc.Spans):
            if self.spans is not None:
                self.spans.lost(message.dropped)
                self.spans.add(message.spans)
            return  # not a change anyone waits for
        elif isinstance(message, ipc.Idle):
            self.pool.peer_idle(worker.pid, message.service, message.upstream_id, message.version)
        elif isinstance(message, ipc.Eject):
            self.pool.eject(message.service, message.upstream_id, message.reason)
        elif isinstance(message, ipc.Ready):
            if not worker.ready.done():
                worker.ready.set_result(None)
        else:
            raise TypeError(f"unexpected message from a worker: {message!r}")
        self._changed()

    def changed(self) -> asyncio.Future[None]:
        """A future resolved at the next change of what is known of the workers: a message
        from one (a report, a proposal, ready), one started or gone. What a caller waiting for
        a state of the workers awaits, instead of polling."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        return waiter

    def _changed(self) -> None:
        waiting, self._waiting = self._waiting, []
        for waiter in waiting:
            if not waiter.done():
                waiter.set_result(None)

    def _restart_later(self, worker: _Worker, code: int) -> None:
        loop = asyncio.get_running_loop()
        index = worker.index
        if loop.time() - worker.started >= STABLE_AFTER:
            self._failures[index] = 0
        low, high = RESTART_DELAY
        delay = min(high, low * 2 ** self._failures[index])
        self._failures[index] += 1
        log.error(
            "worker %d (pid %d) exited with %s; starting it again in %.1fs",
            index,
            worker.pid,
            code,
            delay,
        )

        async def restart() -> None:
            await asyncio.sleep(delay)
            if self._stopping or index in self.workers:
                return
            try:
                new = await self._spawn(index)
            except OSError as e:
                log.error("worker %d could not be started: %s", index, e)
                self._failures[index] += 1
                return
            self.restarted += 1
            log.info("worker %d started again: pid %d", index, new.pid)

        task = asyncio.create_task(restart(), name=f"restart-worker-{index}")
        self._restarts.add(task)
        task.add_done_callback(self._restarts.discard)

    # -- the pool -----------------------------------------------------------------------------

    def on_pool_event(self, event: PoolEvent) -> None:
        if event.kind == "drained" and not event.clean and event.upstream is not None:
            for worker in self.workers.values():
                worker.send(ipc.Abort(event.service, event.upstream.id))
            return
        if event.kind == "drained":
            return
        self._dirty[event.service] = event.kind != "service_removed"
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send_changes)

    def send_loads(self, service: str, reports: dict[str, ReplicaLoad]) -> None:
        """A service's replicas' load figures, scraped (``LoadScraper``), to every worker:
        the workers pick by them as the main process would."""
        message = ipc.Loads(service, reports)
        for worker in self.workers.values():
            worker.send(message)

    def _send_changes(self) -> None:
        self._flush = None
        dirty, self._dirty = self._dirty, {}
        for service, present in dirty.items():
            sp = self.pool.services.get(service)
            message: ipc.ToWorker
            if present and sp is not None:
                message = ipc.Install(sp.routing, sp.snapshot)
            else:
                message = ipc.Forget(service)
            for worker in self.workers.values():
                worker.send(message)

    def __repr__(self) -> str:
        pids = ",".join(str(w.pid) for w in self.workers.values())
        return f"<Supervisor {self._host}:{self._port} workers=[{pids}] stopping={self._stopping}>"


def _reserve(host: str, port: int) -> socket.socket:
    """A socket bound with SO_REUSEPORT that never listens: port 0 resolves once, and the port
    stays ours for the workers to bind beside it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    reservation = socket.socket(family, socket.SOCK_STREAM)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        reservation.bind((host, port))
    except OSError as exc:
        reservation.close()
        reason = (exc.strerror or str(exc)).lower()
        raise OSError(
            exc.errno, f"error while attempting to bind on address {(host, port)!r}: {reason}"
        ) from None
    return reservation


MIGRATE_REQ = "/proc/sys/net/ipv4/tcp_migrate_req"


def migrate_req_off(path: str = MIGRATE_REQ) -> bool:
    """Whether the kernel has the setting and it is off (an older kernel has no such file)."""
    try:
        with open(path) as f:
            return f.read().strip() == "0"
    except OSError:
        return False
