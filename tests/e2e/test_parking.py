"""Idle keep-alive connections parked by a real ``gateway serve`` process (uvloop, the data
plane as built), with two workers: each comes back for its next request, ``/metrics`` counts
them, and a client that goes away leaves no descriptor behind."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.support.eventually import eventually
from tests.support.ports import free_port

from .conftest import Gateways, children, serve_process, spec

CONNECTIONS = 200
GET = b"GET / HTTP/1.1\r\nHost: web\r\n\r\n"


async def answered(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head.split(b" ", 2)[1] + b" " + await reader.readexactly(length)


def gateway_ends(port: int) -> dict[str, set[int]]:
    """The inodes of the sockets on the gateway's side of its clients' connections (local
    port ``port``), by TCP state: ``established``, ``close_wait`` (its client closed, it did
    not), and ``listen``."""
    states = {"01": "established", "08": "close_wait", "0A": "listen"}
    found: dict[str, set[int]] = {name: set() for name in states.values()}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] in states:
            found[states[fields[3]]].add(int(fields[9]))
    return found


def parked(pids: set[int], port: int) -> int:
    """Client connections of ``pids`` watched by an epoll set that does not watch the listening
    sockets: the parked ones (``proxy.parking``), not the event loop's."""
    ends = gateway_ends(port)
    count = 0
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") != "anon_inode:[eventpoll]":
                    continue
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
            except OSError:
                continue  # closed meanwhile
            watched = {  # "tfd: 12 events: 2019 data: c pos:0 ino:9a5a4 sdev:9"
                int(line.split("ino:")[1].split()[0], 16)
                for line in info.splitlines()
                if line.startswith("tfd:")
            }
            if not watched & ends["listen"]:
                count += len(watched & ends["established"])
    return count


async def gauge(admin: int, state: str) -> float:
    """``gateway_client_connections{state=...}`` on the admin listener's ``/metrics``."""
    async with aiohttp.ClientSession() as session:
        async with session.get(f"http://127.0.0.1:{admin}/metrics") as response:
            text = await response.text()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_client_connections" and sample.labels["state"] == state:
                return sample.value
    raise AssertionError("no gateway_client_connections sample")


async def test_parked_connections_are_served_again_and_closed_with_their_clients(
    gateways: Gateways, site
):
    port, admin = free_port(), free_port()
    config = gateways.write_config(
        gateways.config(
            listen=f"127.0.0.1:{port}",
            admin={"listen": f"127.0.0.1:{admin}", "token_env": None},
            proxy={"shutdown_timeout": 2, "limits": {"park_after": 0.2}},
            workers=2,
            services=[spec(site("v1"), 1)],
        )
    )
    process = await serve_process(config)
    try:

        async def ready() -> bool:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(GET)
                return (await answered(reader)).startswith(b"200")
            finally:
                writer.close()
                await writer.wait_closed()

        await eventually(ready, timeout=20, what="its replica ready")
        workers = children(process.pid)  # and the replica, which holds none of these
        clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(CONNECTIONS)]

        async def all_reported() -> bool:
            return await gauge(admin, "parked") == CONNECTIONS

        for round_ in range(3):  # each round on connections parked since the last
            async with asyncio.timeout(20):  # one at a time: the replica is http.server
                bodies = []
                for reader, writer in clients:
                    writer.write(GET)
                    bodies.append(await answered(reader))
            assert bodies == [b"200 v1"] * CONNECTIONS, round_
            # Each idle past its park_after (0.2 s, then more), as the workers report it.
            await eventually(lambda: parked(workers, port) == CONNECTIONS, what="all parked")
            await eventually(all_reported, every=0.2, timeout=5, what="the parked gauge")
            assert await gauge(admin, "in_loop") == 0

        for _, writer in clients:
            writer.close()
            await writer.wait_closed()

        def closed() -> bool:  # the gateway closed its ends too
            ends = gateway_ends(port)
            return not ends["established"] and not ends["close_wait"]

        await eventually(closed, what="the gateway's ends closed")
    finally:
        process.terminate()
        await asyncio.wait_for(process.wait(), 15)
