"""The route table: host and prefix matching, precedence, path normalisation, forwarding."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import RouteConfig
from gateway.pool.router import Route, RouteTable, forward_path, normalize_path, resolve, strip_host


def route(service: str, *hosts: str, prefix: str | None = None, strip: bool = False) -> Route:
    return Route(service, RouteConfig(hosts=hosts, path_prefix=prefix, strip_prefix=strip))


def served(table: RouteTable, host: str, path: str) -> str | None:
    found = resolve(table, host, normalize_path(path))
    return found.service if found is not None else None


TABLE = RouteTable.build(
    [
        route("exact", "api.example.com"),
        route("wild", "*.example.com"),
        route("deeper-wild", "*.eu.example.com"),
        route("exact-prefixed", "api.example.com", prefix="/admin"),
        route("any-host-api", prefix="/api"),
        route("any-host-api-v2", prefix="/api/v2"),
        route("root", prefix="/"),
        route("local", "localhost"),
    ]
)


@pytest.mark.parametrize(
    ("host", "path", "service"),
    [
        # exact host beats wildcard; the host's port and case are ignored
        ("api.example.com", "/", "exact"),
        ("API.Example.COM:8443", "/x", "exact"),
        ("api.example.com.", "/x", "exact"),
        ("api.example.com", "/admin/users", "exact-prefixed"),
        ("api.example.com", "/administrator", "exact"),
        # wildcard suffix rules
        ("www.example.com", "/", "wild"),
        ("a.b.example.com", "/", "wild"),
        ("x.eu.example.com", "/", "deeper-wild"),  # the longer wildcard wins
        ("eu.example.com", "/", "wild"),
        ("example.com", "/", "root"),  # *.example.com does not match the bare domain
        ("badexample.com", "/", "root"),
        ("www.example.com:80", "/api/x", "wild"),  # a host match beats a route without hosts
        # no host match: longest prefix on segment boundaries
        ("other.test", "/api", "any-host-api"),
        ("other.test", "/api/", "any-host-api"),
        ("other.test", "/api/x", "any-host-api"),
        ("other.test", "/apix", "root"),
        ("other.test", "/api/v2", "any-host-api-v2"),
        ("other.test", "/api/v2/users", "any-host-api-v2"),
        ("other.test", "/api/v20", "any-host-api"),
        ("other.test", "/api/v2/../x", "any-host-api"),
        ("other.test", "/api/../admin", "root"),
        ("localhost:8080", "/", "local"),
        ("[::1]:8080", "/api", "any-host-api"),
    ],
)
def test_resolve(host, path, service):
    assert served(TABLE, host, path) == service


def test_no_route():
    table = RouteTable.build([route("a", "a.test"), route("api", prefix="/api")])
    assert served(table, "b.test", "/") is None
    assert served(table, "b.test", "/apix") is None
    assert served(table, "a.test", "/anything") == "a"
    assert resolve(RouteTable(), "a.test", "/") is None


def test_host_and_prefix_must_both_match():
    table = RouteTable.build([route("both", "a.test", prefix="/api")])
    assert served(table, "a.test", "/api/x") == "both"
    assert served(table, "a.test", "/other") is None
    assert served(table, "b.test", "/api/x") is None


def test_first_of_equal_routes_wins():
    table = RouteTable.build([route("first", prefix="/api"), route("second", prefix="/api/")])
    assert served(table, "x", "/api/1") == "first"


@pytest.mark.parametrize(
    ("host", "stripped"),
    [
        ("Example.com", "example.com"),
        ("example.com:8080", "example.com"),
        ("example.com.", "example.com"),
        ("example.com.:80", "example.com"),
        (" example.com ", "example.com"),
        ("[::1]:8080", "[::1]"),
        ("[::1]", "[::1]"),
        ("", ""),
    ],
)
def test_strip_host(host, stripped):
    assert strip_host(host) == stripped


@pytest.mark.parametrize(
    ("path", "normal"),
    [
        ("/", "/"),
        ("", "/"),
        ("a/b", "/a/b"),
        ("/svc/../admin", "/admin"),
        ("/svc/./x", "/svc/x"),
        ("/./", "/"),
        ("/./a", "/a"),
        ("//", "/"),
        ("///", "/"),
        ("//a//b", "/a/b"),
        ("//a//b/", "/a/b/"),
        ("/a/", "/a/"),
        ("/a/./", "/a/"),
        ("/a/.", "/a"),
        ("/a/..", "/"),
        ("/a/../", "/"),
        ("/..", "/"),
        ("/../../etc/passwd", "/etc/passwd"),
        ("/a/b/../../..", "/"),
        ("/a/...", "/a/..."),
        ("/a/..b", "/a/..b"),
    ],
)
def test_normalize_path(path, normal):
    assert normalize_path(path) == normal


@pytest.mark.parametrize(
    ("prefix", "strip", "path", "forwarded"),
    [
        ("/api", True, "/api", "/"),
        ("/api", True, "/api/", "/"),
        ("/api", True, "/api/x", "/x"),
        ("/api", True, "/api/x/", "/x/"),
        ("/api/v2", True, "/api/v2/users/1", "/users/1"),
        ("/api", False, "/api/x", "/api/x"),
        ("/", True, "/x", "/x"),
    ],
)
def test_forward_path(prefix, strip, path, forwarded):
    r = route("svc", prefix=prefix, strip=strip)
    normal = normalize_path(path)
    assert resolve(RouteTable((r,)), "h", normal) == r
    assert forward_path(r, normal) == forwarded


def test_forward_path_cannot_escape_the_prefix():
    r = route("svc", prefix="/svc", strip=True)
    table = RouteTable((r,))
    for raw in ("/svc/../admin", "/svc/..", "/svc/%2e%2e/admin", "/svc//../admin", "/svc/./x"):
        normal = normalize_path(raw)
        if resolve(table, "h", normal) is not None:
            forwarded = forward_path(r, normal)
            assert normalize_path("/svc" + forwarded).startswith("/svc")
            assert ".." not in forwarded.split("/")


# -- properties ----------------------------------------------------------------------------

paths = st.one_of(
    st.lists(st.sampled_from(["api", "apix", "..", ".", "", "v2", "x", "%2e"]), max_size=8).map(
        "/".join
    ),
    st.text(max_size=40),
)


@given(path=paths, prefix=st.sampled_from(["/api", "/api/v2", "/x", "/"]))
def test_prefix_route_matches_only_inside_its_prefix(path, prefix):
    normal = normalize_path(path)
    r = route("svc", prefix=prefix, strip=True)
    matched = resolve(RouteTable((r,)), "any.host", normal) is not None
    inside = prefix == "/" or normal == prefix or normal.startswith(prefix + "/")
    assert matched == inside
    assert ".." not in normal.split("/")
    assert "." not in normal.split("/")
    assert "//" not in normal
    if matched:
        forwarded = forward_path(r, normal)
        assert forwarded.startswith("/")
        assert ".." not in forwarded.split("/")
        # what the upstream sees, put back under the prefix, stays under the prefix
        rejoined = normalize_path(prefix.rstrip("/") + forwarded)
        assert rejoined == prefix or rejoined.startswith(prefix.rstrip("/") + "/")


@given(st.text(max_size=40))
def test_normalize_path_is_idempotent(path):
    once = normalize_path(path)
    assert normalize_path(once) == once
    assert once.startswith("/")
