"""What a serving gateway process holds: no libuv thread pool.

Its listeners (the traffic one and the admin API's aiohttp site) are bound on sockets of its
own, so uvloop starts no thread pool to resolve their addresses.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.support.eventually import eventually
from tests.support.ports import free_port

from .conftest import Gateways, children, serve_process, spec, threads


async def test_the_serving_process_starts_no_thread_pool(gateways: Gateways, site):
    admin = free_port()
    config = gateways.write_config(
        gateways.config(
            admin={"listen": f"127.0.0.1:{admin}", "token_env": None},
            services=[spec(site("v1"), 1)],
        )
    )
    process = await serve_process(config)
    try:
        base = f"http://127.0.0.1:{admin}"
        async with aiohttp.ClientSession() as session:

            async def ready() -> bool:
                async with session.get(f"{base}/api/services/web") as response:
                    view = await response.json()
                return any(r["state"] == "ready" for r in view["replicas"])

            # Its replica passed its HTTP probes; the admin API answered (and /metrics).
            await eventually(ready, timeout=15, what="a ready replica")
            async with session.get(f"{base}/metrics") as response:
                assert response.status == 200
        gateways.other_pids |= children(process.pid)
        assert "libuv-worker" not in threads(process.pid), threads(process.pid)
    finally:
        process.terminate()  # the config's replicas_on_exit: stop
        await asyncio.wait_for(process.wait(), 15)
