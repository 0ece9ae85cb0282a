"""controller/cluster/connect.py: a client from ``state.etcd``, over TLS with a client pair."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trustme

from controller.cluster.config import EtcdConfig
from controller.cluster.connect import connect
from controller.etcd import EtcdUnavailable
from tests.support.etcd_cluster import require_etcd
from tests.support.ports import free_port


@pytest.fixture
def tls_etcd(tmp_path: Path) -> Iterator[tuple[str, Path, trustme.CA]]:
    """One etcd member that serves clients over TLS only and asks them for a certificate."""
    binary = require_etcd()
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    port, peer = free_port(), free_port()
    endpoint = f"https://127.0.0.1:{port}"
    with (tmp_path / "etcd.log").open("wb") as log:
        process = subprocess.Popen(
            [
                binary,
                "--data-dir",
                str(tmp_path / "data"),
                "--listen-client-urls",
                endpoint,
                "--advertise-client-urls",
                endpoint,
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
                "--cert-file",
                str(tmp_path / "server.pem"),
                "--key-file",
                str(tmp_path / "server.key"),
                "--trusted-ca-file",
                str(tmp_path / "ca.pem"),
                "--client-cert-auth",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield endpoint, tmp_path, ca
    finally:
        process.terminate()
        process.wait(10)


async def wait_answering(config: EtcdConfig) -> None:
    deadline = time.monotonic() + 20
    client = connect(config)
    try:
        while True:
            try:
                await client.get(b"/")
                return
            except EtcdUnavailable:
                if time.monotonic() > deadline:
                    raise
    finally:
        await client.close()


async def test_tls_with_a_client_certificate(tls_etcd: tuple[str, Path, trustme.CA]) -> None:
    endpoint, base, ca = tls_etcd
    client_pair = ca.issue_cert("gateway-node")
    client_pair.cert_chain_pems[0].write_to_path(str(base / "client.pem"))
    client_pair.private_key_pem.write_to_path(str(base / "client.key"))
    config = EtcdConfig.model_validate(
        {
            "endpoints": [endpoint],
            "timeout": "1s",
            "tls": {
                "ca_file": str(base / "ca.pem"),
                "cert_file": str(base / "client.pem"),
                "key_file": str(base / "client.key"),
            },
        }
    )
    await wait_answering(config)
    client = connect(config)
    try:
        revision = await client.put(b"/tls/k", b"v")
        async for batch in client.watch(b"/tls/k", start_revision=revision):
            assert batch[0].kv.value == b"v"
            break
    finally:
        await client.close()
    # Without the client pair etcd refuses the connection: unavailable, and says why.
    anonymous = connect(
        EtcdConfig.model_validate(
            {"endpoints": [endpoint], "timeout": "1s", "tls": {"ca_file": str(base / "ca.pem")}}
        )
    )
    try:
        with pytest.raises(EtcdUnavailable):
            await anonymous.get(b"/tls/k")
    finally:
        await anonymous.close()


def test_credentials_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ETCD_TEST_PASSWORD", "s3cret")
    config = EtcdConfig.model_validate(
        {
            "endpoints": ["http://127.0.0.1:2379"],
            "username": "gw",
            "password_env": "ETCD_TEST_PASSWORD",
            "timeout": "500ms",
        }
    )
    client = connect(config)
    assert client._password == "s3cret"
    assert client._username == "gw"
    assert client.timeout == 0.5
