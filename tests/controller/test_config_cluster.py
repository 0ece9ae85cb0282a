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
        }
    )
    assert config.state.etcd is not None
    assert config.state.etcd.endpoints == ("http://127.0.0.1:2379",)
    assert config.state.etcd.prefix == "/gateway/"
    assert config.node.name == "node-a"
    assert config.node.lease_ttl == 5
    assert config.node.host("0.0.0.0:8081") == "127.0.0.2"


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
    ],
)
def test_refused_with_the_field_and_the_reason(
    data: dict[str, Any], field: str, reason: str
) -> None:
    found = fields(data)
    assert field in found, found
    assert reason in found[field], found
