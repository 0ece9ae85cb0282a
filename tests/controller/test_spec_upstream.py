"""The spec's ``upstream_protocol``: HTTP/1.1 by default, h2c when asked, carried to the data
plane in the service's routing (and across to worker processes), anything else refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from controller.spec import ServiceSpec
from gateway.config import ServiceRouting, dump_settings, parse_settings

from .conftest import spec


def test_http1_is_the_default() -> None:
    assert ServiceSpec.model_validate(spec()).routing().upstream_protocol == "http1"


def test_http2_reaches_the_routing_and_survives_the_workers_channel() -> None:
    routing = ServiceSpec.model_validate(spec(upstream_protocol="http2")).routing()
    assert routing.upstream_protocol == "http2"
    assert parse_settings(ServiceRouting, dump_settings(routing)).upstream_protocol == "http2"


def test_another_protocol_is_refused() -> None:
    with pytest.raises(ValidationError, match="upstream_protocol"):
        ServiceSpec.model_validate(spec(upstream_protocol="http3"))
