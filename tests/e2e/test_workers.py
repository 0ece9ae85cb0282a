"""Two worker processes: a rolling update under load, and /metrics for the whole gateway.

The gateway runs in-process as in the other end-to-end tests, with ``workers: 2``: two real
``gateway.worker`` processes serve the traffic port, the replicas are real processes, and the
controller in this process drains an old replica only once both workers hold nothing of it.
"""

from __future__ import annotations

import subprocess
import sys

import aiohttp

from gateway import Supervisor

from .conftest import Gateways, Load, alive, children, serve_process, serving, spec, threads, until


async def requests_counted(url: str, revision: int) -> float:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        text = await response.text()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("gateway_requests_total{")
        and 'service="web"' in line
        and f'revision="{revision}"' in line
    )


async def test_a_rolling_update_with_two_workers_costs_no_request(gateways: Gateways, site):
    gw = await gateways.start(workers=2)
    supervisor = gw.gateway.traffic
    assert isinstance(supervisor, Supervisor)
    worker_pids = {w.pid for w in supervisor.workers.values()}
    assert len(worker_pids) == 2
    await serving(gw, spec(site("v1"), 2))

    async with Load(gw.url, clients=8) as load:
        await load.more(100)
        result = await gw.controller.apply(spec(site("v2"), 2))
        assert (result.action, result.revision) == ("rollout", 2)
        await until(
            lambda: gw.state().observed.rollout is None and gw.ready(2) == 2,
            15,
            "two ready replicas of revision 2",
        )
        after = load.mark()
        await load.more(100)

    assert not load.failures, load.summary()
    assert load.bodies(after) == {"v2"}
    assert gw.rollouts()[0].status == "complete"
    # Both workers served, and /metrics counts every request they answered, once (revision
    # 1's series went with its last replica: no stale series).
    await until(
        lambda: sum(w.served for w in supervisor.workers.values()) == len(load.outcomes),
        5,
        "the workers' reports",
    )
    assert all(w.served for w in supervisor.workers.values())
    admin = f"http://127.0.0.1:{gw.gateway.admin.port}/metrics"
    served_by_v2 = sum(1 for o in load.outcomes if o.body == "v2")
    assert await requests_counted(admin, 2) == served_by_v2

    await gw.stop()
    assert not [pid for pid in worker_pids if alive(pid)], "a worker outlived the gateway"


async def test_workers_stop_by_themselves_when_the_main_process_is_killed(gateways: Gateways):
    process = await serve_process(gateways.write_config(gateways.config(workers=2)))
    try:
        workers = children(process.pid)
        assert len(workers) == 2
        for pid in workers:  # the loop's and the access log's: no libuv thread pool
            assert "libuv-worker" not in threads(pid), threads(pid)
    finally:
        process.kill()  # SIGKILL: no chance to stop its workers (this test started it)
        await process.wait()
    # Each worker sees its channel end, stops accepting, finishes and exits.
    await until(lambda: not any(alive(pid) for pid in workers), 10, "the workers to exit")


def test_a_worker_imports_neither_aiohttp_nor_the_control_plane():
    """A worker is spawned, so it holds only what its imports bring: the admin API's and the
    prober's aiohttp, the controller, the supervisor and the metrics' collectors (with
    prometheus_client: a worker counts in plain ints) stay in the main process (a worker's
    memory is counted once per core)."""
    code = (
        "import sys, gateway.workers.worker\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('gateway.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.splitlines()
    packages, modules = set(out[0].split()), set(out[1].split())
    assert not packages & {"aiohttp", "controller", "yaml", "prometheus_client"}, packages
    assert not modules & {
        "gateway.metrics",
        "gateway.prober",
        "gateway.scrape",
        "gateway.tls.metrics",
        "gateway.workers.supervisor",
    }
    assert not packages & {"pydantic", "pydantic_core"}, packages  # gateway.config: dataclasses
    assert not packages & {"shutil", "tempfile"}, packages  # gateway.native's build only
    # gateway.config's bounds are its own, not annotated_types' (which brings the first
    # three in); gateway.native reads its version from sys.version
    assert not packages & {"annotated_types", "typing_extensions", "datetime", "platform"}, packages
