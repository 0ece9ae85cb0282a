"""The data plane's metrics change as the things they measure happen, and go when they go."""

from __future__ import annotations

import asyncio
import math
import pickle
import shutil
import subprocess
from bisect import bisect_left

import pytest
from aiohttp import web
from aiohttp.test_utils import unused_port
from prometheus_client import CollectorRegistry, generate_latest

from gateway.config import ProbeConfig, ProxyConfig
from gateway.health.prober import Prober
from gateway.observability.metrics import UPSTREAM_STATES, GatewayMetrics
from gateway.observability.scrape import MetricsCollector, metrics_exposition
from gateway.observability.status_codes import code_label
from gateway.observability.tally import LATENCY_BUCKETS, RequestTally, latency_bucket
from gateway.pool.events import PoolEvent, ProbeResult, RequestRecord, Tokens
from gateway.pool.pool import Pool
from gateway.pool.upstream import Health, Upstream
from gateway.proxy.handler import Proxy
from gateway.server import TrafficServer
from tests.needs import missing

from .conftest import Recorder, add, routing, url


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def collected(registry: CollectorRegistry) -> GatewayMetrics:
    """A ``GatewayMetrics`` whose series ``registry`` collects (as ``serving`` wires it)."""
    m = GatewayMetrics()
    registry.register(MetricsCollector(m))
    return m


@pytest.fixture
def metrics(registry: CollectorRegistry, pool: Pool) -> GatewayMetrics:
    m = collected(registry)
    m.attach(pool)
    return m


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def states(registry: CollectorRegistry, service: str, upstream: str, rev: str = "0") -> dict:
    return {
        s: value(
            registry,
            "gateway_upstream_state",
            service=service,
            revision=rev,
            upstream=upstream,
            state=s,
        )
        for s in UPSTREAM_STATES
    }


def one_hot(state: str) -> dict:
    return {s: 1.0 if s == state else 0.0 for s in UPSTREAM_STATES}


def series_of(registry: CollectorRegistry, service: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if f'service="{service}"' in line]


def record(service: str = "web", revision: int | None = 0, **fields: object) -> RequestRecord:
    base: dict = {
        "request_id": "r",
        "service": service,
        "revision": revision,
        "upstream_id": "a" if revision is not None else None,
        "method": "GET",
        "path": "/",
        "status": 200,
        "duration": 0.01,
        "ttfb": 0.005,
        "bytes_in": 0,
        "bytes_out": 10,
        "retries": 0,
    }
    return RequestRecord(**{**base, **fields})


# -- upstream health ---------------------------------------------------------------------


async def test_upstream_up_and_state_follow_the_pool(pool, metrics, registry) -> None:
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1, health=Health.UNKNOWN)
    labels = {"service": "web", "revision": "0", "upstream": "a"}
    assert value(registry, "gateway_upstream_up", **labels) == 0
    assert states(registry, "web", "a") == one_hot("unknown")

    pool.set_health("web", "a", Health.HEALTHY)
    assert value(registry, "gateway_upstream_up", **labels) == 1
    assert states(registry, "web", "a") == one_hot("healthy")

    pool.set_health("web", "a", Health.UNHEALTHY)
    assert value(registry, "gateway_upstream_up", **labels) == 0
    assert states(registry, "web", "a") == one_hot("unhealthy")

    pool.set_health("web", "a", Health.HEALTHY)
    pool.drain("web", "a", timeout=1)
    assert value(registry, "gateway_upstream_up", **labels) == 0
    assert states(registry, "web", "a") == one_hot("draining")

    pool.remove_upstream("web", "a")
    assert value(registry, "gateway_upstream_up", **labels) is None
    assert states(registry, "web", "a") == dict.fromkeys(UPSTREAM_STATES)
    assert not [line for line in series_of(registry, "web") if 'upstream="a"' in line]


async def test_attach_takes_in_upstreams_already_in_the_pool(pool, registry) -> None:
    pool.set_service(routing("web", prefix="/"))
    pool.add_upstream(Upstream("b", "web", "127.0.0.1", 1, revision=3))
    pool.set_health("web", "b", Health.HEALTHY)
    collected(registry).attach(pool)
    labels = {"service": "web", "revision": "3", "upstream": "b"}
    assert value(registry, "gateway_upstream_up", **labels) == 1


async def test_a_real_probe_failure_turns_the_upstream_down(aiohttp_server, pool, registry):
    healthy = True

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200 if healthy else 503)

    app = web.Application()
    app.router.add_get("/health", health)
    server = await aiohttp_server(app)
    probe = ProbeConfig(
        type="http", path="/health", interval=0.05, jitter=0.0, timeout=1.0, unhealthy_threshold=1
    )
    pool.set_service(routing("web", prefix="/", probes=(probe,)))
    metrics = collected(registry)
    metrics.attach(pool)

    health_changes: asyncio.Queue[Health] = asyncio.Queue()

    class Waiter:
        def on_pool_event(self, event: PoolEvent) -> None:
            if event.kind == "changed" and event.upstream and event.previous:
                if event.upstream.health is not event.previous.health:
                    health_changes.put_nowait(event.upstream.health)

    pool.subscribe(Waiter())  # after the metrics: they are up to date when it hears
    prober = Prober(pool, observers=[metrics])
    await prober.start()
    try:
        add(pool, "web", "a", server.port, health=Health.UNKNOWN)
        assert await asyncio.wait_for(health_changes.get(), 10) is Health.HEALTHY
        labels = {"service": "web", "revision": "0", "upstream": "a"}
        assert value(registry, "gateway_upstream_up", **labels) == 1
        successes = value(
            registry, "gateway_probe_total", service="web", upstream="a", result="success"
        )
        assert successes is not None
        assert successes >= 1

        healthy = False
        assert await asyncio.wait_for(health_changes.get(), 10) is Health.UNHEALTHY
        assert value(registry, "gateway_upstream_up", **labels) == 0
        assert states(registry, "web", "a") == one_hot("unhealthy")
        failures = value(
            registry, "gateway_probe_total", service="web", upstream="a", result="failure"
        )
        assert failures is not None
        assert failures >= 1
        count = value(registry, "gateway_probe_duration_seconds_count", service="web")
        assert count is not None
        assert count >= 2
    finally:
        await prober.stop()


async def test_probe_of_an_unknown_upstream_makes_no_series(metrics, registry) -> None:
    metrics.on_probe(ProbeResult("ghost", "x", "failure", 0.1))
    assert series_of(registry, "ghost") == []


# -- requests ----------------------------------------------------------------------------


@pytest.fixture
async def traffic(pool, metrics, recorder):
    """A TrafficServer whose proxy reports to the metrics and the recorder."""
    servers: list[TrafficServer] = []

    async def start() -> TrafficServer:
        settings = ProxyConfig(listen="127.0.0.1:0")
        server = TrafficServer(Proxy(pool, settings, [metrics, recorder]), settings)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


async def test_a_retried_request_counts_its_retry_and_the_ejection(
    pool, upstream, traffic, client, registry, recorder: Recorder
) -> None:
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin"))
    add(pool, "web", "dead", unused_port())
    await upstream("web", "live")
    gw = await traffic()

    for _ in range(6):
        async with client.get(url(gw)) as resp:
            assert resp.status == 200

    retried = sum(r.retries for r in recorder.records)
    assert retried >= 1
    assert value(registry, "gateway_retries_total", service="web", reason="connect") == retried
    assert value(registry, "gateway_upstream_connect_failures_total", service="web") == retried
    assert value(registry, "gateway_requests_total", service="web", revision="0", code="2xx") == 6
    assert value(registry, "gateway_request_duration_seconds_count", service="web", revision="0")
    assert value(registry, "gateway_upstream_ttfb_seconds_count", service="web") == 6
    # Passive detection ejected the dead upstream; the metrics saw it.
    assert pool.upstream("web", "dead").ejected
    assert value(registry, "gateway_ejections_total", service="web", upstream="dead") == 1
    assert states(registry, "web", "dead") == one_hot("ejected")


async def test_gateway_errors_count_their_exact_code(pool, traffic, client, registry) -> None:
    pool.set_service(routing("web", prefix="/web"))
    gw = await traffic()

    async with client.get(url(gw, "/web/x")) as resp:
        assert resp.status == 503
    async with client.get(url(gw, "/elsewhere")) as resp:
        assert resp.status == 404

    assert value(registry, "gateway_requests_total", service="web", revision="", code="503") == 1
    assert value(registry, "gateway_no_routable_upstream_total", service="web") == 1
    # No route: counted under service "", never under the path.
    assert value(registry, "gateway_requests_total", service="", revision="", code="404") == 1
    assert "/elsewhere" not in generate_latest(registry).decode()


async def test_inflight_requests_are_read_from_the_pool(pool, metrics, registry) -> None:
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    labels = {"service": "web", "upstream": "a"}
    assert value(registry, "gateway_inflight_requests", **labels) == 0
    lease = pool.service("web").lease()
    assert lease is not None
    assert value(registry, "gateway_inflight_requests", **labels) == 1
    lease.release()
    assert value(registry, "gateway_inflight_requests", **labels) == 0


@pytest.mark.parametrize(
    ("status", "error", "code"),
    [
        (200, None, "2xx"),
        (101, None, "1xx"),
        (304, None, "3xx"),
        (404, None, "4xx"),  # the upstream's 404
        (503, None, "5xx"),  # the upstream's 503
        (503, "no_routable_upstream", "503"),
        (502, "upstream_connect_error", "502"),
        (504, "upstream_timeout", "504"),
        (404, "no_route", "404"),
        (413, "request_too_large", "413"),
        (499, "cancelled", "499"),
        (200, "upstream_protocol_error", "2xx"),  # the body broke off after a 200
        (200, "client_disconnected", "2xx"),
        (0, None, "500"),
    ],
)
def test_code_label(status: int, error: str | None, code: str) -> None:
    assert code_label(status, error) == code


async def test_requests_are_plain_counts_read_at_scrape_time(
    pool, metrics: GatewayMetrics, registry
) -> None:
    """The request path bumps ints; the collector makes the families only when scraped."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    retried = record(retries=1, retry_reasons=("connect",))
    for _ in range(4):
        metrics.on_request(retried)
    web = metrics.services["web"]
    assert (web.retries, web.connect_failures) == ({"connect": 4}, 4)
    assert value(registry, "gateway_requests_total", service="web", revision="0", code="2xx") == 4
    assert value(registry, "gateway_retries_total", service="web", reason="connect") == 4
    assert value(registry, "gateway_upstream_connect_failures_total", service="web") == 4


async def test_statuses_are_counted_by_class_unless_the_gateway_answered(
    pool, metrics: GatewayMetrics, registry
) -> None:
    """Statuses are counted as they come and labelled at scrape time: a class sums all its
    statuses, an answer the gateway made keeps its exact code, in order of first appearance."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    for r in (
        record(status=201),
        record(status=502, error="upstream_connect_error"),  # the gateway's own 502
        record(status=200),
        record(status=502),  # the upstream's
        record(status=200, error="upstream_connect_error"),  # a retry, then the upstream's 200
        record(status=0),  # no status at all: 500
        record(status=999),  # no class
    ):
        metrics.on_request(r)
    lines = [line for line in series_of(registry, "web") if "gateway_requests_total" in line]
    assert [line.split("code=")[1] for line in lines] == [
        '"2xx",revision="0",service="web"} 3.0',
        '"502",revision="0",service="web"} 1.0',
        '"5xx",revision="0",service="web"} 1.0',
        '"500",revision="0",service="web"} 1.0',
        '"999",revision="0",service="web"} 1.0',
    ]


# -- no stale series ---------------------------------------------------------------------


async def test_removing_a_service_removes_all_its_series(pool, metrics, registry) -> None:
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    metrics.on_request(record(retries=1, retry_reasons=("status",)))
    metrics.on_request(record(revision=None, status=503, error="no_routable_upstream"))
    metrics.on_probe(ProbeResult("web", "a", "success", 0.01))
    assert len(series_of(registry, "web")) > 20

    pool.remove_service("web")
    assert series_of(registry, "web") == []

    # A request that ends after its service went brings nothing back.
    metrics.on_request(record())
    assert series_of(registry, "web") == []
    assert metrics.unrecorded == 1


async def test_a_revision_goes_with_its_last_upstream(pool, metrics, registry) -> None:
    pool.set_service(routing("web", prefix="/"))
    pool.add_upstream(Upstream("old", "web", "127.0.0.1", 1, revision=1))
    pool.add_upstream(Upstream("new", "web", "127.0.0.1", 2, revision=2))
    metrics.on_request(record(revision=1, upstream_id="old"))
    metrics.on_request(record(revision=2, upstream_id="new"))

    def revisions() -> set[str]:
        lines = [line for line in series_of(registry, "web") if "gateway_requests_total" in line]
        return {line.split('revision="')[1].split('"')[0] for line in lines}

    assert revisions() == {"1", "2"}
    pool.remove_upstream("web", "old")
    assert revisions() == {"2"}
    # A request that ended after its upstream left is counted, then swept at the next event.
    metrics.on_request(record(revision=1, upstream_id="old"))
    assert revisions() == {"1", "2"}
    pool.set_health("web", "new", Health.HEALTHY)
    assert revisions() == {"2"}


# -- exposition --------------------------------------------------------------------------


def populated(pool: Pool, metrics: GatewayMetrics) -> None:
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    metrics.on_request(record(retries=1, retry_reasons=("connect",)))
    metrics.on_request(record(status=502, error="upstream_connect_error"))
    metrics.on_probe(ProbeResult("web", "a", "timeout", 1.0))


async def test_promtool_accepts_the_exposition(pool, metrics, registry) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        missing("promtool not installed (Debian package 'prometheus'; .ci/run installs it)")
    populated(pool, metrics)
    result = subprocess.run(
        [promtool, "check", "metrics"],
        input=generate_latest(registry),
        capture_output=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()


async def test_metrics_exposition_renders_the_registry_for_the_accept_header(
    pool, metrics, registry
) -> None:
    populated(pool, metrics)
    render = metrics_exposition(registry)

    body, content_type = render("")
    assert content_type.startswith("text/plain; version=0.0.4")
    assert b'gateway_upstream_up{revision="0",service="web",upstream="a"} 1.0' in body

    body, content_type = render("application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")

    # A version prometheus_client cannot compare raises in choose_encoder: the text format.
    for accept in ("application/openmetrics-text;version=x", "text/plain;version=1..0"):
        body, content_type = render(accept)
        assert content_type.startswith("text/plain; version=0.0.4"), accept
        assert b"# EOF" not in body


# -- worker processes ----------------------------------------------------------------------


def exposition(registry: CollectorRegistry) -> list[str]:
    """The samples, without the ``_created`` stamps (when a child was made, not what it counts)."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created{" not in line]


async def test_a_workers_tally_merged_shows_what_direct_counting_shows(pool) -> None:
    """``RequestTally`` in a worker + ``merge`` here = ``on_request`` here, series for series."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    records = [
        record(),
        record(status=404, duration=0.2, ttfb=0.1),
        record(retries=1, retry_reasons=("connect",)),
        record(status=502, error="upstream_connect_error", ttfb=None),
        record(revision=None, status=503, error="no_routable_upstream", ttfb=None),
        record(service="", revision=None, status=404, error="no_route", ttfb=None),
        record(service="gone", revision=7),
    ]
    direct_registry, merged_registry = CollectorRegistry(), CollectorRegistry()
    direct, merged = collected(direct_registry), collected(merged_registry)
    direct.attach(pool)
    merged.attach(pool)
    tally = RequestTally()
    for r in records:
        direct.on_request(r)
        tally.on_request(r)
    taken = tally.take()
    assert taken
    merged.merge(taken)
    assert not tally.take()  # counting starts again from zero
    assert exposition(merged_registry) == exposition(direct_registry)
    assert merged.unrecorded == direct.unrecorded == 1

    # A second report adds to the first.
    tally.on_request(record())
    merged.merge(tally.take())
    assert (
        value(merged_registry, "gateway_requests_total", service="web", revision="0", code="2xx")
        == 3
    )


async def test_requests_by_protocol_and_grpc_statuses(pool, metrics, registry) -> None:
    """``gateway_downstream_requests_total`` counts every request by the client's protocol,
    never going down when series go; ``gateway_grpc_responses_total`` a service's gRPC
    answers by status, gone with the service."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    for r in (
        record(),
        record(http_version="1.0"),
        record(service="", revision=None, status=404, error="no_route"),
        record(http_version="2"),
        record(http_version="2", grpc_status="0"),
        record(http_version="2", grpc_status="0"),
        record(http_version="2", grpc_status="14", status=503, error="no_routable_upstream"),
        record(service="gone", revision=3, http_version="2", grpc_status="0"),  # unrecorded
    ):
        metrics.on_request(r)

    def protocols() -> tuple[float | None, float | None]:
        return tuple(  # type: ignore[return-value]
            value(registry, "gateway_downstream_requests_total", protocol=p)
            for p in ("http/1.1", "h2")
        )

    assert protocols() == (3, 5)
    grpc = {
        s: value(registry, "gateway_grpc_responses_total", service="web", grpc_status=s)
        for s in ("0", "14", "2")
    }
    assert grpc == {"0": 2, "14": 1, "2": None}
    assert series_of(registry, "gone") == []

    pool.remove_service("web")  # its series go; what it served stays counted
    assert protocols() == (3, 5)
    assert series_of(registry, "web") == []
    metrics.on_request(record(service="", revision=None, status=404, error="no_route"))
    assert protocols() == (4, 5)


async def test_a_workers_protocols_and_grpc_statuses_merge_as_counted_here(pool) -> None:
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    records = [
        record(),
        record(http_version="2", grpc_status="0"),
        record(http_version="2", grpc_status="4", status=504, error="upstream_timeout"),
        record(http_version="2"),
        record(service="gone", revision=7, http_version="2", grpc_status="0"),
    ]
    direct_registry, merged_registry = CollectorRegistry(), CollectorRegistry()
    direct, merged = collected(direct_registry), collected(merged_registry)
    direct.attach(pool)
    merged.attach(pool)
    tally = RequestTally()
    for r in records:
        direct.on_request(r)
        tally.on_request(r)
    merged.merge(tally.take())
    assert exposition(merged_registry) == exposition(direct_registry)
    assert merged.h2_requests == 4
    assert merged.grpc == {("web", "0"): 1, ("web", "4"): 1}
    assert tally.take().h2 == 0


async def test_a_workers_client_timeouts_merge_as_counted_here(pool) -> None:
    """``gateway_client_timeouts_total``: a worker's, sent in its tally (pickled as the
    worker sends it), shows what counting here shows; a tally of timeouts alone is sent."""
    direct_registry, merged_registry = CollectorRegistry(), CollectorRegistry()
    direct, merged = collected(direct_registry), collected(merged_registry)
    direct.attach(pool)
    merged.attach(pool)
    tally = RequestTally()
    for protocol, timeout in [("h2", "header"), ("h2", "header"), ("http/1.1", "send")]:
        direct.on_client_timeout(protocol, timeout)
        tally.on_client_timeout(protocol, timeout)
    taken = tally.take()
    assert taken  # (no request in it: still worth sending)
    merged.merge(pickle.loads(pickle.dumps(taken)))
    assert exposition(merged_registry) == exposition(direct_registry)
    labels = {"protocol": "h2", "timeout": "header"}
    assert value(merged_registry, "gateway_client_timeouts_total", **labels) == 2
    labels = {"protocol": "h2", "timeout": "body"}
    assert value(merged_registry, "gateway_client_timeouts_total", **labels) == 0
    assert not tally.take()


def test_latency_bucket_is_bisect_left() -> None:
    values = [0.0, -1.0, 1e-9, math.inf, -math.inf, math.nan, 1e300, 0.0123, 3.3]
    for bound in LATENCY_BUCKETS:
        values += [bound, math.nextafter(bound, 0.0), math.nextafter(bound, math.inf)]
    values += [i / 10000 for i in range(2000)]
    for value in values:
        assert latency_bucket(value) == bisect_left(LATENCY_BUCKETS, value), value


async def test_runs_counted_apart_are_in_every_read(pool, metrics: GatewayMetrics, registry):
    """Runs of one status or one latency bucket, counted apart from the dicts and lists
    (``StatusCounts.answered``, ``Buckets.count``), are in every read of them: scrapes and
    the canary's ``revision_counts``, whenever they come, against a plain count."""
    import random
    from collections import Counter

    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    rng = random.Random(29)
    codes: Counter[str] = Counter()
    buckets = [0] * (len(LATENCY_BUCKETS) + 1)
    for _ in range(40):
        status = rng.choice((200, 200, 200, 201, 404, 502))
        duration = rng.choice((0.0004, 0.0004, 0.002, 0.3, 70.0))
        for _ in range(rng.choice((1, 2, 300))):  # runs, some past a small int's 256
            metrics.on_request(record(status=status, duration=duration, ttfb=None))
            codes[code_label(status, None)] += 1
            buckets[bisect_left(LATENCY_BUCKETS, duration)] += 1
        if rng.random() < 0.3:
            continue  # read later, with a run open
        shown = {
            line.split('code="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in series_of(registry, "web")
            if line.startswith("gateway_requests_total")
        }
        assert shown == {code: float(n) for code, n in codes.items()}
        cumulative = [
            value(registry, "gateway_request_duration_seconds_bucket", service="web",
                  revision="0", le=le)
            for le in [repr(float(b)) for b in LATENCY_BUCKETS] + ["+Inf"]
        ]  # fmt: skip
        assert cumulative == [float(sum(buckets[: i + 1])) for i in range(len(buckets))]
        _, counts = metrics.revision_counts("web")
        total, errors, latency, _ = counts[0]
        assert (total, errors, list(latency)) == (
            sum(codes.values()),
            codes["5xx"],
            buckets,
        )


async def test_tokens_are_counted_per_revision_and_merged_from_workers_alike(pool) -> None:
    """``on_model_request`` here, or in a worker's tally merged here: the same series,
    shown only for revisions with requests on a model path, and the TTFT buckets in the
    canary's ``revision_counts``."""
    pool.set_service(routing("web", prefix="/"))
    add(pool, "web", "a", 1)
    gaps = [0] * (len(LATENCY_BUCKETS) + 1)
    gaps[latency_bucket(0.02)] = 3
    counted = [
        (record(), Tokens(0.3, 4, (tuple(gaps), 0.06))),
        (record(), Tokens(0.07, 2, None)),
        (record(), Tokens(None, 9, None)),  # a JSON answer: no TTFT, its usage
        (record(status=404), Tokens()),
        (record(service="", revision=None, status=404), Tokens()),
    ]
    direct_registry, merged_registry = CollectorRegistry(), CollectorRegistry()
    direct, merged = collected(direct_registry), collected(merged_registry)
    direct.attach(pool)
    merged.attach(pool)
    tally = RequestTally()
    for r, tokens in counted:
        direct.on_model_request(r, tokens)
        tally.on_model_request(r, tokens)
    direct.on_request(record(revision=None))  # a revision with no model request: no series
    tally.on_request(record(revision=None))
    merged.merge(tally.take())
    assert exposition(merged_registry) == exposition(direct_registry)

    labels = {"service": "web", "revision": "0"}
    for registry in (direct_registry, merged_registry):
        assert value(registry, "gateway_model_output_tokens_total", **labels) == 15
        ttft = "gateway_model_time_to_first_token_seconds"
        assert value(registry, f"{ttft}_count", **labels) == 2
        assert value(registry, f"{ttft}_sum", **labels) == pytest.approx(0.37)
        itl = "gateway_model_inter_token_latency_seconds"
        assert value(registry, f"{itl}_count", **labels) == 3
        assert value(registry, f"{itl}_bucket", le="0.025", **labels) == 3
        assert value(registry, f"{ttft}_count", service="web", revision="") is None
        assert value(registry, f"{ttft}_count", service="", revision="") is None
        _, counts = (direct if registry is direct_registry else merged).revision_counts("web")
        expected = [0] * (len(LATENCY_BUCKETS) + 1)
        expected[latency_bucket(0.3)] += 1
        expected[latency_bucket(0.07)] += 1
        assert list(counts[0][3]) == expected
