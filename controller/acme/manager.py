"""The ACME manager: one task that keeps a certificate for every host that asks for one.

Each turn it reads the hosts from the services' routes (``schedule.demand``), takes each
host's next step from ``schedule.next_step`` and does it: nothing, an order for a missing
certificate, or a renewal. Then it sleeps until the soonest next step, or until a service is
created, changed or deleted. Orders run one at a time.

- At start, a stored certificate that is still valid is taken as it is: no order.
- A new certificate is written to the store, then the data plane is told
  (``on_certificates``); the journal says ``certificate_issued`` or ``certificate_renewed``.
- A failed order is journalled (``certificate_failed``, with the reason) and retried with
  backoff; the certificate held, if still valid, keeps being served. Nothing about the
  service changes: it goes on serving plain HTTP whatever happens here.
- ``status()`` is what ``gateway status``, the admin API and the metrics show.

Times are wall-clock seconds (``clock``, ``time.time`` by default): certificates' are.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gateway import RouteConfig

from ..config import AcmeConfig
from ..journal import Entry, Journal
from ..operations import Controller
from ..planning.model import EventKind
from ..tasks import wait_set
from .errors import AcmeError
from .schedule import Demand, HostState, Policy, demand, next_step, renewal_time
from .store import AcmeStore, StoredCertificate

if TYPE_CHECKING:  # the client (josepy, requests, cryptography) only once ACME is configured
    from .client import Issued

log = logging.getLogger("gateway.acme")

MAX_SLEEP = 3600.0
"""The longest the loop sleeps without looking again (the wall clock may jump)."""
WAKING_KINDS = frozenset({"service_created", "service_updated", "service_deleted"})
"""Journal entries after which the hosts are read again."""

OrderOutcome = Literal["issued", "renewed", "failed"]
ORDER_OUTCOMES: tuple[OrderOutcome, ...] = ("issued", "renewed", "failed")
CertificateState = Literal["valid", "pending", "failing", "skipped"]
"""``valid``: a certificate is served and no order failed since; ``pending``: none yet, the
first order is to come or under way; ``failing``: the last order failed (a retry is due at
``next_order``; ``not_after`` says until when the old one, if any, serves); ``skipped``: the
host cannot get one by HTTP-01 (``last_error`` says why)."""

Routes = Callable[[], Iterable[tuple[str, RouteConfig]]]
Reload = Callable[[], Awaitable[object]]
Orderer = Callable[[str], Awaitable["Issued"]]


@dataclass(frozen=True, slots=True)
class CertificateStatus:
    """One host's certificate as ``gateway status`` shows it."""

    name: str
    services: tuple[str, ...]
    state: CertificateState
    names: tuple[str, ...] = ()
    issuer: str | None = None
    not_before: float | None = None
    not_after: float | None = None
    next_order: float | None = None
    """When the next order (renewal or retry) is due; None for a skipped host."""
    ordering: bool = False
    """An order for it is under way."""
    failures: int = 0
    last_error: str | None = None


def controller_routes(controller: Controller) -> Routes:
    """The routes of ``controller``'s services (those being deleted left out)."""

    def routes() -> list[tuple[str, RouteConfig]]:
        out = []
        for name in controller.service_names():
            state = controller.state(name)
            if not state.desired.deleting:
                out.append((name, state.spec.route))
        return out

    return routes


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class AcmeManager:
    """Obtains and renews the certificates of ``routes``' hosts; ``start`` and ``stop`` with
    the gateway. ``obtain`` replaces the ACME client (tests)."""

    def __init__(
        self,
        config: AcmeConfig,
        state_dir: Path,
        routes: Routes,
        journal: Journal,
        on_certificates: Reload | None = None,
        *,
        obtain: Orderer | None = None,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.store = AcmeStore(state_dir / "acme")
        from .client import AcmeClient

        self.client = AcmeClient(config, self.store)
        self._obtain = obtain or self.client.obtain
        self._routes = routes
        self._journal = journal
        self._on_certificates = on_certificates
        self._clock = clock
        self._rng = rng or random.Random()
        self._policy = Policy(config.renew_at, config.retry_min, config.retry_max)
        self._hosts: dict[str, HostState] = {}
        self._issuers: dict[str, str] = {}
        self._demand = Demand({}, {})
        self._ordering: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.orders: dict[OrderOutcome, int] = dict.fromkeys(ORDER_OUTCOMES, 0)
        """Orders ended since start, by outcome."""
        journal.listen(self._on_entry)

    @property
    def certificates_dir(self) -> Path:
        """Where the certificates are (``tls.managed_dir``)."""
        return self.store.certificates_dir

    async def start(self) -> None:
        await asyncio.to_thread(self.store.prepare)
        self._task = asyncio.create_task(self._run(), name="acme-manager")
        self._task.add_done_callback(self._ended)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    def wake(self) -> None:
        """Read the hosts again now."""
        self._wake.set()

    def _on_entry(self, entry: Entry) -> None:
        if entry.kind in WAKING_KINDS:
            self._wake.set()

    @staticmethod
    def _ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the ACME manager stopped", exc_info=task.exception())

    # -- the loop -------------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            await self._read_demand()
            for host in list(self._demand.hosts):
                state = self._hosts.get(host)
                if state is None:
                    continue  # gone while an earlier order ran
                step = next_step(state, self._clock(), self._policy)
                if step.action != "wait":
                    await self._order(host, step.action)
            now = self._clock()
            soonest = min(
                (next_step(s, now, self._policy).at for s in self._hosts.values()),
                default=now + MAX_SLEEP,
            )
            delay = min(MAX_SLEEP, max(0.0, soonest - now))
            await wait_set(self._wake, delay)

    async def _read_demand(self) -> None:
        """The hosts as the routes say now: a new one starts from its stored certificate (if
        valid, it is served and renewed in its time: no order); a gone one is forgotten (its
        files stay)."""
        try:
            routes = list(self._routes())
        except Exception:  # keep the hosts known: a bug here must not end every renewal
            log.exception("the services' routes could not be read; the hosts known are kept")
            return
        self._demand = demand(routes, self.config.all_routes)
        for host in [h for h in self._hosts if h not in self._demand.hosts]:
            del self._hosts[host]
            self._issuers.pop(host, None)
        for host in self._demand.hosts:
            if host in self._hosts:
                continue
            state = HostState(host)
            try:
                stored = await asyncio.to_thread(self.store.certificate, host)
            except AcmeError as e:
                log.warning("stored certificate for %s not used: %s", host, e.reason)
                stored = None
            if stored is not None:
                state = state.issued(stored.certificate, self._rng.random())
                self._issuers[host] = stored.issuer
                if state.usable(self._clock()):
                    log.info(
                        "certificate for %s: the stored one is used, valid until %s",
                        host,
                        iso(stored.certificate.not_after),
                    )
            self._hosts[host] = state
        for host, skipped in self._demand.skipped.items():
            log.debug("no certificate for %s: %s", host, skipped.reason)

    async def _order(self, host: str, action: Literal["obtain", "renew"]) -> None:
        self._ordering = host
        try:
            issued = await self._obtain(host)
            stored = await asyncio.to_thread(
                self.store.write_certificate, host, issued.fullchain_pem, issued.key_pem
            )
        except AcmeError as e:
            self._failed(host, e.reason)
            return
        except Exception as e:  # a bug must cost this order, not every later renewal
            log.exception("order for %s failed unexpectedly", host)
            self._failed(host, f"unexpected error: {type(e).__name__}: {e}")
            return
        finally:
            self._ordering = None
        self._issued(host, action, stored)
        if self._on_certificates is not None:
            try:
                await self._on_certificates()
            except Exception:  # the certificate is stored: the next reload or start serves it
                log.exception("the data plane did not take the new certificate for %s", host)

    def _issued(
        self, host: str, action: Literal["obtain", "renew"], stored: StoredCertificate
    ) -> None:
        old = self._hosts.get(host, HostState(host))
        # A renewal is an order for a host that still had a valid certificate when it began.
        renewed = action == "renew"
        state = old.issued(stored.certificate, self._rng.random())
        self._hosts[host] = state
        self._issuers[host] = stored.issuer
        outcome: OrderOutcome = "renewed" if renewed else "issued"
        self.orders[outcome] += 1
        renew = renewal_time(stored.certificate, self._policy, state.renew_jitter)
        message = (
            f"certificate for {host} {outcome} by {stored.issuer}, valid until"
            f" {iso(stored.certificate.not_after)}; renewal from {iso(renew)}"
        )
        kind: EventKind = "certificate_renewed" if renewed else "certificate_issued"
        self._record(host, kind, message)

    def _failed(self, host: str, reason: str) -> None:
        now = self._clock()
        old = self._hosts.get(host, HostState(host))
        state = old.failed(reason, now, self._policy, self._rng.random())
        self._hosts[host] = state
        self.orders["failed"] += 1
        delay = (state.retry_at or now) - now
        message = (
            f"certificate for {host} not obtained (failure {state.failures}): {reason};"
            f" retried in {delay:.1f}s"
        )
        if state.usable(now) and state.certificate is not None:
            message += f"; the current one, valid until {iso(state.certificate.not_after)}, serves"
        else:
            message += "; the service is served as before, over plain HTTP"
        self._record(host, "certificate_failed", message)

    def _record(self, host: str, kind: EventKind, message: str) -> None:
        for service in self._demand.hosts.get(host, ()) or ("acme",):
            self._journal.record(service, kind, message)

    # -- what it shows --------------------------------------------------------------------------

    def status(self) -> list[CertificateStatus]:
        """Every host that asks for a certificate, sorted by name."""
        now = self._clock()
        out = []
        for host, services in self._demand.hosts.items():
            state = self._hosts.get(host)
            if state is None:
                continue
            cert = state.certificate
            step = next_step(state, now, self._policy)
            shown: CertificateState
            if state.failures:
                shown = "failing"
            elif state.usable(now):
                shown = "valid"
            else:
                shown = "pending"
            out.append(
                CertificateStatus(
                    name=host,
                    services=services,
                    state=shown,
                    names=cert.names if cert else (),
                    issuer=self._issuers.get(host),
                    not_before=cert.not_before if cert else None,
                    not_after=cert.not_after if cert else None,
                    next_order=step.at,
                    ordering=self._ordering == host,
                    failures=state.failures,
                    last_error=state.last_error,
                )
            )
        for host, skipped in self._demand.skipped.items():
            out.append(
                CertificateStatus(
                    name=host, services=skipped.services, state="skipped", last_error=skipped.reason
                )
            )
        return sorted(out, key=lambda s: s.name)

    def __repr__(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in self.orders.items())
        return f"<AcmeManager hosts={len(self._hosts)} ordering={self._ordering} {counts}>"
