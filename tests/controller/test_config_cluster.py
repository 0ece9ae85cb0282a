"""The ``state`` and ``node`` sections of the gateway config: refused with the field and why."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from controller.config import GatewayConfig, format_validation_error


def fields(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ValidationError) as caught:
        GatewayConfig.model_validate(data)
    return {e["field"]: e["reason"] for e in format_validation_error(caught.value)}


def test_sqlite_is_the_default_and_needs_nothing() -> None:
    config = GatewayConfig.model_validate({})
    assert config.state.store == "sqlite"
    assert config.state.etcd is None


def test_etcd_store_with_its_defaults() -> None:
    config = GatewayConfig.model_validate(
        {
            "state": {"store": "etcd", "etcd": {"endpoints": ["http://127.0.0.1:2379/"]}},
            "node": {"name": "node-a", "address": "127.0.0.2"},
            "admin": {"listen": "0.0.0.0:8081"},
        }
    )
    assert config.state.etcd is not None
    assert config.state.etcd.endpoints == ("http://127.0.0.1:2379",)
    assert config.state.etcd.prefix == "/gateway/"
    assert config.node.name == "node-a"
    assert config.node.lease_ttl == 5
    assert config.node.forget_after == 600.0
    assert config.node.host("0.0.0.0:8081") == "127.0.0.2"


ETCD = {"store": "etcd", "etcd": {"endpoints": ["http://127.0.0.1:2379"]}}


def test_a_node_may_serve_with_worker_processes() -> None:
    """Issue 54.2: a node's workers serve from the pools the node follows, as on one machine."""
    config = GatewayConfig.model_validate(
        {
            "state": ETCD,
            "node": {"address": "127.0.0.2"},
            "workers": 2,
            "admin": {"listen": "0.0.0.0:8081"},
        }
    )
    assert config.worker_count == 2


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("127.0.0.1:8081", "10.0.0.2"),
        ("127.0.0.1:8081", "127.0.0.2"),  # a socket bound to 127.0.0.1 takes nothing else
        ("localhost:8081", "gw-2.example"),
        ("10.0.0.1:8081", "10.0.0.2"),
        ("[::1]:8081", "10.0.0.2"),
    ],
)
def test_an_admin_listener_the_other_nodes_cannot_reach_is_refused(
    listen: str, address: str
) -> None:
    """Issue 53.10: every admin request a follower takes goes to the leader's node.address, on
    admin.listen's port; a node listening elsewhere was accepted, then every forward failed."""
    found = fields({"state": ETCD, "node": {"address": address}, "admin": {"listen": listen}})
    reason = found["(top level)"]
    port = "8081"
    assert reason.startswith(f"admin.listen {listen} takes connections on ")
    assert f"reach this node's admin API at node.address {address}, port {port}" in reason
    assert f"listen on {address}:{port} (or 0.0.0.0:{port})" in reason


@pytest.mark.parametrize(
    ("listen", "address"),
    [
        ("0.0.0.0:8081", "10.0.0.2"),
        ("[::]:8081", "10.0.0.2"),
        ("10.0.0.2:8081", "10.0.0.2"),
        ("127.0.0.1:8081", None),  # node.address defaults to the listener's host
        ("127.0.0.1:8081", "localhost"),
        ("10.0.0.2:8081", "gw-2.example"),  # a name is not resolved: it may be that address
    ],
)
def test_an_admin_listener_at_the_nodes_address_is_taken(listen: str, address: str | None) -> None:
    node: dict[str, Any] = {} if address is None else {"address": address}
    GatewayConfig.model_validate({"state": ETCD, "node": node, "admin": {"listen": listen}})
    # One node (SQLite) forwards nothing: node is not read.
    GatewayConfig.model_validate({"node": {"address": "10.0.0.9"}, "admin": {"listen": listen}})


def test_node_host_defaults_to_the_admin_listener_host() -> None:
    node = GatewayConfig.model_validate({}).node
    assert node.host("127.0.0.3:8081") == "127.0.0.3"
    assert node.host("0.0.0.0:8081") == "127.0.0.1"


@pytest.mark.parametrize(
    ("data", "field", "reason"),
    [
        ({"state": {"store": "etcd"}}, "state", "store etcd needs state.etcd"),
        (
            {"state": {"etcd": {"endpoints": ["http://a:1"]}}},
            "state",
            "only read with store: etcd",
        ),
        (
            {"state": {"store": "etcd", "etcd": {"endpoints": []}}},
            "state.etcd.endpoints",
            "at least 1",
        ),
        (
            {"state": {"store": "etcd", "etcd": {"endpoints": ["127.0.0.1:2379"]}}},
            "state.etcd.endpoints",
            "http(s)://host:port",
        ),
        (
            {"state": {"store": "etcd", "etcd": {"endpoints": ["http://a:1"], "prefix": "x"}}},
            "state.etcd.prefix",
            "must start with '/'",
        ),
        (
            {"state": {"store": "etcd", "etcd": {"endpoints": ["http://a:1"], "username": "u"}}},
            "state.etcd",
            "username and password_env go together",
        ),
        ({"node": {"name": "Node_A"}}, "node.name", "should match pattern"),
        ({"node": {"address": "127.0.0.2:8081"}}, "node.address", "without port"),
        ({"node": {"address": "http://a"}}, "node.address", "without port"),
        ({"node": {"lease_ttl": 1}}, "node.lease_ttl", "greater than or equal to 2"),
        ({"node": {"forget_after": 0}}, "node.forget_after", "greater than 0"),
    ],
)
def test_refused_with_the_field_and_the_reason(
    data: dict[str, Any], field: str, reason: str
) -> None:
    found = fields(data)
    assert field in found, found
    assert reason in found[field], found


def test_a_gone_nodes_records_are_kept_for_forget_after() -> None:
    config = GatewayConfig.model_validate(
        {
            "state": ETCD,
            "node": {"address": "127.0.0.2", "forget_after": "90s"},
            "admin": {"listen": "0.0.0.0:8081"},
        }
    )
    assert config.node.forget_after == 90.0
