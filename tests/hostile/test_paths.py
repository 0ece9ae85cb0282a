"""Path tricks with prefix routing: one normalised path for routing and forwarding.

Three services: ``/svc`` (strip_prefix), ``/admin`` and ``/`` (everything else). Each
upstream records the request line it got, so a test sees which service a path reached and
what path that service was sent. A path that upstreams could read differently from the
gateway (backslashes, control characters, broken or non-UTF-8 percent-encoding) is refused.
"""

from __future__ import annotations

import pytest

from gateway.config import RouteConfig
from gateway.pool import router
from tests.gateway.conftest import routing

from .conftest import send_raw

ROUTED = [
    # (path sent, service reached, path that service was sent)
    (b"/svc/x", "svc", b"/x"),
    (b"/svc/../admin", "admin", b"/admin"),
    (b"/svc/%2e%2e/admin", "admin", b"/admin"),
    (b"/svc/%2E%2E/admin", "admin", b"/admin"),
    (b"/svc/.%2e/admin", "admin", b"/admin"),
    (b"/svc/%2e%2e%2fadmin", "admin", b"/admin"),
    (b"/svc%2f..%2fadmin", "admin", b"/admin"),
    (b"/svc/a%2fb", "svc", b"/a/b"),
    (b"/svc%2fx", "svc", b"/x"),
    (b"//svc/x", "svc", b"/x"),
    (b"/svc//x", "svc", b"/x"),
    (b"/svc/x//y", "svc", b"/x/y"),
    (b"/svc/.", "svc", b"/"),
    (b"/svc/..", "root", b"/"),
    (b"/svc/../../../etc/passwd", "root", b"/etc/passwd"),
    (b"/svc/a;/../admin", "svc", b"/admin"),
    (b"/svc/%252e%252e/admin", "svc", b"/%252e%252e/admin"),
    (b"/svc/x?q=/../admin", "svc", b"/x?q=/../admin"),
    (b"/svcx", "root", b"/svcx"),
    (b"/SVC/x", "root", b"/SVC/x"),
    (b"/admin/../svc/x", "svc", b"/x"),
    (b"http://other/svc/../admin", "admin", b"/admin"),
    (b"/svc/%c3%a9", "svc", b"/%C3%A9"),
]
REFUSED = [
    b"/svc\\..\\admin",
    b"/svc/..\\admin",
    b"/svc/%5c..%5cadmin",
    b"/svc/%5C",
    b"/svc/%00",
    b"/svc/a%0d%0aX-Injected:%201",
    b"/svc/%7f",
    b"/svc/%ff",
    b"/svc/%zz",
    b"/svc/%",
    b"/svc/%2",
]


@pytest.fixture
async def services(pool, recording, gateway):
    recs = {}
    for name, prefix, strip in (
        ("svc", "/svc", True),
        ("admin", "/admin", False),
        ("root", "/", False),
    ):
        pool.set_service(routing(name, prefix=prefix, strip=strip))
        recs[name] = await recording(name, f"{name}-1")
    return await gateway(), recs


async def _get(port: int, path: bytes):
    return await send_raw(
        port, b"GET " + path + b" HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )


@pytest.mark.parametrize(
    ("path", "service", "forwarded"), ROUTED, ids=[p.decode() for p, *_ in ROUTED]
)
async def test_routing_and_forwarding_use_one_normalised_path(services, path, service, forwarded):
    gw, recs = services
    answer = await _get(gw.port, path)
    assert answer.statuses == [200], answer.data[:200]
    reached = {name: [r.request_line for r in rec.requests] for name, rec in recs.items()}
    assert reached[service] == [b"GET " + forwarded + b" HTTP/1.1"], reached
    assert sum(map(len, reached.values())) == 1
    if service == "svc":
        # strip_prefix: what /svc's upstream is sent can never climb out of its root.
        assert b"/.." not in forwarded.partition(b"?")[0]


@pytest.mark.parametrize("path", REFUSED, ids=[p.decode(errors="replace") for p in REFUSED])
async def test_paths_upstreams_could_read_differently_are_refused(services, path):
    gw, recs = services
    answer = await _get(gw.port, path)
    assert answer.statuses == [400], answer.data[:200]
    assert answer.closed
    assert all(rec.raw == [] for rec in recs.values())


def test_path_problem_is_pure_and_lets_ordinary_paths_through():
    for ok in ("/", "/a/b", "/a%20b", "/%C3%A9", "/a?x=%zz", "/a%2Fb", "/a+b", "/~u/x.y"):
        assert router.path_problem(ok) is None, ok
    assert "backslash" in (router.path_problem("/a%5Cb") or "")
    assert "control" in (router.path_problem("/a%0Ab") or "")
    assert "UTF-8" in (router.path_problem("/a%C3") or "")


def test_strip_prefix_never_leaves_the_prefix_for_any_normalised_path():
    route = router.Route("svc", RouteConfig(path_prefix="/svc", strip_prefix=True))
    table = router.RouteTable.build([route])
    for raw in (
        "/svc/../x",
        "/svc/../../x",
        "/svc/./../svc/../x",
        "/svc/a/../../..",
        "//svc/..//x",
    ):
        path = router.normalize_path(raw)
        if router.resolve(table, "h", path) is not None:
            forwarded = router.forward_path(route, path)
            assert router.normalize_path("/svc" + forwarded).startswith("/svc"), raw
