"""A worker process: serves traffic from a mirror of the controller's pool.

``gateway serve --workers N`` (N > 1) starts N of these (``supervisor``), each as
``python -m gateway.workers FD`` (``__main__``: the compiled modules first, then ``main``
here) with one end of a socketpair (``ipc``) at ``FD``. A
worker runs the data plane alone: a ``TrafficServer`` bound with SO_REUSEPORT to the port the
supervisor reserved (the kernel spreads connections over the workers), a ``Proxy``, and a
``Pool`` that is a mirror: it installs the snapshots the controller's pool publishes, and
never decides health, drains or ejections itself.

What goes back: ``Idle`` when an upstream the snapshot says is draining has no lease left
here (the controller's drain waits for that from every worker), ``Eject`` when passive
detection sees a failure streak, and every ``report_interval`` a ``Report`` of in-flight
counts and request counts (``RequestTally``) for ``/metrics``. With spans exported
(``tracing.otlp_endpoint``), the sampled requests' spans go back as ``Spans`` with each report
and whenever a batch is full, as plain tuples: the main process encodes and exports them.

A worker stops as the gateway does (stop accepting, finish in flight, close) on ``Stop``, on
SIGTERM, or when the channel ends because the controller's process is gone. SIGINT is
ignored: Ctrl-C reaches the whole process group, and the controller's process decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..observability.accesslog import AccessLog
from ..observability.span_buffer import SpanBuffer
from ..observability.tally import RequestTally
from ..pool.events import RequestObserver
from ..pool.pool import Pool
from ..pool.upstream import AdminState
from ..proxy.handler import Proxy
from ..server import TrafficServer
from . import ipc

if TYPE_CHECKING:
    from ..tls import Termination

log = logging.getLogger(__name__)


class Mirror:
    """Installs the controller's snapshots into ``pool`` and says when drains are done here."""

    def __init__(self, pool: Pool, send: Callable[[ipc.FromWorker], None]) -> None:
        self.pool = pool
        self.send = send
        self._watching: set[tuple[str, str]] = set()
        self._counted: dict[str, tuple[int, int]] = {}
        self._guarded: dict[str, dict[str, float]] = {}
        self._queued: set[str] = set()

    def install(self, message: ipc.Install) -> None:
        service = message.routing.name
        sp = self.pool.install(message.routing, message.snapshot)
        for upstream in sp.snapshot.upstreams:
            key = (service, upstream.id)
            if upstream.admin is AdminState.DRAINING and key not in self._watching:
                self._watching.add(key)
                sp.when_idle(upstream.id, lambda key=key: self._idle(key))  # type: ignore[misc]

    def _idle(self, key: tuple[str, str]) -> None:
        self._watching.discard(key)
        service, upstream_id = key
        sp = self.pool.services.get(service)
        upstream = sp.snapshot.get(upstream_id) if sp is not None else None
        if sp is not None and upstream is not None and upstream.admin is AdminState.DRAINING:
            self.send(ipc.Idle(service, upstream_id, sp.snapshot.version))

    def abort(self, message: ipc.Abort) -> None:
        sp = self.pool.services.get(message.service)
        if sp is not None:
            sp.abort(message.upstream_id)

    def inflight(self) -> dict[tuple[str, str], int]:
        return {
            (name, uid): count
            for name, sp in self.pool.services.items()
            for uid, count in sp.inflight.items()
        }

    def held(self) -> dict[str, int]:
        return {name: sp.held for name, sp in self.pool.services.items() if sp.held}

    def guards(self) -> dict[str, tuple[dict[str, float], int]]:
        """Per service, its counters since the previous call and its slot queue now."""
        out: dict[str, tuple[dict[str, float], int]] = {}
        for name, sp in self.pool.services.items():
            was = self._guarded.get(name, {})
            delta = {k: v - was.get(k, 0) for k, v in sp.counters.items() if v != was.get(k, 0)}
            if delta or sp.queued or name in self._queued:
                out[name] = (delta, sp.queued)
            self._guarded[name] = dict(sp.counters)
            if sp.queued:
                self._queued.add(name)
            else:
                self._queued.discard(name)
        return out

    def counts(self) -> dict[str, tuple[int, int]]:
        """(completed, waited) per service since the previous call."""
        out: dict[str, tuple[int, int]] = {}
        for name, sp in self.pool.services.items():
            was = self._counted.get(name, (0, 0))
            now = (sp.completed, sp.waited)
            self._counted[name] = now
            if now != was:
                out[name] = (max(now[0] - was[0], 0), max(now[1] - was[1], 0))
        return out


async def serve(channel: socket.socket) -> None:
    """Serve until told to stop (or the controller's process is gone)."""
    loop = asyncio.get_running_loop()
    reader, writer = await asyncio.open_unix_connection(sock=channel)
    setup = await ipc.receive(reader)
    if not isinstance(setup, ipc.Setup):
        raise RuntimeError(f"expected Setup first on the channel, got {setup!r}")
    logging.basicConfig(
        level=setup.log_level.upper(),
        format=f"%(asctime)s %(levelname)s worker-{setup.worker} %(name)s: %(message)s",
        stream=sys.stderr,
    )

    def send(message: ipc.FromWorker) -> None:
        if not writer.is_closing():
            writer.write(ipc.encode(message))

    pool = Pool(clock=loop.time, propose_ejection=lambda s, u, r: send(ipc.Eject(s, u, r)))
    pool.share = setup.workers
    mirror = Mirror(pool, send)
    for install in setup.services:
        mirror.install(install)
    tally = RequestTally()
    observers: list[RequestObserver] = [tally]
    access_log = None
    if setup.access_log is not None:
        access_log = AccessLog(*setup.access_log)
        observers.append(access_log)
        access_log.start()
    spans: SpanBuffer | None = None
    if setup.proxy.tracing.otlp_endpoint is not None:

        def batch_full() -> None:
            loop.call_soon(send_spans)  # off the request path that filled it

        spans = SpanBuffer(wake=batch_full)

    def send_spans() -> None:
        """Every span held (a batch a message), and the count of those dropped."""
        if spans is None:
            return
        dropped, spans.dropped = spans.dropped, 0
        while len(spans) or dropped:
            send(ipc.Spans(spans.take(loop.time()), dropped))
            dropped = 0

    proxy = Proxy(pool, setup.proxy, observers=observers, spans=spans)
    tls: Termination | None = None
    if setup.tls_addresses:
        from ..tls import Termination  # here: a worker without HTTPS listeners loads none of it

        tls = Termination(setup.proxy.tls)
    traffic = TrafficServer(
        proxy,
        setup.proxy,
        address=(setup.host, setup.port),
        reuse_port=True,
        tls=tls,
        tls_addresses=list(setup.tls_addresses),
    )

    def report() -> None:
        send_spans()
        send(
            ipc.Report(
                mirror.inflight(),
                tally.take(),
                traffic.connections,
                mirror.held(),
                mirror.counts(),
                tls.tally.take() if tls is not None else None,
                mirror.guards(),
                traffic.parked,
                traffic.http2,
            )
        )

    # The first request a service holds is reported at once: held requests are demand.
    pool.on_waiting = lambda service: loop.call_soon(report)

    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)

    async def listen() -> None:
        while True:
            message = await ipc.receive(reader)
            if message is None:
                log.warning("the gateway's main process is gone: stopping")
                return
            if isinstance(message, ipc.Stop):
                return
            if isinstance(message, ipc.Install):
                mirror.install(message)
            elif isinstance(message, ipc.Forget):
                pool.remove_service(message.service)
            elif isinstance(message, ipc.Abort):
                mirror.abort(message)
            elif isinstance(message, ipc.Loads):
                loaded = pool.services.get(message.service)
                if loaded is not None:
                    loaded.reports = message.reports
            elif isinstance(message, ipc.ReloadTls) and tls is not None:
                tls.reload()

    async def reporting() -> None:
        while True:
            await asyncio.sleep(setup.report_interval)
            report()

    await traffic.start()
    gc.collect()
    gc.freeze()
    send(ipc.Ready(setup.worker, os.getpid()))
    tasks = [
        asyncio.create_task(listen(), name="worker-channel"),
        asyncio.create_task(stop.wait(), name="worker-sigterm"),
    ]
    reporter = asyncio.create_task(reporting(), name="worker-report")
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a corrupt message is an error worth its traceback
    finally:
        for task in tasks:
            task.cancel()
        await traffic.stop()
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        if access_log is not None:
            await access_log.stop()
        report()  # what was counted since the last report
        with contextlib.suppress(ConnectionError):
            await writer.drain()  # nobody to tell when the main process is gone
        writer.close()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not 1 <= len(args) <= 2 or not args[0].isdigit():
        print(
            "usage: python -m gateway.workers FD [SOURCES] (started by the gateway itself)",
            file=sys.stderr,
        )
        return 2
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = socket.socket(fileno=int(args[0]))
    import uvloop

    uvloop.run(serve(channel))
    return 0
