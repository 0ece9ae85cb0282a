"""Sticky assignment (``proxy.sticky``): the same key draws the same side of a split."""

from __future__ import annotations

from gateway.config import StickyConfig
from gateway.health.state import Health
from gateway.pool.snapshot import Split
from gateway.pool.upstream import Upstream
from gateway.proxy.sticky import draw, value


def test_the_value_of_a_header_or_a_cookie() -> None:
    headers = [(b"Host", b"a"), (b"X-User", b" alice "), (b"Cookie", b"a=1; uid=u-42; b=2")]
    assert value(StickyConfig(header="x-user"), headers) == b"alice"
    assert value(StickyConfig(cookie="uid"), headers) == b"u-42"
    assert value(StickyConfig(cookie="nope"), headers) is None
    assert value(StickyConfig(header="X-Other"), headers) is None


def test_a_key_keeps_its_side_and_keys_spread_by_the_weight() -> None:
    stable = Upstream("s", "web", "h", 1, revision=1, health=Health.HEALTHY)
    canary = Upstream("c", "web", "h", 2, revision=2, health=Health.HEALTHY)
    at_25 = Split.of(2, 25, (stable, canary))
    at_50 = Split.of(2, 50, (stable, canary))
    keys = [f"user-{i}".encode() for i in range(4000)]
    on_canary = [k for k in keys if at_25.group(draw(k)) == (canary,)]
    assert 900 < len(on_canary) < 1100
    # Always the same side for a key; a client on the canary at 25% stays on it at 50%.
    assert all(at_25.group(draw(k)) == (canary,) for k in on_canary)
    assert all(at_50.group(draw(k)) == (canary,) for k in on_canary)
    assert all(0.0 <= draw(k) < 1.0 for k in keys)
