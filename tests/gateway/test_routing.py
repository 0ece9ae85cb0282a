"""Where a request goes (gateway/proxy/routing.py): the router's answer, kept per route table."""

from __future__ import annotations

import pytest

from gateway.config import RouteConfig
from gateway.errors import BadRequest, NoRoute
from gateway.pool.router import Route, RouteTable
from gateway.proxy.routing import ROUTED_TARGET_MAX, Routes, Unroutable


def table(prefix: str, strip: bool = False) -> RouteTable:
    return RouteTable.build([Route("web", RouteConfig(path_prefix=prefix, strip_prefix=strip))])


def test_a_target_goes_to_its_service_with_the_path_it_is_forwarded_with():
    routes = Routes()
    assert routes.resolve(table("/api", strip=True), b"h", b"/api/x?q=1") == (
        "web",
        "/api/x",
        b"/x?q=1",
    )


def test_a_new_route_table_is_not_answered_from_the_last_ones_memory():
    routes = Routes()
    assert routes.resolve(table("/api", strip=True), b"h", b"/api/x")[2] == b"/x"
    assert routes.resolve(table("/api"), b"h", b"/api/x")[2] == b"/api/x"


def test_a_long_target_is_routed_each_time_and_not_kept():
    routes, routed = Routes(), table("/")
    target = b"/" + b"a" * ROUTED_TARGET_MAX
    assert routes.resolve(routed, b"h", target)[1] == target.decode()
    assert routes.resolve(routed, b"h", b"/short")[1] == "/short"
    assert len(routes._routed) == 1  # the short one only


@pytest.mark.parametrize(
    ("target", "error", "path"),
    [(b"/other", NoRoute, "/other"), (b"/api/%zz", BadRequest, "/api/%zz")],
)
def test_a_target_that_cannot_be_served_says_why_and_its_path(target, error, path):
    with pytest.raises(Unroutable) as raised:
        Routes().resolve(table("/api"), b"h", target)
    assert isinstance(raised.value.error, error)
    assert raised.value.path == path
