"""A second ``gateway serve`` beside a running one touches nothing of it (issue 53).

Regression: a second start on the same config opened the store, adopted the running
gateway's replicas, failed to bind the traffic port and, with ``replicas_on_exit: stop``,
stopped those replicas on its way out: the first gateway's service had no ready replica for
seconds. Now the second one stops at the state directory's lock, or at its first bind, exit 2.

Both gateways are processes of their own, as in production; the first serves a bounded
request loop through the whole attempt.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.eventually import eventually
from tests.support.ports import free_port

from .conftest import Gateways, Load, alive, children, gateway_process, spec


async def _ready_replicas(admin: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{admin}/api/services/web") as response,
    ):
        if response.status != 200:
            return 0
        view = await response.json()
    return sum(r["state"] == "ready" for r in view["replicas"])


class First:
    """The running gateway: a process serving ``web`` with two replicas."""

    def __init__(self, gateways: Gateways, config: dict[str, Any], tmp_path: Path) -> None:
        self.gateways = gateways
        self.config = config
        self.path = gateways.write_config(config)
        self.log = tmp_path / "first.log"
        self.traffic = int(config["listen"].rsplit(":", 1)[1])
        self.admin = int(config["admin"]["listen"].rsplit(":", 1)[1])
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        process = self.process = await gateway_process(self.path, self.log)

        async def both_ready() -> bool:  # a refused connection: not listening yet
            assert process.returncode is None, self.log.read_text()
            return await _ready_replicas(self.admin) == 2

        await eventually(both_ready, timeout=20, every=0.1, what="the first gateway's replicas")
        self.gateways.other_pids |= self.replicas()

    def replicas(self) -> set[int]:
        assert self.process is not None
        return children(self.process.pid)

    async def stop(self) -> None:
        if self.process is None:
            return
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)  # replicas_on_exit: stop
        try:
            await asyncio.wait_for(self.process.wait(), 15)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()


async def _second(config: Path, log: Path) -> tuple[int, float, str]:
    """Run ``gateway serve -c config`` to its end: its exit code, seconds, output."""
    began = time.monotonic()
    process = await gateway_process(config, log)
    try:
        code = await asyncio.wait_for(process.wait(), 30)  # its imports, on a loaded machine
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"the second gateway did not exit: {log.read_text()}") from None
    return code, time.monotonic() - began, log.read_text()


def _config(gateways: Gateways, site: Any, traffic: int, admin: int) -> dict[str, Any]:
    return gateways.config(
        on_exit="stop",  # as configs/gateway.yaml: what stopped the first one's replicas
        listen=f"127.0.0.1:{traffic}",
        admin={"listen": f"127.0.0.1:{admin}", "token_env": None},
        services=[spec(site("v1"), 2)],
        log_level="info",
    )


async def test_a_second_gateway_on_the_same_config_exits_2_and_the_first_serves_on(
    gateways: Gateways, site, tmp_path: Path
) -> None:
    config = _config(gateways, site, free_port(), free_port())
    first = First(gateways, config, tmp_path)
    try:
        await first.start()
        assert first.process is not None
        replicas = first.replicas()
        assert len(replicas) == 2
        async with Load(f"http://127.0.0.1:{first.traffic}", clients=4, limit=30) as load:
            code, took, output = await _second(first.path, tmp_path / "second.log")
            await load.more(100)  # and on, after the second one's end
        print(f"second start: exit {code} after {took:.2f}s; {load.summary()}")
        assert code == 2, output
        lock = gateways.state_dir / "gateway.lock"
        assert (
            f"gateway: state directory {gateways.state_dir} is in use by another gateway"
            f" (pid {first.process.pid}, lock {lock})"
        ) in output
        assert not load.failures, load.summary()
        assert load.bodies() == {"v1"}
        assert first.replicas() == replicas
        assert all(alive(pid) for pid in replicas)
        assert await _ready_replicas(first.admin) == 2
    finally:
        await first.stop()


async def test_a_second_gateway_on_the_same_port_exits_2_having_touched_nothing(
    gateways: Gateways, site, tmp_path: Path
) -> None:
    """Another state directory, so no lock stops it: the traffic port does (or the admin
    port), before its store is opened or any replica of its config started."""
    traffic, admin = free_port(), free_port()
    first = First(gateways, _config(gateways, site, traffic, admin), tmp_path)
    taken = {  # the port they share with the first -> the second's config
        traffic: _config(gateways, site, traffic, free_port()),
        admin: _config(gateways, site, free_port(), admin),
    }
    try:
        await first.start()
        replicas = first.replicas()
        async with Load(f"http://127.0.0.1:{traffic}", clients=4, limit=30) as load:
            for port, config in taken.items():
                other = tmp_path / f"state-{port}"
                config["state_dir"] = str(other)
                path = gateways.write_config(config)
                code, took, output = await _second(path, tmp_path / f"second-{port}.log")
                print(f"second start on port {port}: exit {code} after {took:.2f}s")
                assert code == 2, output
                assert (
                    f"gateway: error while attempting to bind on address ('127.0.0.1', {port}):"
                    " address already in use"
                ) in output
                # Its own state directory: locked and released, nothing else.
                assert sorted(p.name for p in other.iterdir()) == ["gateway.lock"]
            await load.more(100)
        print(load.summary())
        assert not load.failures, load.summary()
        assert first.replicas() == replicas
        assert all(alive(pid) for pid in replicas)
        assert await _ready_replicas(first.admin) == 2
    finally:
        await first.stop()
