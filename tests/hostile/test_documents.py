"""Bombs through the admin API while the gateway serves traffic (issue 53).

The real gateway runs as a process of its own (``controller.main serve``) in front of a real
replica (``python -m http.server``, a static upstream), with a loop of concurrent requests
going through it. Each bomb of ``tests/bombs.py`` (YAML alias bombs of 324 and 254 bytes, an
alias inside its own anchor, 20 KB of nesting in YAML and JSON) is PUT to
``/api/services/web`` again and again: each must be answered 413 naming its limit in well
under a second, no request of the loop may fail, the loop's p99 must stay near the one
measured before the bombs in the same test, and the gateway's memory must stay bounded.
Before ``controller/documents.py``, the 324-byte one was never answered and grew the gateway
past 4 GB; the 254-byte one stalled traffic for 17.5 s.
"""

from __future__ import annotations

import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from controller.documents import MAX_DEPTH, MAX_NODES
from tests.bombs import BOMBS
from tests.e2e.conftest import PROBE, Load, Outcome, gateway_process
from tests.support.eventually import eventually
from tests.support.ports import free_port

from .conftest import MiB, rss

BASELINE = 500
"""Requests answered before the bombs, for the loop's p99 without them."""
BOMBING = 2.0
"""Seconds of bombs, one after the other: each bomb sent at least 3 times, at most 200."""
ROUNDS = (3, 200)


def p99(outcomes: list[Outcome]) -> float:
    took = sorted(o.took for o in outcomes)
    return took[min(len(took) - 1, int(len(took) * 0.99))]


async def ready(url: str, timeout: float = 20.0) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:

        async def answers() -> bool:
            async with http.get(url) as response:
                return response.status == 200

        await eventually(answers, timeout=timeout, every=0.1, what=f"{url} to answer 200")


async def test_bombs_are_refused_at_once_and_traffic_goes_on(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("v1")
    upstream_port, traffic, admin = free_port(), free_port(), free_port()
    replica = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "http.server", str(upstream_port), "--bind", "127.0.0.1",
        cwd=site, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{traffic}",
        "admin": {"listen": f"127.0.0.1:{admin}", "token_env": None},
        "state_dir": str(tmp_path / "state"),
        "access_log": {"enabled": False},
        "proxy": {"shutdown_timeout": 1},
        "services": [
            {
                "name": "web",
                "route": {"path_prefix": "/"},
                "backend": "static",
                "replica": {"addresses": [f"127.0.0.1:{upstream_port}"]},
                "probes": [PROBE],
            }
        ],
    }
    config_path = tmp_path / "gateway.json"
    config_path.write_text(json.dumps(config))
    log = tmp_path / "gateway.log"
    gateway = await gateway_process(config_path, log)
    try:
        await ready(f"http://127.0.0.1:{admin}/readyz")
        await ready(f"http://127.0.0.1:{traffic}/")
        timeout = aiohttp.ClientTimeout(total=5)
        async with (
            Load(f"http://127.0.0.1:{traffic}", clients=4, limit=30) as load,
            aiohttp.ClientSession(timeout=timeout) as http,
        ):
            start = load.mark()
            await load.more(BASELINE)
            baseline = load.sent_since(start)
            memory = rss(gateway.pid)
            start = load.mark()
            bombs = {name: (kind, body.encode()) for name, (kind, body) in BOMBS.items()}
            took: dict[str, list[float]] = {name: [] for name in BOMBS}
            rounds, until_time = 0, time.monotonic() + BOMBING
            while rounds < ROUNDS[0] or (time.monotonic() < until_time and rounds < ROUNDS[1]):
                for name, (content_type, body) in bombs.items():
                    sent = time.monotonic()
                    async with http.put(
                        f"http://127.0.0.1:{admin}/api/services/web",
                        data=body,
                        headers={"Content-Type": content_type},
                    ) as response:
                        answer = await response.json()
                    took[name].append(time.monotonic() - sent)
                    assert response.status == 413, (name, answer)
                    assert answer["error"] == "document_too_large", (name, answer)
                    allowed = {"depth": MAX_DEPTH, "nodes": MAX_NODES}[answer["limit"]]
                    assert answer["allowed"] == allowed
                rounds += 1
            ended = time.monotonic()
            grown = rss(gateway.pid) - memory
            await load.more(8)  # what was in flight when the bombs ended, answered
            during = [o for o in load.sent_since(start) if o.at < ended]
        median = {name: statistics.median(times) for name, times in took.items()}
        slowest = {name: max(times) for name, times in took.items()}
        print(
            f"\nbombs: {rounds} rounds of {len(BOMBS)}; refused in (median / slowest, ms): "
            + ", ".join(f"{n} {1000 * median[n]:.1f} / {1000 * slowest[n]:.1f}" for n in BOMBS)
        )
        print(
            f"traffic: baseline {len(baseline)} requests, p99 {1000 * p99(baseline):.1f} ms, "
            f"max {1000 * max(o.took for o in baseline):.1f} ms; during the bombs "
            f"{len(during)} requests, p99 {1000 * p99(during):.1f} ms, "
            f"max {1000 * max(o.took for o in during):.1f} ms; "
            f"{len(load.failures)} failed; gateway RSS grew {grown / MiB:.1f} MiB"
        )
        assert not load.failures, load.summary()
        # Generous bounds: the stalls were 17 to 32 s long, or without end. The machine is
        # shared (the whole suite at a load average of 10 saw a p99 of 0.17 s against 0.01 s
        # before the bombs), so a single refusal or request may wait for a CPU: these tell a
        # bounded refusal from a stall, and the figures above say how close they were.
        assert max(median.values()) < 0.25, median
        assert max(slowest.values()) < 3.0, slowest
        assert p99(during) < max(4 * p99(baseline), p99(baseline) + 0.5)
        assert max(o.took for o in during) < 3.0
        assert grown < 50 * MiB
    except BaseException:
        print(log.read_text()[-4000:])
        raise
    finally:
        for process, grace in ((gateway, 10.0), (replica, 2.0)):
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(process.wait(), grace)
                except TimeoutError:  # a gateway stuck in a bomb ignored SIGTERM (issue 53)
                    process.kill()
                    await process.wait()
