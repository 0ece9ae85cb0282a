"""controller/acme/schedule.py: when to order, renew and retry, and for which hosts (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controller.acme.schedule import (
    RENEW_JITTER,
    RETRY_JITTER,
    Certificate,
    HostState,
    Policy,
    Step,
    demand,
    next_step,
    renewal_time,
    retry_delay,
)
from gateway import RouteConfig, parse_settings

POLICY = Policy(renew_at=2 / 3, retry_min=60.0, retry_max=3600.0)
DAY = 86_400.0
CERT = Certificate(("app.example.com",), not_before=1000.0, not_after=1000.0 + 90 * DAY)


@pytest.mark.parametrize(
    ("jitter", "expected"),
    [
        (0.0, 1000.0 + 60 * DAY),  # two thirds of 90 days
        (0.5, 1000.0 + 90 * DAY * (2 / 3 - RENEW_JITTER / 2)),
        (0.999, 1000.0 + 90 * DAY * (2 / 3 - RENEW_JITTER * 0.999)),
    ],
)
def test_renewal_at_renew_at_of_the_lifetime_less_jitter(jitter: float, expected: float) -> None:
    assert renewal_time(CERT, POLICY, jitter) == pytest.approx(expected)


def test_renewal_is_never_before_the_certificate_is_valid() -> None:
    early = Policy(renew_at=0.01, retry_min=1, retry_max=2)
    assert renewal_time(CERT, early, 0.99) == CERT.not_before


@pytest.mark.parametrize(
    ("failures", "jitter", "expected"),
    [
        (1, 0.0, 60.0),
        (2, 0.0, 120.0),
        (3, 0.0, 240.0),
        (6, 0.0, 1920.0),
        (7, 0.0, 3600.0),  # 3840 capped
        (50, 0.0, 3600.0),
        (10_000, 0.0, 3600.0),  # no float overflow
        (1, 0.5, 60.0 * (1 - RETRY_JITTER / 2)),
        (7, 0.999, 3600.0 * (1 - RETRY_JITTER * 0.999)),
    ],
)
def test_retry_delay_doubles_from_retry_min_up_to_retry_max(
    failures: int, jitter: float, expected: float
) -> None:
    assert retry_delay(failures, POLICY, jitter) == pytest.approx(expected)


NOW = 1000.0 + 10 * DAY
HOST = "app.example.com"


@pytest.mark.parametrize(
    ("state", "now", "expected"),
    [
        # rule 2: nothing stored, or nothing usable: ordered at once
        (HostState(HOST), NOW, Step("obtain", NOW)),
        (HostState(HOST, Certificate(("a.example.com",), 0, 2 * NOW)), NOW, Step("obtain", NOW)),
        (HostState(HOST, Certificate((HOST,), 0, NOW)), NOW, Step("obtain", NOW)),  # expired
        (HostState(HOST, Certificate((HOST,), NOW + 1, NOW + 9)), NOW, Step("obtain", NOW)),
        # rule 3: a usable certificate waits for its renewal time, then is renewed
        (HostState(HOST, CERT), NOW, Step("wait", 1000.0 + 60 * DAY)),
        (HostState(HOST, CERT), 1000.0 + 60 * DAY, Step("renew", 1000.0 + 60 * DAY)),
        (HostState(HOST, CERT), 1000.0 + 89 * DAY, Step("renew", 1000.0 + 89 * DAY)),
        # rule 4: a pending retry is waited for, with or without a certificate
        (
            HostState(HOST, failures=2, last_error="x", retry_at=NOW + 120),
            NOW,
            Step("wait", NOW + 120),
        ),
        (
            HostState(HOST, failures=2, last_error="x", retry_at=NOW + 120),
            NOW + 120,
            Step("obtain", NOW + 120),
        ),
        (
            HostState(HOST, CERT, failures=1, retry_at=1000.0 + 61 * DAY),
            1000.0 + 60.5 * DAY,
            Step("wait", 1000.0 + 61 * DAY),
        ),
        (
            HostState(HOST, CERT, failures=1, retry_at=1000.0 + 61 * DAY),
            1000.0 + 61 * DAY,
            Step("renew", 1000.0 + 61 * DAY),
        ),
        # a certificate that expired while a retry waited: obtained at the retry
        (
            HostState(HOST, CERT, failures=9, retry_at=1000.0 + 91 * DAY),
            1000.0 + 90.5 * DAY,
            Step("wait", 1000.0 + 91 * DAY),
        ),
        (
            HostState(HOST, CERT, failures=9, retry_at=1000.0 + 91 * DAY),
            1000.0 + 91 * DAY,
            Step("obtain", 1000.0 + 91 * DAY),
        ),
    ],
)
def test_next_step(state: HostState, now: float, expected: Step) -> None:
    assert next_step(state, now, POLICY) == expected


def test_a_failure_keeps_the_certificate_and_a_success_forgets_the_failures() -> None:
    state = HostState(HOST, CERT)
    failed = state.failed("connection refused", NOW, POLICY, 0.0)
    assert failed.certificate == CERT
    assert (failed.failures, failed.last_error, failed.retry_at) == (
        1,
        "connection refused",
        NOW + 60,
    )
    again = failed.failed("timeout", NOW + 60, POLICY, 0.0)
    assert (again.failures, again.retry_at, again.last_error) == (2, NOW + 180, "timeout")
    newer = Certificate((HOST,), NOW, NOW + 90 * DAY)
    assert again.issued(newer, 0.3) == HostState(HOST, newer, 0.3)


def routes(*entries: tuple[str, dict[str, object]]) -> list[tuple[str, RouteConfig]]:
    return [(name, parse_settings(RouteConfig, route)) for name, route in entries]


def test_demand_takes_the_exact_hosts_of_routes_with_tls_acme() -> None:
    wanted = demand(
        routes(
            ("web", {"hosts": ["www.example.com", "Example.COM."], "tls": "acme"}),
            ("api", {"hosts": ["api.example.com"]}),  # no tls: acme
            ("docs", {"hosts": ["www.example.com"], "path_prefix": "/docs", "tls": "acme"}),
            ("any", {"path_prefix": "/x", "tls": "acme"}),  # no hosts: nothing to obtain
            ("wild", {"hosts": ["*.example.com"], "tls": "acme"}),
            ("ip", {"hosts": ["192.0.2.7"], "tls": "acme"}),
            ("local", {"hosts": ["localhost"], "tls": "acme"}),
        ),
        all_routes=False,
    )
    assert dict(wanted.hosts) == {"example.com": ("web",), "www.example.com": ("docs", "web")}
    assert sorted(wanted.skipped) == ["*.example.com", "192.0.2.7", "localhost"]
    assert "HTTP-01 cannot prove it" in wanted.skipped["*.example.com"].reason
    assert wanted.skipped["*.example.com"].services == ("wild",)
    assert "IP address" in wanted.skipped["192.0.2.7"].reason
    assert "single-label" in wanted.skipped["localhost"].reason


def test_demand_with_all_routes_takes_every_route() -> None:
    wanted = demand(
        routes(("web", {"hosts": ["www.example.com"]}), ("api", {"hosts": ["api.example.com"]})),
        all_routes=True,
    )
    assert dict(wanted.hosts) == {"api.example.com": ("api",), "www.example.com": ("web",)}
    assert not wanted.skipped


# -- properties -------------------------------------------------------------------------------

policies = st.builds(
    lambda renew_at, low, factor: Policy(renew_at, low, low * factor),
    st.floats(0.01, 0.99),
    st.floats(0.001, 1e6),
    st.floats(1.0, 1e4),
)
jitters = st.floats(0.0, 1.0, exclude_max=True)
certificates = st.builds(
    lambda start, lifetime: Certificate((HOST,), start, start + lifetime),
    st.floats(0, 2e9),
    st.floats(1.0, 4e8),
)


@given(policies, st.integers(1, 200), jitters)
def test_retry_delay_is_within_its_bounds_and_grows(
    policy: Policy, failures: int, jitter: float
) -> None:
    delay = retry_delay(failures, policy, jitter)
    assert (1 - RETRY_JITTER) * policy.retry_min <= delay * (1 + 1e-9)
    assert delay <= policy.retry_max * (1 + 1e-9)
    assert retry_delay(failures + 1, policy, 0.0) >= retry_delay(failures, policy, 0.0)


@given(certificates, policies, jitters)
def test_renewal_falls_within_the_certificate_lifetime(
    cert: Certificate, policy: Policy, jitter: float
) -> None:
    at = renewal_time(cert, policy, jitter)
    assert cert.not_before <= at < cert.not_after


@given(
    certificates,
    policies,
    jitters,
    st.integers(0, 30),
    st.floats(-1e6, 1e6),
    st.floats(0, 4e8),
)
def test_next_step_never_waits_into_the_past_and_orders_only_when_due(
    cert: Certificate,
    policy: Policy,
    jitter: float,
    failures: int,
    retry_offset: float,
    since_start: float,
) -> None:
    now = cert.not_before + since_start
    retry_at = now + retry_offset if failures else None
    state = HostState(HOST, cert, jitter, failures, "e" if failures else None, retry_at)
    step = next_step(state, now, policy)
    if step.action == "wait":
        assert step.at > now
    else:
        assert step.at == now
        assert retry_at is None or retry_at <= now  # rule 4: a retry is never early
        if step.action == "renew":  # rule 3: only a usable certificate that is due
            assert state.usable(now)
            assert now >= renewal_time(cert, policy, jitter)
        else:
            assert not state.usable(now)  # rule 2
