"""When to order, renew and retry certificates, and for which hosts. PURE.

Times are wall-clock seconds (a certificate's validity is wall-clock). Nothing here reads a
clock, sleeps or draws a random number: the jitter comes in as a number in [0, 1), drawn by
the manager once per certificate (renewal) or per failure (retry).

Rules:

1. Hosts: the exact host names of the routes with ``tls: acme`` (of every route with
   ``all_routes``). A wildcard cannot be proved by HTTP-01 (only DNS-01 can), and a public CA
   issues no certificate for an IP address or a single-label name: each is skipped, with that
   reason, and its service is left as it is (plain HTTP).
2. A host without a usable certificate (none stored, one that does not name it, or one
   outside its validity) is ordered at once, unless a failure's retry is pending (rule 4).
3. A usable certificate is renewed once ``renew_at`` of its lifetime has passed, moved
   earlier by up to ``RENEW_JITTER`` of its lifetime, so that certificates issued together
   do not all renew together. Never before it became valid.
4. After ``n`` consecutive failures the next attempt waits ``retry_min * 2**(n-1)``, at most
   ``retry_max``, shortened by up to ``RETRY_JITTER`` of itself. A success resets ``n``.
5. A certificate is only ever replaced by a newer one: until a renewal succeeds, the stored
   one keeps being served while it is valid.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from gateway import RouteConfig

RENEW_JITTER = 0.05
"""Fraction of a certificate's lifetime by which its renewal may come earlier (rule 3)."""
RETRY_JITTER = 0.25
"""Fraction of a retry's delay by which it may come earlier (rule 4)."""


@dataclass(frozen=True, slots=True)
class Policy:
    """The schedule's settings (``tls.acme``)."""

    renew_at: float
    retry_min: float
    retry_max: float


@dataclass(frozen=True, slots=True)
class Certificate:
    """What the schedule needs of a stored certificate: its names and its validity."""

    names: tuple[str, ...]
    not_before: float
    not_after: float

    @property
    def lifetime(self) -> float:
        return self.not_after - self.not_before

    def usable_for(self, host: str, now: float) -> bool:
        """It names ``host`` and is valid at ``now``."""
        return host in self.names and self.not_before <= now < self.not_after


def renewal_time(certificate: Certificate, policy: Policy, jitter: float) -> float:
    """When ``certificate`` is renewed (rule 3); ``jitter`` in [0, 1)."""
    lifetime = max(0.0, certificate.lifetime)
    fraction = max(0.0, policy.renew_at - RENEW_JITTER * jitter)
    return certificate.not_before + lifetime * fraction


def retry_delay(failures: int, policy: Policy, jitter: float) -> float:
    """How long to wait after the ``failures``-th failure in a row (rule 4); ``jitter`` in
    [0, 1)."""
    exponent = min(max(0, failures - 1), 64)  # past 64 doublings every delay is retry_max
    base = min(policy.retry_max, policy.retry_min * 2.0**exponent)
    return base * (1.0 - RETRY_JITTER * jitter)


@dataclass(frozen=True, slots=True)
class HostState:
    """One host's certificate and its order history, as the manager keeps them."""

    host: str
    certificate: Certificate | None = None
    renew_jitter: float = 0.0
    """Drawn once per certificate (rule 3)."""
    failures: int = 0
    """Consecutive failed orders; 0 after a success."""
    last_error: str | None = None
    retry_at: float | None = None
    """When a failed order may be tried again (rule 4)."""

    def issued(self, certificate: Certificate, renew_jitter: float) -> HostState:
        """A new certificate was obtained: the failures are forgotten (rule 4)."""
        return HostState(self.host, certificate, renew_jitter)

    def failed(self, reason: str, now: float, policy: Policy, jitter: float) -> HostState:
        """An order failed at ``now``: the certificate held stays (rule 5)."""
        failures = self.failures + 1
        return dataclasses.replace(
            self,
            failures=failures,
            last_error=reason,
            retry_at=now + retry_delay(failures, policy, jitter),
        )

    def usable(self, now: float) -> bool:
        return self.certificate is not None and self.certificate.usable_for(self.host, now)


Action = Literal["obtain", "renew", "wait"]


@dataclass(frozen=True, slots=True)
class Step:
    """What to do for one host: ``obtain`` or ``renew`` now, or ``wait`` until ``at``."""

    action: Action
    at: float


def next_step(state: HostState, now: float, policy: Policy) -> Step:
    """The next thing to do for ``state``'s host at ``now`` (rules 2 to 4)."""
    if state.retry_at is not None and now < state.retry_at:
        if state.usable(now):
            assert state.certificate is not None
            renew = renewal_time(state.certificate, policy, state.renew_jitter)
            return Step("wait", max(state.retry_at, renew))
        return Step("wait", state.retry_at)
    if not state.usable(now):
        return Step("obtain", now)
    assert state.certificate is not None
    renew = renewal_time(state.certificate, policy, state.renew_jitter)
    if now >= renew:
        return Step("renew", now)
    return Step("wait", renew)


# -- which hosts ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Skipped:
    """A host that asks for a certificate this gateway cannot obtain (rule 1)."""

    services: tuple[str, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Demand:
    """The hosts that get a certificate, and those skipped, each with the services routing it
    (sorted)."""

    hosts: Mapping[str, tuple[str, ...]]
    skipped: Mapping[str, Skipped]


def skip_reason(host: str) -> str | None:
    """Why ``host`` (validated by ``RouteConfig``) cannot get a certificate by HTTP-01."""
    if host.startswith("*."):
        return "a wildcard: HTTP-01 cannot prove it (only DNS-01 can); not obtained"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return "an IP address: certificates are obtained for DNS names only"
    if "." not in host:
        return "a single-label name: no public CA issues a certificate for it"
    return None


def demand(routes: Iterable[tuple[str, RouteConfig]], all_routes: bool) -> Demand:
    """The hosts of ``routes`` (service name, route) that want a certificate (rule 1)."""
    wanted: dict[str, set[str]] = {}
    for service, route in routes:
        if route.tls != "acme" and not all_routes:
            continue
        for host in route.hosts:
            wanted.setdefault(host, set()).add(service)
    hosts: dict[str, tuple[str, ...]] = {}
    skipped: dict[str, Skipped] = {}
    for host in sorted(wanted):
        services = tuple(sorted(wanted[host]))
        reason = skip_reason(host)
        if reason is None:
            hosts[host] = services
        else:
            skipped[host] = Skipped(services, reason)
    return Demand(hosts, skipped)
