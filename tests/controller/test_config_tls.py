"""The gateway config's HTTPS settings: refused with the field and the reason, paths resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    return path


def test_an_https_listener_without_certificates_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen_tls: ["127.0.0.1:8443"]\n')
    with pytest.raises(ConfigError, match=r"listen_tls: an HTTPS listener needs tls\.certificates"):
        load_config(path)


@pytest.mark.parametrize(
    ("tls", "reason"),
    [
        ("{unknown_name: maybe}", "tls.unknown_name"),
        ("{certificates: [{cert_file: a.pem}]}", "tls.certificates.0.key_file"),
        ("{handshake_timeout: soon}", "tls.handshake_timeout"),
        ("{acme: {directory: 'ftp://x'}}", "tls.acme.directory"),
    ],
)
def test_bad_tls_settings_name_the_field(tmp_path: Path, tls: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=reason.replace(".", r"\.")):
        load_config(write(tmp_path, f"tls: {tls}\n"))


def test_certificate_paths_are_relative_to_the_config_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'listen_tls: ["127.0.0.1:8443"]\n'
        "tls: {certificates: [{cert_file: c/cert.pem, key_file: /abs/key.pem}]}\n",
    )
    pair = load_config(path).config.tls.certificates[0]
    assert (pair.cert_file, pair.key_file) == (str(tmp_path / "c/cert.pem"), "/abs/key.pem")
    proxy = load_config(path).config.proxy_config()
    assert proxy.listen_tls == ("127.0.0.1:8443",)
    assert proxy.tls.certificates[0].cert_file == str(tmp_path / "c/cert.pem")
