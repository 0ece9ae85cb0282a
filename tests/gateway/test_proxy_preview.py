"""Preview routes and the split through the real proxy, against aiohttp upstreams."""

from __future__ import annotations

from aiohttp.test_utils import unused_port

from gateway.config import PreviewConfig
from gateway.pool.upstream import Health, Upstream

from .conftest import routing, url


async def test_a_preview_is_never_retried_on_another_revision(pool, upstream, gateway, client):
    preview = PreviewConfig(allow="anyone")
    pool.set_service(routing("web", prefix="/", load_balancing="round_robin", preview=preview))
    await upstream("web", "stable")  # revision 0
    pool.add_upstream(Upstream("dead", "web", "127.0.0.1", unused_port(), revision=2))
    pool.set_health("web", "dead", Health.HEALTHY)
    gw = await gateway()

    async with client.get(url(gw), headers={"X-Gateway-Revision": "2"}) as resp:
        assert resp.status == 502  # revision 2 refuses: not answered by revision 0
    async with client.get(url(gw), headers={"X-Gateway-Revision": "0"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["upstream"] == "stable"
