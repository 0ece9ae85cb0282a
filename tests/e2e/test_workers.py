"""Two worker processes: a rolling update under load, and /metrics for the whole gateway.

The gateway runs in-process as in the other end-to-end tests, with ``workers: 2``: two real
``gateway.worker`` processes serve the traffic port, the replicas are real processes, and the
controller in this process drains an old replica only once both workers hold nothing of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import aiohttp
import pytest

from gateway import Supervisor, native
from tests.support.eventually import eventually
from tests.support.ports import free_port

from .conftest import Gateways, Load, alive, children, serve_process, serving, spec, threads

ROOT = Path(__file__).resolve().parents[2]


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
        await eventually(
            lambda: gw.state().observed.rollout is None and gw.ready(2) == 2,
            timeout=15,
            what="two ready replicas of revision 2",
        )
        after = load.mark()
        await load.more(100)

    assert not load.failures, load.summary()
    assert load.bodies(after) == {"v2"}
    assert gw.rollouts()[0].status == "complete"
    # Both workers served, and /metrics counts every request they answered, once (revision
    # 1's series went with its last replica: no stale series).
    await eventually(
        lambda: sum(w.served for w in supervisor.workers.values()) == len(load.outcomes),
        timeout=5,
        what="the workers' reports",
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
    await eventually(
        lambda: not any(alive(pid) for pid in workers), timeout=10, what="the workers to exit"
    )


MODULES_AT_EXIT = """
import atexit, json, os, sys

def _modules_at_exit():
    with open(os.path.join(%r, f"{os.getpid()}.json"), "w") as out:
        json.dump({n: getattr(m, "__file__", None) for n, m in sys.modules.items()}, out)
    with open(os.path.join(%r, f"{os.getpid()}.flags"), "w") as out:
        json.dump([sys.flags.optimize, "no_debug_ranges" in sys._xoptions], out)

atexit.register(_modules_at_exit)
"""
"""A ``sitecustomize``: every Python process started with it on its path writes the modules
it has loaded when it exits, and their files (``sys.modules``: imports inside functions too),
and its ``-O`` level and whether it runs with ``-X no_debug_ranges``."""


async def test_a_serving_worker_imports_neither_aiohttp_nor_the_control_plane(
    gateways: Gateways, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A worker is spawned, so it holds only what its imports bring: the admin API's and the
    prober's aiohttp, the controller, the supervisor and the metrics' collectors
    (``gateway.observability.scrape``, with prometheus_client: a worker counts in plain
    ints), the span exporter and its OTLP encoding (opentelemetry-proto, protobuf: a worker
    hands its spans over as plain tuples), the config's models (pydantic: a worker's settings
    come over its channel as dataclasses) stay in the main process (a worker's memory is
    counted once per core). Read from the modules real workers of ``gateway serve --workers
    2`` had loaded when they exited, having served a request (with spans recorded); they ran
    the data plane the suite runs (compiled under GATEWAY_NATIVE=1: ``python -m
    gateway.workers`` calls ``native.use`` first)."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(MODULES_AT_EXIT % (str(tmp_path), str(tmp_path)))
    path = [str(hooks), os.environ.get("PYTHONPATH") or str(ROOT)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    port = free_port()
    # Spans on (to a collector that is not there): a worker records them as plain tuples.
    tracing = {"otlp_endpoint": f"http://127.0.0.1:{free_port()}", "sample_ratio": 1}
    config = gateways.config(workers=2, listen=f"127.0.0.1:{port}", tracing=tracing)
    process = await serve_process(gateways.write_config(config))
    try:
        workers = children(process.pid)
        assert len(workers) == 2
        async with aiohttp.ClientSession() as session:
            for _ in range(4):  # the proxy's answer for a path no service routes
                async with session.get(f"http://127.0.0.1:{port}/nowhere") as response:
                    assert response.status == 404
        process.send_signal(signal.SIGTERM)  # stops its workers: each exits as it should
        assert await asyncio.wait_for(process.wait(), 30) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    for pid in workers:
        files = json.loads((tmp_path / f"{pid}.json").read_text())
        # -OO, and code objects without column positions (-X no_debug_ranges)
        assert json.loads((tmp_path / f"{pid}.flags").read_text()) == [2, True], pid
        modules = set(files)
        packages = {m.split(".")[0] for m in modules}
        assert {"gateway.workers.worker", "gateway.proxy.handler", "uvloop"} <= modules, pid
        assert not packages & {"aiohttp", "controller", "yaml", "prometheus_client"}, packages
        assert not packages & {"h2", "hpack", "hyperframe", "grpc"}, packages  # HTTP/2 at its first
        assert not packages & {"pydantic", "pydantic_core"}, packages  # gateway.config
        # Spans are encoded and exported by the main process (``gateway.observability.otlp``)
        assert not packages & {"opentelemetry", "google"}, packages
        assert not modules & {
            "gateway.proxy.h2_upstream",
            "gateway.observability.metrics",
            "gateway.health.prober",
            "gateway.observability.scrape",
            "gateway.observability.exporter",
            "gateway.observability.otlp",
            "gateway.tls.metrics",
            "gateway.workers.metrics",
            "gateway.workers.supervisor",
        }
        assert not packages & {"shutil", "tempfile"}, packages  # gateway.native's build only
        # hashlib where a digest is made (a supervisor hands its workers the sources' digest,
        # and these services check no token and hash no key); TLS with HTTPS listeners only
        assert not modules & {"hashlib", "_hashlib", "hmac", "gateway.tls"}, pid
        # the channel's messages are marshalled, not pickled (gateway.workers.ipc)
        assert not modules & {"pickle", "_pickle"}, pid
        assert "http" not in modules, pid  # reason phrases are wire.http1's own table
        assert "sysconfig" not in modules, pid  # gateway.native's tag is made from os.uname()
        # gateway.config's bounds are its own, not annotated_types' (which brings the first
        # three in); gateway.native reads its version from sys.version
        assert not packages & {"annotated_types", "typing_extensions", "datetime", "platform"}
        wanted = os.environ.get(native.ENV)
        if wanted in ("0", "1"):
            hot = [f"gateway.{m}" for m in native.MODULES if f"gateway.{m}" in modules]
            assert "gateway.proxy.handler" in hot
            compiled = {m for m in hot if not files[m].endswith(".py")}
            assert compiled == (set(hot) if wanted == "1" else set()), compiled
