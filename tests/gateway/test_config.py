"""Config models: durations, addresses, route validation, strictness and immutability."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest
from pydantic import ValidationError

from gateway.config import (
    OutlierConfig,
    ProbeConfig,
    ProxyConfig,
    RouteConfig,
    ServiceRouting,
    TimeoutsConfig,
    TracingConfig,
    dump_settings,
    parse_address,
    parse_duration,
    parse_settings,
)


def errors(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[tuple[object, ...], str]]:
    return [(tuple(e["loc"]), e["msg"]) for e in exc.value.errors()]


# -- durations -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("250ms", 0.25),
        ("5s", 5.0),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1.5s", 1.5),
        ("0.5m", 30.0),
        (" 5 s ", 5.0),
        ("10", 10.0),
        ("0", 0.0),
        (3, 3.0),
        (0.75, 0.75),
        (0, 0.0),
    ],
)
def test_durations(value, seconds):
    assert parse_settings(TimeoutsConfig, dict(connect=value)).connect == pytest.approx(seconds)


@pytest.mark.parametrize(
    "value",
    # Unicode digits and spaces ("\uff15s", "\u0665", "5\u2003s") are not ASCII: refused.
    [
        "5x",
        "ms",
        "",
        "-1s",
        "1e3",
        "5 sec",
        ".5s",
        "5.s",
        "1m30s",
        "abc",
        -1,
        -0.1,
        True,
        "\uff15s",
        "\u0665",
        "5\u2003s",
    ],
)
def test_bad_durations(value):
    with pytest.raises(ValidationError) as exc:
        parse_settings(TimeoutsConfig, dict(connect=value))
    [(loc, _)] = errors(exc)
    assert loc == ("connect",)


def test_bad_duration_message_names_the_value():
    with pytest.raises(ValidationError, match="not a duration: '5x'"):
        parse_settings(TimeoutsConfig, dict(read="5x"))


def test_parse_duration_leaves_non_strings_to_pydantic():
    assert parse_duration(5) == 5
    assert parse_duration(None) is None
    assert parse_duration("2m") == 120.0


def test_optional_duration():
    assert TimeoutsConfig().total is None
    assert parse_settings(TimeoutsConfig, dict(total="30s")).total == 30.0


# -- addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("127.0.0.1:9001", ("127.0.0.1", 9001)),
        ("localhost:80", ("localhost", 80)),
        ("0.0.0.0:8080", ("0.0.0.0", 8080)),
        ("[::1]:80", ("::1", 80)),
        ("[::]:8080", ("::", 8080)),
        ("[fe80::1%eth0]:443", ("fe80::1%eth0", 443)),
        ("h:1", ("h", 1)),
        ("h:65535", ("h", 65535)),
    ],
)
def test_addresses(address, parsed):
    assert parse_address(address) == parsed
    assert parse_settings(ProxyConfig, dict(listen=address)).listen == address


@pytest.mark.parametrize(
    "address",
    [
        "localhost",
        "localhost:",
        ":80",
        "h:0",
        "h:65536",
        "h:-1",
        "h:http",
        "h:8o",
        "h:\u0663",  # a digit, but not an ASCII one
        "::1",  # would be host ":" port 1
        "::1:80",  # IPv6 must be bracketed
        "[::1]",
        "[::1",
        "[]:80",
        "a b:80",
        "",
    ],
)
def test_bad_addresses(address):
    with pytest.raises(ValueError, match=r"address|port"):
        parse_address(address)
    if address == "h:0":
        return  # a listener may ask for any free port
    with pytest.raises(ValidationError) as exc:
        parse_settings(ProxyConfig, dict(listen=address))
    [(loc, _)] = errors(exc)
    assert loc == ("listen",)


def test_a_listener_may_ask_for_any_free_port():
    assert parse_address("127.0.0.1:0", listen=True) == ("127.0.0.1", 0)
    assert parse_settings(ProxyConfig, dict(listen="127.0.0.1:0")).listen == "127.0.0.1:0"


def test_address_of_a_number_is_refused():
    with pytest.raises(ValidationError):
        parse_settings(ProxyConfig, dict(listen=8080))


# -- routes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"hosts": ["Example.COM."]}, {"hosts": ("example.com",)}),
        ({"hosts": ["*.example.com"]}, {"hosts": ("*.example.com",)}),
        ({"hosts": ["a", "b-c.d"]}, {"hosts": ("a", "b-c.d")}),
        ({"path_prefix": "/api/"}, {"path_prefix": "/api"}),
        ({"path_prefix": "/"}, {"path_prefix": "/"}),
        ({"path_prefix": "/a/b"}, {"path_prefix": "/a/b"}),
        ({"path_prefix": "/api", "strip_prefix": True}, {"strip_prefix": True}),
        ({"hosts": ["a.test"], "path_prefix": "/x"}, {"hosts": ("a.test",), "path_prefix": "/x"}),
    ],
)
def test_routes(fields, expected):
    config = parse_settings(RouteConfig, fields)
    for name, value in expected.items():
        assert getattr(config, name) == value


@pytest.mark.parametrize(
    ("fields", "loc", "reason"),
    [
        ({}, (), "a route needs hosts, a path_prefix, or both"),
        ({"hosts": []}, (), "a route needs hosts"),
        ({"hosts": ["a.test"], "strip_prefix": True}, (), "strip_prefix needs a path_prefix"),
        ({"hosts": ["bad host"]}, ("hosts",), "not a host name"),
        ({"hosts": ["*"]}, ("hosts",), "not a host name"),
        ({"hosts": ["a.*.com"]}, ("hosts",), "not a host name"),
        ({"hosts": ["-a.com"]}, ("hosts",), "not a host name"),
        ({"hosts": ["a_b.com"]}, ("hosts",), "not a host name"),
        ({"hosts": ["a.com\n"]}, ("hosts",), "not a host name"),
        ({"hosts": ["\u212a.com"]}, ("hosts",), "not a host name"),  # Kelvin: lower() is k
        ({"hosts": ["a" * 64 + ".com"]}, ("hosts",), "not a host name"),
        ({"hosts": [("a" * 60 + ".") * 5 + "com"]}, ("hosts",), "not a host name"),
        ({"path_prefix": "api"}, ("path_prefix",), "must start with '/'"),
        ({"path_prefix": "/a?b"}, ("path_prefix",), "'?'"),
        ({"path_prefix": "/a#b"}, ("path_prefix",), "'#'"),
        ({"path_prefix": "/a%2e"}, ("path_prefix",), "'%'"),
        ({"path_prefix": "/a b"}, ("path_prefix",), "space"),
        ({"path_prefix": "/a\\b"}, ("path_prefix",), "'\\'"),
        ({"path_prefix": "/a/../b"}, ("path_prefix",), "normalised"),
        ({"path_prefix": "/./b"}, ("path_prefix",), "normalised"),
        ({"path_prefix": "/a//b"}, ("path_prefix",), "normalised"),
        ({"path_prefix": "/api", "extra": 1}, ("extra",), "Unexpected keyword argument"),
    ],
)
def test_route_validation_errors(fields, loc, reason):
    with pytest.raises(ValidationError) as exc:
        parse_settings(RouteConfig, fields)
    [(got_loc, message)] = errors(exc)
    assert got_loc[: len(loc)] == loc
    assert reason in message


# -- probes and others ---------------------------------------------------------------------


def test_probe_defaults():
    probe = ProbeConfig()
    assert (probe.type, probe.path, probe.method, probe.expected_statuses) == (
        "http",
        "/",
        "GET",
        (),
    )
    assert (probe.interval, probe.timeout, probe.jitter) == (5.0, 2.0, 0.1)
    assert (probe.healthy_threshold, probe.unhealthy_threshold) == (2, 3)


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"interval": 0}, ("interval",)),
        ({"timeout": "0ms"}, ("timeout",)),
        ({"path": "health"}, ("path",)),
        ({"path": "/a b"}, ("path",)),
        ({"path": "/a\r\nX: y"}, ("path",)),
        ({"type": "udp"}, ("type",)),
        ({"method": "POST"}, ("method",)),
        ({"healthy_threshold": 0}, ("healthy_threshold",)),
        ({"unhealthy_threshold": 101}, ("unhealthy_threshold",)),
        ({"jitter": 1.5}, ("jitter",)),
        ({"jitter": -0.1}, ("jitter",)),
        ({"intervall": "5s"}, ("intervall",)),
    ],
)
def test_probe_validation_errors(fields, loc):
    with pytest.raises(ValidationError) as exc:
        parse_settings(ProbeConfig, fields)
    [(got_loc, _)] = errors(exc)
    assert got_loc == loc


def test_probe_durations():
    probe = parse_settings(ProbeConfig, dict(interval="250ms", timeout="1s"))
    assert (probe.interval, probe.timeout) == (0.25, 1.0)


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"max_ejection_percent": 101}, ("max_ejection_percent",)),
        ({"consecutive_5xx": 0}, ("consecutive_5xx",)),
        ({"base_ejection_time": "-1s"}, ("base_ejection_time",)),
    ],
)
def test_outlier_validation_errors(fields, loc):
    with pytest.raises(ValidationError) as exc:
        parse_settings(OutlierConfig, fields)
    [(got_loc, _)] = errors(exc)
    assert got_loc == loc


def test_nested_errors_name_the_field_path():
    with pytest.raises(ValidationError) as exc:
        parse_settings(
            ServiceRouting,
            {
                "name": "svc",
                "route": {"path_prefix": "/x"},
                "probes": [{"interval": "1s"}, {"interval": "soon"}],
                "timeouts": {"connect": "fast"},
            },
        )
    locs = sorted(loc for loc, _ in errors(exc))
    assert locs == [("probes", 1, "interval"), ("timeouts", "connect")]


def test_service_routing_from_plain_data():
    routing = parse_settings(
        ServiceRouting,
        {
            "name": "svc",
            "route": {"hosts": ["svc.test"]},
            "load_balancing": "p2c",
            "probes": [{"type": "tcp", "interval": "1s"}],
            "queue_timeout": "500ms",
        },
    )
    assert routing.probes == (parse_settings(ProbeConfig, dict(type="tcp", interval=1.0)),)
    assert routing.queue_timeout == 0.5
    assert routing.load_balancing == "p2c"


def test_bad_load_balancing():
    with pytest.raises(ValidationError) as exc:
        parse_settings(
            ServiceRouting, {"name": "s", "route": {"hosts": ["a"]}, "load_balancing": "random"}
        )
    assert errors(exc)[0][0] == ("load_balancing",)


# -- strictness and immutability -----------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        (ProbeConfig, {"pth": "/"}),
        (TimeoutsConfig, {"conect": 1}),
        (OutlierConfig, {"max_ejections": 1}),
        (ProxyConfig, {"listen": "h:1", "workers": 4}),
        (ServiceRouting, {"name": "s", "route": {"hosts": ["a"]}, "retry": {}}),
        (ServiceRouting, {"name": "s", "route": {"hosts": ["a"], "prefix": "/x"}}),
    ],
)
def test_extra_fields_are_forbidden(model, fields):
    # pydantic's text for a stdlib dataclass; controller.config reports it as "Extra inputs are
    # not permitted", as for its own models
    with pytest.raises(ValidationError, match="Unexpected keyword argument"):
        parse_settings(model, fields)


@pytest.mark.parametrize(
    ("config", "field", "value"),
    [
        (ProbeConfig(), "interval", 1.0),
        (parse_settings(RouteConfig, dict(path_prefix="/x")), "path_prefix", "/y"),
        (TimeoutsConfig(), "connect", 1.0),
        (ProxyConfig(), "listen", "h:1"),
        (
            parse_settings(
                ServiceRouting,
                dict(name="s", route=parse_settings(RouteConfig, dict(hosts=("a",)))),
            ),
            "name",
            "t",
        ),
    ],
)
def test_models_are_frozen(config, field, value):
    with pytest.raises(FrozenInstanceError):
        setattr(config, field, value)


def test_copies_are_validated_new_objects():
    probe = ProbeConfig()
    changed = parse_settings(ProbeConfig, {**dump_settings(probe), "interval": "1s"})
    assert changed.interval == 1.0
    assert probe.interval == 5.0
    assert ProbeConfig() == ProbeConfig()


# -- tracing ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "endpoint"),
    [
        ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
        ("http://collector:4318/", "http://collector:4318/v1/traces"),
        ("https://otlp.example.com/api/v1/traces", "https://otlp.example.com/api/v1/traces"),
    ],
)
def test_an_otlp_endpoint_without_a_path_gets_the_traces_path(given, endpoint):
    assert parse_settings(TracingConfig, {"otlp_endpoint": given}).otlp_endpoint == endpoint


def test_tracing_defaults_record_no_span():
    tracing = parse_settings(TracingConfig, {})
    assert tracing.otlp_endpoint is None
    assert (tracing.service_name, tracing.headers, tracing.timeout) == ("gateway", {}, 10.0)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({"otlp_endpoint": "grpc://collector:4317"}, ("otlp_endpoint",)),
        ({"otlp_endpoint": "http://c:4318/v1/traces?x=1"}, ("otlp_endpoint",)),
        ({"headers": {"bad name": "x"}}, ("headers",)),
        ({"headers": {"X-Key": "a\r\nb"}}, ("headers",)),
        ({"timeout": 0}, ("timeout",)),
        ({"service_name": ""}, ("service_name",)),
        ({"otlp_endpoint": "http://c:4318", "propagate": False}, ()),
    ],
)
def test_bad_tracing_settings_are_refused(data, where):
    with pytest.raises(ValidationError) as exc:
        parse_settings(TracingConfig, data)
    assert [loc for loc, _ in errors(exc)] == [where]
