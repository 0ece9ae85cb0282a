"""The prober: active health checks, one guarded task per upstream.

Each task loops: probe the upstream, feed the result to its ``HealthState``, and on a
transition set the upstream's health in the pool; then wait a jittered interval. The first
probe of a new upstream runs at once, so a replica that is up is admitted after
``healthy_threshold`` quick passes rather than after as many intervals.

Which probes run: the upstream's own (``Upstream.probes``, its revision's) if any, else the
service's (``ServiceRouting.probes``), else one TCP probe with defaults. Both are read afresh
every round, so a change of the service's routing takes effect at the next probe (and a
pending wait is re-timed at once). All of an upstream's probes must pass for the round to
pass. With several probes, the round uses the **largest** ``healthy_threshold`` and
``unhealthy_threshold`` (the strictest admission, the most patient fall) and the **smallest**
``interval`` and the largest ``jitter`` among them, so no probe is checked less often than it
asks to be.

A passing round also calls ``Pool.probe_passed``: a passive ejection whose time is up is
lifted by an active probe, never by the clock alone.

Invariants: a task never dies silently. An unexpected error inside a round is logged and
counted as a failed probe; a task that still ends with an error is logged and restarted after
its interval. Cancellation is never swallowed. ``stop`` cancels and awaits every task.

An HTTP probe is one request on a connection of its own (``probe_client``): no client
library, no session to open or close. To a service with ``upstream_tls`` every probe is made
over TLS as its requests are (a TCP probe passes once the handshake does), so a replica
whose certificate fails verification never becomes healthy, and the probe says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from ..config import ProbeConfig
from ..pool.events import PoolEvent, ProbeObserver, ProbeOutcome, ProbeResult
from ..pool.pool import Pool
from ..pool.upstream import Upstream
from ..wire.upstream_tls import (
    H2,
    HTTP1,
    UpstreamTls,
    UpstreamTlsError,
    alpn_of,
    handshake_failure,
    tls_of,
)
from . import probe_client
from .state import HealthState

log = logging.getLogger(__name__)

Key = tuple[str, str]
"""(service, upstream id)"""

DEFAULT_PROBES: tuple[ProbeConfig, ...] = (ProbeConfig(type="tcp"),)
"""What runs when neither the upstream nor its service names a probe."""


@dataclass(frozen=True, slots=True)
class Schedule:
    """How one upstream's probes are timed and counted, merged over all of its probes."""

    interval: float
    jitter: float
    healthy_threshold: int
    unhealthy_threshold: int

    @classmethod
    def of(cls, probes: Sequence[ProbeConfig]) -> Schedule:
        return cls(
            interval=min(p.interval for p in probes),
            jitter=max(p.jitter for p in probes),
            healthy_threshold=max(p.healthy_threshold for p in probes),
            unhealthy_threshold=max(p.unhealthy_threshold for p in probes),
        )


class _Probe:
    """The state of one upstream's task, kept between rounds."""

    __slots__ = ("health", "wake")

    def __init__(self, health: HealthState) -> None:
        self.health = health
        self.wake = asyncio.Event()
        """Set when the service's routing changes, so a pending wait is re-timed."""


class Prober:
    """Runs the active probes of every upstream in ``pool`` while started.

    A ``PoolSubscriber``: it starts a task when an upstream is added and cancels it when the
    upstream (or its service) is removed. ``rng`` draws the jitter; inject a seeded one in
    tests.
    """

    def __init__(
        self,
        pool: Pool,
        observers: Sequence[ProbeObserver] = (),
        rng: random.Random | None = None,
    ) -> None:
        self._pool = pool
        self._observers = tuple(observers)
        self._rng = rng or random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: dict[Key, asyncio.Task[None]] = {}
        self._retired: set[asyncio.Task[None]] = set()
        self._probes: dict[Key, _Probe] = {}
        self._stopping = False
        self.rounds = 0
        """Probe rounds run (one per upstream per interval)."""
        self.failures = 0
        """Rounds that did not pass (failure or timeout)."""
        self.errors = 0
        """Unexpected errors inside the prober itself (each also counted as a failure)."""
        self.restarts = 0
        """Tasks that ended with an error and were restarted."""

    # -- life cycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Subscribe to the pool and start probing every upstream already in it."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._pool.subscribe(self)
        for name, service in list(self._pool.services.items()):
            for upstream in service.snapshot.upstreams:
                self._begin((name, upstream.id), upstream)

    async def stop(self) -> None:
        """Cancel every probe task and wait for them to end."""
        self._stopping = True
        self._pool.unsubscribe(self)
        tasks = [*self._tasks.values(), *self._retired]
        self._tasks.clear()
        self._probes.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._retired.clear()
        self._loop = None

    # -- pool events --------------------------------------------------------------------------

    def on_pool_event(self, event: PoolEvent) -> None:
        try:
            self._on_pool_event(event)
        except Exception:
            log.exception("prober failed on pool event %s", event.kind)

    def _on_pool_event(self, event: PoolEvent) -> None:
        if self._stopping or self._loop is None:
            return
        if event.kind == "added" and event.upstream is not None:
            self._begin((event.service, event.upstream.id), event.upstream)
        elif event.kind == "removed" and event.upstream is not None:
            self._end((event.service, event.upstream.id))
        elif event.kind == "service_removed":
            for key in [k for k in self._tasks if k[0] == event.service]:
                self._end(key)
        elif event.kind == "service_set":
            for key, probe in self._probes.items():
                if key[0] == event.service:
                    probe.wake.set()

    def _begin(self, key: Key, upstream: Upstream, immediate: bool = True) -> None:
        if key in self._tasks:
            return
        if key not in self._probes:
            schedule = Schedule.of(self._probes_of(upstream) or DEFAULT_PROBES)
            health = HealthState(
                schedule.healthy_threshold, schedule.unhealthy_threshold, self._now()
            )
            # Mirror the pool (unknown for a new upstream), so a restarted prober does not
            # flip an upstream that is already healthy.
            health.health = upstream.health
            self._probes[key] = _Probe(health)
        assert self._loop is not None
        task = self._loop.create_task(
            self._run(key, immediate), name=f"probe {key[0]}/{key[1]} ({upstream.address})"
        )
        self._tasks[key] = task
        task.add_done_callback(functools.partial(self._task_done, key))

    def _end(self, key: Key) -> None:
        self._probes.pop(key, None)
        task = self._tasks.pop(key, None)
        if task is not None:
            task.cancel()
            self._retired.add(task)

    def _task_done(self, key: Key, task: asyncio.Task[None]) -> None:
        self._retired.discard(task)
        if self._tasks.get(key) is task:
            del self._tasks[key]
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            return  # the upstream left the pool
        log.error("probe task %s ended unexpectedly", task.get_name(), exc_info=error)
        self.restarts += 1
        upstream = self._pool.upstream(*key)
        if not self._stopping and self._loop is not None and upstream is not None:
            self._begin(key, upstream, immediate=False)

    # -- the loop -----------------------------------------------------------------------------

    async def _run(self, key: Key, immediate: bool) -> None:
        if not immediate:
            await self._pause(key, self._rng.uniform(-1.0, 1.0))
        while True:
            upstream = self._pool.upstream(*key)
            probe = self._probes.get(key)
            if upstream is None or probe is None:
                return
            try:
                await self._round(upstream, probe.health)
            except Exception:
                # A bug in the prober must not leave an upstream unchecked (and silently
                # healthy): count it as a failed probe and carry on.
                log.exception("probe of %s/%s failed unexpectedly", *key)
                self.errors += 1
                with contextlib.suppress(Exception):
                    self._record(upstream, probe.health, "failure", 0.0, "prober error")
            await self._pause(key, self._rng.uniform(-1.0, 1.0))

    async def _pause(self, key: Key, draw: float) -> None:
        """Wait one jittered interval; re-time it when the service's routing changes."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        while True:
            upstream = self._pool.upstream(*key)
            probe = self._probes.get(key)
            if upstream is None or probe is None:
                return
            schedule = Schedule.of(self._probes_of(upstream) or DEFAULT_PROBES)
            delay = started + schedule.interval * (1 + schedule.jitter * draw) - loop.time()
            probe.wake.clear()
            if delay <= 0:
                return
            try:  # not wait_for: on 3.11 it can swallow the prober's cancel (gh-86296)
                async with asyncio.timeout(delay):
                    await probe.wake.wait()
            except TimeoutError:
                return

    async def _round(self, upstream: Upstream, health: HealthState) -> None:
        probes = self._probes_of(upstream) or DEFAULT_PROBES
        schedule = Schedule.of(probes)
        health.healthy_threshold = schedule.healthy_threshold
        health.unhealthy_threshold = schedule.unhealthy_threshold
        loop = asyncio.get_running_loop()
        started = loop.time()
        outcome: ProbeOutcome = "success"
        reason = ""
        for probe in probes:
            outcome, reason = await self.check(upstream, probe)
            if outcome != "success":
                break
        self._record(upstream, health, outcome, loop.time() - started, reason)

    def _record(
        self,
        upstream: Upstream,
        health: HealthState,
        outcome: ProbeOutcome,
        duration: float,
        reason: str,
    ) -> None:
        self.rounds += 1
        ok = outcome == "success"
        if not ok:
            self.failures += 1
        transition = health.observe(ok, self._now(), reason)
        if transition is not None:
            log.info(
                "upstream %s/%s %s -> %s: %s",
                upstream.service,
                upstream.id,
                transition.old.value,
                transition.new.value,
                transition.reason,
            )
            self._pool.set_health(upstream.service, upstream.id, transition.new, transition.reason)
        if ok:
            self._pool.probe_passed(upstream.service, upstream.id)
        result = ProbeResult(upstream.service, upstream.id, outcome, duration, reason)
        for observer in self._observers:
            try:
                observer.on_probe(result)
            except Exception:
                log.exception("probe observer %r failed", observer)

    def _probes_of(self, upstream: Upstream) -> tuple[ProbeConfig, ...]:
        if upstream.probes:
            return upstream.probes
        service = self._pool.services.get(upstream.service)
        return service.routing.probes if service is not None else ()

    def _now(self) -> float:
        return (self._loop or asyncio.get_running_loop()).time()

    # -- one probe ----------------------------------------------------------------------------

    async def check(self, upstream: Upstream, probe: ProbeConfig) -> tuple[ProbeOutcome, str]:
        """Run one probe against one upstream, bounded by ``probe.timeout``.

        Returns the outcome and, unless it passed, the reason. Never raises but on
        cancellation.
        """
        try:
            async with asyncio.timeout(probe.timeout):
                if probe.type == "tcp":
                    return await self._tcp(upstream)
                if probe.type == "grpc":
                    return await self._grpc(upstream, probe)
                return await self._http(upstream, probe)
        except TimeoutError:
            return "timeout", f"{probe.type} probe timed out after {probe.timeout:g}s"
        except ssl.SSLError as error:
            return "failure", f"{probe.type} probe: {handshake_failure(error)}"
        except (probe_client.ProbeError, OSError, UpstreamTlsError) as error:
            return "failure", f"{probe.type} probe: {type(error).__name__}: {error}"

    def _tls(self, upstream: Upstream, alpn: str | None = None) -> UpstreamTls | None:
        """The TLS of ``upstream``'s service (``upstream_tls``), offering ``alpn`` (None: as
        its requests do), or None: plain."""
        service = self._pool.services.get(upstream.service)
        if service is None:
            return None
        routing = service.routing
        return tls_of(routing.upstream_tls, alpn or alpn_of(routing.upstream_protocol))

    async def _tcp(self, upstream: Upstream) -> tuple[ProbeOutcome, str]:
        transport, _ = await probe_client.connect(
            asyncio.Protocol, upstream.host, upstream.port, self._tls(upstream)
        )
        transport.close()
        return "success", ""

    async def _grpc(self, upstream: Upstream, probe: ProbeConfig) -> tuple[ProbeOutcome, str]:
        from . import grpc_probe  # loads h2: only where a service asks for a gRPC probe

        status = await grpc_probe.check(
            upstream.host,
            upstream.port,
            probe.service,
            authority=upstream.address,
            tls=self._tls(upstream, H2),
        )
        if status == grpc_probe.SERVING:
            return "success", ""
        name = grpc_probe.STATUS_NAMES.get(status, str(status))
        return "failure", f"grpc probe {probe.service or '(server)'}: {name}"

    async def _http(self, upstream: Upstream, probe: ProbeConfig) -> tuple[ProbeOutcome, str]:
        # A connection of its own, closed at once (redirects are not followed, no cookies
        # are kept): a probe proves the replica accepts connections now.
        status = await probe_client.status(
            upstream.host,
            upstream.port,
            probe.method,
            probe.path,
            probe.headers,
            authority=upstream.address,
            tls=self._tls(upstream, HTTP1),
        )
        if probe.expected_statuses:
            passed = status in probe.expected_statuses
        else:
            passed = 200 <= status < 300
        if passed:
            return "success", ""
        return "failure", f"http probe {probe.method} {probe.path}: status {status}"

    # -- status -------------------------------------------------------------------------------

    def state(self, service: str, upstream_id: str) -> HealthState | None:
        """The health counters of one upstream, or None if it is not probed."""
        probe = self._probes.get((service, upstream_id))
        return probe.health if probe is not None else None

    def __repr__(self) -> str:
        return (
            f"<Prober tasks={len(self._tasks)} rounds={self.rounds} failures={self.failures} "
            f"errors={self.errors} restarts={self.restarts}>"
        )
