"""HTTPS end to end: the real gateway (one process, and worker processes) serving a real
replica over TLS, its certificate replaced on disk and reloaded by the admin API and SIGHUP
while it serves, and what metrics and ``GET /api/tls`` say of it."""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from tests.gateway.test_tls import client_context, handshake, write_pair
from tests.support.eventually import eventually

from .conftest import Gateways, serving, spec


@pytest.mark.parametrize("workers", [1, 2])
async def test_https_served_and_certificates_reloaded_without_a_restart(
    gateways: Gateways, site, ca: trustme.CA, tmp_path: Path, workers: int
) -> None:
    pair = write_pair(ca, tmp_path / "cert", "a.test")
    gw = await gateways.start(
        workers=workers,
        listen_tls=["127.0.0.1:0"],
        tls={"certificates": [asdict(pair)], "watch_interval": 0},
    )
    await serving(gw, spec(site("v1")))
    traffic = gw.gateway.traffic
    port = traffic.tls_ports[0]
    context = client_context(ca)

    async def names_served(name: str = "a.test") -> list[str]:
        names, _, _, answer = await asyncio.to_thread(
            handshake, port, context, name, None,
            b"GET / HTTP/1.1\r\nHost: a.test\r\nConnection: close\r\n\r\n",
        )  # fmt: skip
        assert answer.startswith(b"HTTP/1.1 200 "), answer
        assert answer.endswith(b"v1"), answer
        return names

    for _ in range(4):
        assert await names_served() == ["a.test"]

    admin = f"http://127.0.0.1:{gw.gateway.admin.port}"
    write_pair(ca, tmp_path / "cert", "a.test", "b.test")  # renewed in place
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{admin}/api/tls/reload") as answer:
            body = await answer.json()
        assert answer.status == 200, body
        assert [c["names"] for c in body["certificates"]] == [["a.test", "b.test"]]
        assert body["refused"] == []

        # Every process serves the new one (workers hear the reload over their channel).
        async def all_new() -> bool:
            seen = [await names_served("b.test") for _ in range(6)]
            return all(names == ["a.test", "b.test"] for names in seen)

        await eventually(all_new, timeout=5, what="every process serving the new pair")

        Path(pair.key_file).write_text("garbage\n")  # a bad file: refused, the last one serves
        if workers == 1:
            os.kill(os.getpid(), signal.SIGHUP)  # the gateway's handler, on this loop

            async def reloaded() -> Any:
                async with session.get(f"{admin}/api/tls") as answer:
                    shown = await answer.json()
                return shown if shown["reload_failures"] else None

            body = await eventually(reloaded, what="the reload after SIGHUP")
        else:
            async with session.post(f"{admin}/api/tls/reload") as answer:
                body = await answer.json()
        assert [(r["file"], r["reason"]) for r in body["refused"]] == [
            (pair.key_file, "cannot load the pair: no PEM private key in it")
        ]
        assert body["reload_failures"] == 1
        assert await names_served("b.test") == ["a.test", "b.test"]

        async def handshakes_counted() -> bool:
            async with session.get(f"{admin}/metrics") as answer:
                text = await answer.text()
            ok = [
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith('gateway_tls_handshakes_total{outcome="ok"')
            ]
            return sum(ok) >= 4 + 6 + 1 and (
                'gateway_tls_certificate_expiry_timestamp_seconds{name="a.test"}' in text
            )

        # Workers report every second.
        await eventually(handshakes_counted, timeout=5, every=0.2, what="the handshakes counted")
