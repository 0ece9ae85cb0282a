"""tls.acme in the gateway config: defaults, and bad values refused with the field and why."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from controller.config import AcmeConfig, ConfigError, load_config


def load(tmp_path: Path, acme: object) -> AcmeConfig | None:
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({"tls": {"acme": acme}}))
    return load_config(path).config.tls.acme


def test_defaults(tmp_path: Path) -> None:
    acme = load(tmp_path, {"email": "ops@example.com"})
    assert acme is not None
    assert acme.directory == "https://acme-v02.api.letsencrypt.org/directory"
    assert acme.renew_at == pytest.approx(2 / 3)
    assert (acme.retry_min, acme.retry_max, acme.order_timeout) == (60.0, 3600.0, 90.0)
    assert load(tmp_path, None) is None  # off unless configured


@pytest.mark.parametrize(
    ("acme", "field", "why"),
    [
        ({"retry_min": 0}, "tls.acme.retry_min", "greater than 0"),
        ({"retry_min": "5m", "retry_max": "1m"}, "tls.acme.retry_max", "at least retry_min"),
        ({"directory": "ftp://ca.example/dir"}, "tls.acme.directory", "not an http(s) URL"),
        ({"directory": "https://"}, "tls.acme.directory", "not an http(s) URL"),
        ({"ca_bundle": "pebble.pem"}, "tls.acme.ca_bundle", "must be an absolute path"),
        ({"renew_at": 1}, "tls.acme.renew_at", "less than 1"),
        ({"renew_at": 0}, "tls.acme.renew_at", "greater than 0"),
        ({"order_timeout": "0s"}, "tls.acme.order_timeout", "greater than 0"),
        ({"renew": 0.5}, "tls.acme.renew", "Extra inputs are not permitted"),
    ],
)
def test_bad_values_are_refused_with_the_field_and_the_reason(
    tmp_path: Path, acme: dict[str, object], field: str, why: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        load(tmp_path, acme)
    message = str(refused.value)
    assert field in message
    assert why in message
