"""Our own code against the library that could replace it: the figures of docs/decisions.md.

    .venv/bin/python bench/libraries.py ipc [--rounds 3000 --repeat 5 --upstreams 100]
    pip install --target /tmp/extra psutil   # not into .venv: psutil is not a dependency
    PYTHONPATH=/tmp/extra .venv/bin/python bench/libraries.py procfs [--repeat 5]
    PYTHONPATH=/tmp/extra .venv/bin/python bench/libraries.py imports [--repeat 5] [MODULE ...]
    python -m venv /tmp/v && /tmp/v/bin/pip install aetcd aiohttp uvloop
    PYTHONPATH=. /tmp/v/bin/python bench/libraries.py etcd [--repeat 6 --calls 300]
    /tmp/v/bin/pip install aiodocker && PYTHONPATH=. /tmp/v/bin/python bench/libraries.py docker
    PYTHONPATH=. .venv/bin/python bench/libraries.py scrape [--repeat 5 --histograms 40]
    python -m venv /tmp/otel && echo $PWD/.venv/lib/python3.11/site-packages \
        > /tmp/otel/lib/python3.11/site-packages/venv.pth   # sees .venv's packages too
    /tmp/otel/bin/pip install opentelemetry-exporter-otlp-proto-http==1.45.2 \
        opentelemetry-sdk==1.45.2   # the opentelemetry-proto release .venv has
    /tmp/otel/bin/python bench/libraries.py otlp [--repeat 3 --spans 20480 --batch 512]

``ipc``: the worker channel (``gateway.workers.ipc``, length + marshal on an asyncio stream
under uvloop) against ``multiprocessing.connection.Connection`` on the same socketpair, the
repetitions interleaved. A peer process answers each message; each round trip sends an
``Install`` of ``--upstreams`` upstreams and gets a ``Report`` back (both directions of the
real channel, with a pool larger than most). Modes: ``stream`` (ours: both ends on uvloop);
``connection`` (both ends blocking, no event loop: the cheapest ``Connection`` can be);
``connection-thread`` (the controller's end on uvloop with a thread blocked in ``recv`` that
hands each message to the loop, as ``Connection`` would have to run beside an event loop).
Then two facts: ``Connection.recv_bytes`` reads our frames (the same 4-byte big-endian
length), and ``Connection.send`` of a large ``Install`` on a non-blocking socket whose peer
does not read leaves a partial frame (``BlockingIOError`` after some bytes): it cannot share
the loop without a thread.

``procfs``: ``controller.backends.procfs`` against psutil for what the process backend asks
of ``/proc`` (needs psutil importable): is a (pid, pgid, start time) still alive; does a
process group have a live member (a scan of ``/proc``). CPU microseconds a call, medians.

``etcd``: ``controller.etcd.EtcdClient`` (etcd's JSON gateway over aiohttp) against aetcd
(gRPC through grpcio's asyncio API) on one etcd member on loopback (needs the ``etcd`` binary
and a Python with aetcd and uvloop: run it with that venv's python and ``PYTHONPATH=.``), each
run a fresh process on uvloop doing ``--calls`` rounds of put, get and a txn; the clients
interleaved. Wall and CPU microseconds a call, the process's threads (while its client is
open), its peak RSS.

``scrape``: ``gateway.health.load_report.figures`` (the three gauges a load scrape reads, by
their lines) against prometheus_client's text parser (every family, then the three picked
out) on a vLLM-like exposition: ``--histograms`` histograms of 30 buckets and the three
gauges. CPU milliseconds a parse, medians; the scrape runs on the traffic's event loop.

``docker``: ``controller.backends.docker.engine`` against aiodocker (both on aiohttp) on a stub
engine (canned answers on a unix socket, in a process of its own: only the clients' side is
compared), each run a fresh process on uvloop doing ``--calls`` rounds of a container's
inspect and a list of 20 containers by label; interleaved. Needs aiodocker (a venv of its own,
as for ``etcd``).

``otlp``: our span export (``gateway.observability.otlp`` encoding the data plane's span
tuples into opentelemetry-proto's messages, ``exporter.SpanExporter`` POSTing them with
aiohttp on uvloop) against ``opentelemetry-exporter-otlp-proto-http``'s ``OTLPSpanExporter``
(with ``opentelemetry-sdk``: it takes the SDK's ``ReadableSpan``, so each tuple is made into
one first; and as if the SDK had made them, given), to a sink on loopback in a process of its
own that keeps nothing (``--spans`` spans, ``--batch`` a batch): CPU microseconds a span,
medians and per-repetition ratios to ours. Then one export of a batch to a slow collector
(answering in 1 s) and to a failing one (503), ``--timeout`` for both exporters: the event
loop's longest lateness (a 1 ms ticker) and how long the export took, for ours, the
library's called on the loop (its ``requests`` call blocks) and the library's in a thread
(``asyncio.to_thread``, as the main process would have to run it).

``imports``: a fresh interpreter's ``import MODULE`` (``a,b``: both), and the ``-X importtime``
total of what it imports beyond a bare interpreter:
wall time and peak RSS (``VmHWM``) over a bare interpreter's, medians of ``--repeat``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("stream", "connection", "connection-thread")


# -- ipc --------------------------------------------------------------------------------------


def _messages(upstreams: int) -> tuple[Any, Any]:
    from gateway.config import RouteConfig, ServiceRouting
    from gateway.observability.tally import RequestTally
    from gateway.pool.snapshot import PoolSnapshot
    from gateway.pool.upstream import Upstream
    from gateway.workers import ipc

    ups = [Upstream(f"web-{i}", "web", "10.0.0.1", 9000 + i) for i in range(upstreams)]
    install = ipc.Install(
        ServiceRouting(name="web", route=RouteConfig(path_prefix="/")),
        PoolSnapshot.of("web", 7, ups),
    )
    report = ipc.Report(
        {("web", u.id): 1 for u in ups}, RequestTally().take(), 100, counts={"web": (50, 0)}
    )
    return install, report


def _peer(mode: str, fd: int, upstreams: int) -> None:
    """The worker's end: answer every message with a Report until end of stream."""
    _, report = _messages(upstreams)
    if mode == "stream":
        import uvloop

        from gateway.workers import ipc

        async def serve() -> None:
            sock = socket.socket(fileno=fd)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            while await ipc.receive(reader) is not None:
                writer.write(ipc.encode(report))
            writer.close()

        uvloop.run(serve())
    else:
        conn = Connection(fd)
        with contextlib.suppress(EOFError):
            while True:
                conn.recv()
                conn.send(report)
    print(time.process_time(), flush=True)


def _rounds(mode: str, sock: socket.socket, install: Any, rounds: int) -> float:
    """Wall seconds for ``rounds`` round trips over ``sock`` (the controller's end)."""
    if mode == "connection":
        conn = Connection(sock.detach())
        start = time.perf_counter()
        for _ in range(rounds):
            conn.send(install)
            conn.recv()
        elapsed = time.perf_counter() - start
        conn.close()
        return elapsed

    import uvloop

    from gateway.workers import ipc

    async def run() -> float:
        loop = asyncio.get_running_loop()
        if mode == "stream":
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            start = time.perf_counter()
            for _ in range(rounds):
                writer.write(ipc.encode(install))
                await ipc.receive(reader)
            elapsed = time.perf_counter() - start
            writer.close()
            return elapsed
        # connection-thread: a thread blocked in recv hands each message to the loop.
        conn = Connection(sock.detach())
        queue: asyncio.Queue[Any] = asyncio.Queue()

        def read() -> None:
            with contextlib.suppress(EOFError, OSError):
                while True:
                    loop.call_soon_threadsafe(queue.put_nowait, conn.recv())

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        start = time.perf_counter()
        for _ in range(rounds):
            conn.send(install)
            await queue.get()
        elapsed = time.perf_counter() - start
        # Closing the descriptor would not wake the thread blocked in recv (nor end the
        # peer): a thread beside a loop needs the socket shut down.
        socket.socket(fileno=os.dup(conn.fileno())).shutdown(socket.SHUT_RDWR)
        thread.join()
        conn.close()
        return elapsed

    return uvloop.run(run())


def _one_ipc(mode: str, rounds: int, upstreams: int) -> tuple[float, float]:
    """(wall µs, CPU µs of both processes) per round trip."""
    install, _ = _messages(upstreams)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = subprocess.Popen(
        [sys.executable, __file__, "ipc-peer", mode, str(theirs.fileno()), str(upstreams)],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    cpu_before = time.process_time()
    try:
        wall = _rounds(mode, ours, install, rounds)
        cpu = time.process_time() - cpu_before
        out, _ = peer.communicate(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        ours.close()
    # The peer's CPU includes its start-up (imports), the same for every mode: measured apart.
    return wall / rounds * 1e6, (cpu + float(out.split()[-1])) / rounds * 1e6


def _peer_startup(mode: str, upstreams: int) -> float:
    """CPU seconds of a peer that gets no message: its start-up, taken off the figures."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    peer = subprocess.Popen(
        [sys.executable, __file__, "ipc-peer", mode, str(theirs.fileno()), str(upstreams)],
        pass_fds=[theirs.fileno()],
        stdout=subprocess.PIPE,
        text=True,
    )
    theirs.close()
    ours.close()
    out, _ = peer.communicate(timeout=60)
    return float(out.split()[-1])


def _facts(upstreams: int) -> list[str]:
    from gateway.workers import ipc

    install, _ = _messages(upstreams)
    found = []
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.sendall(ipc.encode(install))
    same = Connection(b.detach()).recv_bytes() == ipc.encode(install)[4:]
    a.close()
    found.append(f"Connection.recv_bytes reads an ipc.encode frame: {same}")
    big = ipc.Install(install.routing, _messages(upstreams * 100)[0].snapshot)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.setblocking(False)
    conn = Connection(a.detach())
    size = len(ipc.encode(big))
    try:
        conn.send(big)
        found.append(f"Connection.send of {size} bytes, peer not reading: sent whole")
    except BlockingIOError:
        b.setblocking(False)
        written = 0
        with contextlib.suppress(BlockingIOError):
            while chunk := b.recv(1 << 20):
                written += len(chunk)
        found.append(
            f"Connection.send of {size} bytes on a non-blocking socket, peer not reading: "
            f"BlockingIOError after {written} bytes of the frame, the rest lost"
        )
    conn.close()
    b.close()
    return found


def ipc_bench(args: argparse.Namespace) -> None:
    from gateway.workers import ipc

    install, report = _messages(args.upstreams)
    print(
        f"Install of {args.upstreams} upstreams: {len(ipc.encode(install))} bytes; "
        f"Report: {len(ipc.encode(report))} bytes; {args.rounds} round trips a run"
    )
    startup = {
        m: statistics.median(_peer_startup(m, args.upstreams) for _ in range(3)) for m in MODES
    }
    results: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for rep in range(args.repeat):
        order = MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]
        for mode in order:
            wall, cpu = _one_ipc(mode, args.rounds, args.upstreams)
            results[mode].append((wall, cpu - startup[mode] / args.rounds * 1e6))
    print(f"{'mode':<20}{'wall µs/round trip':>20}{'CPU µs/round trip':>20}   (medians)")
    for mode in MODES:
        walls = [w for w, _ in results[mode]]
        cpus = [c for _, c in results[mode]]
        print(
            f"{mode:<20}{statistics.median(walls):>20.1f}{statistics.median(cpus):>20.1f}"
            f"   wall {min(walls):.1f}..{max(walls):.1f}"
        )
    for line in _facts(args.upstreams):
        print(line)


# -- procfs -----------------------------------------------------------------------------------


def _micros(call: Any, number: int) -> float:
    """CPU microseconds a call (CPU, not wall: the machine may be shared)."""
    start = time.process_time()
    for _ in range(number):
        call()
    return (time.process_time() - start) / number * 1e6


def procfs_bench(args: argparse.Namespace) -> None:
    import psutil

    from controller.backends import procfs

    child = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        pid = child.pid
        stat = procfs.read_stat(pid)
        assert stat is not None
        pgid = stat.pgrp
        process = psutil.Process(pid)
        created = process.create_time()

        def ours_alive() -> bool:
            return procfs.is_alive(pid, pgid, stat.start_time)

        def psutil_alive() -> bool:
            # psutil names a process by its create time (seconds, a float from the same
            # field) and has no process group: os.getpgid beside it.
            try:
                p = psutil.Process(pid)
                return (
                    p.create_time() == created
                    and os.getpgid(pid) == pgid
                    and p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
                )
            except (psutil.NoSuchProcess, ProcessLookupError):
                return False

        def ours_group() -> bool:
            return procfs.group_alive(pgid)

        def psutil_group() -> bool:
            for p in psutil.process_iter(["status"]):
                try:
                    if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                        return True
                except ProcessLookupError:
                    continue
            return False

        if not (ours_alive() and psutil_alive() and ours_group() and psutil_group()):
            raise RuntimeError("the two ways disagree on a live process")
        entries = sum(1 for e in os.listdir("/proc") if e.isdigit())
        cases = [
            ("is_alive", ours_alive, psutil_alive, 2000),
            (f"group_alive ({entries} processes)", ours_group, psutil_group, 30),
        ]
        print(f"{'call':<32}{'ours µs':>10}{'psutil µs':>12}{'psutil/ours':>13}   (medians)")
        for name, ours, theirs, number in cases:
            a: list[float] = []
            b: list[float] = []
            for _ in range(args.repeat):
                a.append(_micros(ours, number))
                b.append(_micros(theirs, number))
            ratio = statistics.median(y / x for x, y in zip(a, b, strict=True))
            print(
                f"{name:<32}{statistics.median(a):>10.1f}{statistics.median(b):>12.1f}"
                f"{ratio:>13.2f}"
            )
    finally:
        child.kill()
        child.wait()


def _status(field: str) -> int:
    """A number of ``/proc/self/status`` (``VmHWM`` in KiB: the peak RSS of this process
    since its exec, unlike ``ru_maxrss``, which a child inherits from the process it was
    forked from)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


# -- etcd -------------------------------------------------------------------------------------


def _etcd_client(which: str, port: int, calls: int) -> None:
    """In a fresh process on uvloop: ``calls`` rounds of put, get and a txn, sequential."""
    import uvloop

    async def ours() -> tuple[float, float, int]:
        from controller.etcd import Compare, EtcdClient, Put

        client = EtcdClient([f"http://127.0.0.1:{port}"])
        await client.put(b"warm", b"up")
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(calls):
            await client.put(b"bench/ours", str(i).encode())
            await client.get(b"bench/ours")
            await client.txn(
                [Compare(b"bench/ours", "VALUE", "EQUAL", str(i).encode())],
                [Put(b"bench/ours-txn", b"x")],
                [],
            )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        threads = _status("Threads")
        await client.close()
        return wall, cpu, threads

    async def aetcd_() -> tuple[float, float, int]:
        import aetcd

        client = aetcd.Client(host="127.0.0.1", port=port)
        await client.put(b"warm", b"up")
        tx = client.transactions
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(calls):
            await client.put(b"bench/aetcd", str(i).encode())
            await client.get(b"bench/aetcd")
            await client.transaction(
                compare=[tx.value(b"bench/aetcd") == str(i).encode()],
                success=[tx.put(b"bench/aetcd-txn", b"x")],
                failure=[],
            )
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        threads = _status("Threads")
        await client.close()
        return wall, cpu, threads

    wall, cpu, threads = uvloop.run(ours() if which == "ours" else aetcd_())
    print(wall / calls / 3 * 1e6, cpu / calls / 3 * 1e6, threads, _status("VmHWM"))


def etcd_bench(args: argparse.Namespace) -> None:
    import shutil
    import tempfile
    import urllib.request

    binary = shutil.which("etcd")
    if binary is None:
        sys.exit("etcd is not installed (apt-get install etcd-server)")
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    client_port, peer_port = ports
    with tempfile.TemporaryDirectory() as tmp:
        etcd = subprocess.Popen(
            [
                binary,
                f"--data-dir={tmp}/data",
                f"--listen-client-urls=http://127.0.0.1:{client_port}",
                f"--advertise-client-urls=http://127.0.0.1:{client_port}",
                f"--listen-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer_port}",
                f"--initial-cluster=default=http://127.0.0.1:{peer_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            for _ in range(100):
                with contextlib.suppress(OSError):
                    urllib.request.urlopen(f"http://127.0.0.1:{client_port}/health", timeout=1)
                    break
                time.sleep(0.1)
            clients = ("ours", "aetcd")
            rows: dict[str, list[list[float]]] = {c: [] for c in clients}
            for rep in range(args.repeat):
                for which in clients if rep % 2 == 0 else clients[::-1]:
                    out = subprocess.run(
                        [sys.executable, __file__, "etcd-client", which, str(client_port),
                         str(args.calls)],
                        capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    rows[which].append([float(x) for x in out.split()])
        finally:
            etcd.terminate()
            etcd.wait()
    print(f"etcd {client_port} on loopback, {args.calls} x (put, get, txn) a run, uvloop")
    print(
        f"{'client':<10}{'wall µs/call':>14}{'CPU µs/call':>13}{'threads':>9}{'peak RSS MiB':>14}"
    )
    for which in clients:
        med = [statistics.median(r[i] for r in rows[which]) for i in range(4)]
        print(f"{which:<10}{med[0]:>14.0f}{med[1]:>13.0f}{med[2]:>9.0f}{med[3] / 1024:>14.1f}")
    ratios = [b[1] / a[1] for a, b in zip(rows["ours"], rows["aetcd"], strict=True)]
    print(f"CPU aetcd/ours, pair by pair: median {statistics.median(ratios):.2f}")


# -- docker -----------------------------------------------------------------------------------


def _container(i: int) -> dict[str, Any]:
    """A container as the engine describes it, about the size of a real inspect answer."""
    labels = {"gateway.instance": "bench", "gateway.service": "web", "gateway.replica": f"r{i}"}
    return {
        "Id": f"{i:064x}",
        "Names": [f"/web-{i}"],
        "Image": "local/app:1",
        "State": {"Status": "running", "Running": True, "Pid": 1000 + i, "ExitCode": 0,
                  "StartedAt": "2026-12-07T06:00:00.000000000Z"},
        "Config": {"Labels": labels, "Env": [f"VAR_{k}=value-{k}" for k in range(20)],
                   "Cmd": ["python", "-m", "app"], "ExposedPorts": {"8000/tcp": {}}},
        "HostConfig": {"PortBindings": {"8000/tcp": [{"HostIp": "127.0.0.1",
                                                      "HostPort": str(20000 + i)}]},
                       "Init": True, "NanoCpus": 500000000, "Memory": 268435456},
        "NetworkSettings": {"Ports": {"8000/tcp": [{"HostIp": "127.0.0.1",
                                                    "HostPort": str(20000 + i)}]},
                            "Networks": {"bridge": {"IPAddress": f"172.17.0.{i % 250 + 2}"}}},
        "Labels": labels,
        "Mounts": [],
    }  # fmt: skip


def _stub_engine(path: str) -> None:
    """A stand-in for the Engine API on a unix socket: canned answers to the calls timed
    (a container's inspect, a list of 20 containers), HTTP/1.1 kept alive."""
    import json

    import uvloop

    one = json.dumps(_container(1)).encode()
    many = json.dumps([_container(i) for i in range(20)]).encode()

    class Engine(asyncio.Protocol):
        def connection_made(self, transport: Any) -> None:
            self.transport = transport
            self.buffer = b""

        def data_received(self, data: bytes) -> None:
            self.buffer += data
            while b"\r\n\r\n" in self.buffer:
                head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
                target = head.split(b" ", 2)[1]
                body = many if target.split(b"?")[0].endswith(b"/containers/json") else one
                self.transport.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json"
                    + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )  # fmt: skip

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_unix_server(Engine, path)
        print("ready", flush=True)
        await server.serve_forever()

    uvloop.run(serve())


def _docker_client(which: str, path: str, calls: int) -> None:
    """In a fresh process on uvloop: ``calls`` rounds of inspect and list by label (aiodocker
    has no ping)."""
    import uvloop

    labels = {"gateway.instance": "bench"}
    container = f"{1:064x}"

    async def ours() -> tuple[float, float]:
        from controller.backends.docker.engine import EngineClient

        client = EngineClient(f"unix://{path}")
        await client.ping()
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await client.inspect(container)
            await client.containers(labels)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await client.close()
        return wall, cpu

    async def aiodocker_() -> tuple[float, float]:
        import json

        import aiodocker

        client = aiodocker.Docker(url=f"unix://{path}", api_version="v1.41")
        filters = json.dumps({"label": [f"{k}={v}" for k, v in labels.items()]})
        await client.containers.list(all=True, filters=filters)
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await client.containers.container(container).show()  # one GET
            await client.containers.list(all=True, filters=filters)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        await client.close()
        return wall, cpu

    wall, cpu = uvloop.run(ours() if which == "ours" else aiodocker_())
    print(wall / calls / 2 * 1e6, cpu / calls / 2 * 1e6, _status("VmHWM"))


def docker_bench(args: argparse.Namespace) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/engine.sock"
        engine = subprocess.Popen(
            [sys.executable, __file__, "docker-engine", path], stdout=subprocess.PIPE, text=True
        )
        try:
            if engine.stdout is None or engine.stdout.readline().strip() != "ready":
                raise RuntimeError("the stub engine did not start")
            clients = ("ours", "aiodocker")
            rows: dict[str, list[list[float]]] = {c: [] for c in clients}
            for rep in range(args.repeat):
                for which in clients if rep % 2 == 0 else clients[::-1]:
                    out = subprocess.run(
                        [sys.executable, __file__, "docker-client", which, path, str(args.calls)],
                        capture_output=True, text=True, check=True,
                    ).stdout  # fmt: skip
                    rows[which].append([float(x) for x in out.split()])
        finally:
            engine.terminate()
            engine.wait()
    print(f"a stub engine on a unix socket, {args.calls} x (inspect, list of 20) a run, uvloop")
    print(f"{'client':<11}{'wall µs/call':>14}{'CPU µs/call':>13}{'peak RSS MiB':>14}")
    for which in clients:
        med = [statistics.median(r[i] for r in rows[which]) for i in range(3)]
        print(f"{which:<11}{med[0]:>14.0f}{med[1]:>13.0f}{med[2] / 1024:>14.1f}")
    ratios = [b[1] / a[1] for a, b in zip(rows["ours"], rows["aiodocker"], strict=True)]
    print(f"CPU aiodocker/ours, pair by pair: median {statistics.median(ratios):.2f}")


# -- imports ----------------------------------------------------------------------------------


def _import_once(module: str) -> tuple[float, int, int]:
    """(wall ms, peak RSS KiB, -X importtime total µs) of a fresh ``import module``."""
    code = (
        "import time\n"
        "t = time.perf_counter()\n"
        f"{'import ' + module if module else 'pass'}\n"
        "t = time.perf_counter() - t\n"
        "hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0].split()[1]\n"
        "print(t * 1e3, hwm)\n"
    )
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=os.environ
        | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
    )
    wall, rss = done.stdout.split()
    total = 0
    for line in done.stderr.splitlines():
        # "import time: self | cumulative | name": the top-level rows' cumulative summed.
        parts = line.split("|")
        if len(parts) == 3 and not parts[2].startswith("  ") and parts[1].strip().isdigit():
            total += int(parts[1])
    return float(wall), int(rss), total


def imports_bench(args: argparse.Namespace) -> None:
    modules = args.modules or ["psutil", "aiodocker", "aetcd", "etcd3"]
    rows: dict[str, list[tuple[float, int, int]]] = {m: [] for m in ["", *modules]}
    # "a,b": both imported in one interpreter (what b adds to a: compare with "a" alone).
    present = [
        m for m in modules if all(importlib.util.find_spec(p) is not None for p in m.split(","))
    ]
    for rep in range(args.repeat):
        order = ["", *present]
        if rep % 2:
            order.reverse()
        for module in order:
            rows[module].append(_import_once(module))
    base_rss = statistics.median(r for _, r, _ in rows[""])
    base_total = statistics.median(t for _, _, t in rows[""])
    print(f"{sys.executable} {sys.version.split()[0]}; bare interpreter {base_rss / 1024:.1f} MiB")
    width = max(28, *(len(m) + 2 for m in present))
    print(f"{'import':<{width}}{'wall ms':>9}{'importtime ms':>15}{'+RSS MiB':>10}   (medians)")
    for module in present:
        wall = statistics.median(w for w, _, _ in rows[module])
        rss = statistics.median(r for _, r, _ in rows[module]) - base_rss
        total = (statistics.median(t for _, _, t in rows[module]) - base_total) / 1e3
        print(f"{module:<{width}}{wall:>9.1f}{total:>15.1f}{rss / 1024:>10.1f}")
    for module in modules:
        if module not in present:
            print(f"{module:<{width}} not importable here")


# -- scrape -----------------------------------------------------------------------------------


def _exposition(histograms: int) -> str:
    labels = 'engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"'
    lines = []
    for h in range(histograms):
        lines += [f"# HELP vllm:histogram_{h} A histogram.", f"# TYPE vllm:histogram_{h} histogram"]
        lines += [f'vllm:histogram_{h}_bucket{{{labels},le="{b}.0"}} {b * 10}.0' for b in range(30)]
        lines += [
            f"vllm:histogram_{h}_sum{{{labels}}} 1.0",
            f"vllm:histogram_{h}_count{{{labels}}} 1.0",
        ]
    for name, value in (("running", 7), ("waiting", 3)):
        lines += [
            f"# TYPE vllm:num_requests_{name} gauge",
            f"vllm:num_requests_{name}{{{labels}}} {value}",
        ]
    lines += ["# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{labels}}} 0.4"]
    return "\n".join(lines) + "\n"


def scrape_bench(args: argparse.Namespace) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.health.load_report import figures

    text = _exposition(args.histograms)
    wanted = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}

    def library() -> dict[str, float]:
        return {
            sample.name: sample.value
            for family in text_string_to_metric_families(text)
            if family.name in wanted
            for sample in family.samples
        }

    assert library() == dict(zip(sorted(wanted), (0.4, 7.0, 3.0), strict=True))
    assert figures(text, "vllm") == (3.0, 7.0, 0.4)
    ours, theirs = [], []
    for _ in range(args.repeat):
        ours.append(_micros(lambda: figures(text, "vllm"), 20) / 1000)
        theirs.append(_micros(library, 5) / 1000)
    print(f"exposition: {len(text):,} bytes, {text.count(chr(10)):,} lines")
    print(f"load_report.figures      {statistics.median(ours):8.2f} ms CPU a parse")
    print(f"prometheus_client parser {statistics.median(theirs):8.2f} ms CPU a parse")


# -- otlp -------------------------------------------------------------------------------------


def _otlp_sink(delay: float, status: int) -> None:
    """An OTLP/HTTP collector that keeps nothing: each export read, answered after ``delay``
    seconds with ``status``. Prints its port."""
    from aiohttp import web

    async def export(request: web.Request) -> web.Response:
        await request.read()
        if delay:
            await asyncio.sleep(delay)
        return web.Response(status=status, content_type="application/x-protobuf")

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", export)
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(site._server.sockets[0].getsockname()[1], flush=True)  # type: ignore[union-attr]
        await asyncio.Event().wait()

    asyncio.run(serve())


@contextlib.contextmanager
def _sink(delay: float = 0.0, status: int = 200) -> Any:
    proc = subprocess.Popen(
        [sys.executable, __file__, "otlp-sink", str(delay), str(status)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline())}/v1/traces"
    finally:
        proc.terminate()
        proc.wait()


def _spans(n: int) -> list[Any]:
    """``n`` spans as the data plane records them (``gateway.observability.spans``): a
    sampled request's server span and its client span, by turns."""
    out: list[Any] = []
    for i in range(n // 2):
        trace, server, client = f"{i + 1:032x}", f"{2 * i + 1:016x}", f"{2 * i + 2:016x}"
        start = 1_700_000_000.0 + i / 1000
        out.append(
            (trace, server, "00f067aa0ba902b7", "GET web", 2, start, start + 0.002, False,
             (("http.request.method", "GET"), ("url.path", f"/items/{i}"),
              ("server.address", "example.com"), ("http.response.status_code", 200),
              ("http.request.body.size", 0), ("http.response.body.size", 512),
              ("gateway.retries", 0), ("gateway.service", "web"), ("gateway.revision", 3),
              ("gateway.upstream", "web-3-a1b2c3"), ("network.peer.address", "10.0.0.7:9000")))
        )  # fmt: skip
        out.append(
            (trace, client, server, "GET", 3, start + 0.0002, start + 0.0018, False,
             (("http.request.method", "GET"), ("server.address", "10.0.0.7"),
              ("server.port", 9000), ("gateway.upstream", "web-3-a1b2c3"),
              ("gateway.revision", 3), ("http.response.status_code", 200)))
        )  # fmt: skip
    return out


def _sdk_spans(spans: list[Any]) -> list[Any]:
    """Our spans as the SDK's ``ReadableSpan``, which the exporter library takes."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    resource = Resource({"service.name": "bench"})
    scope = InstrumentationScope("gateway")
    sampled = TraceFlags(TraceFlags.SAMPLED)
    ok, failed = Status(StatusCode.UNSET), Status(StatusCode.ERROR)
    out = []
    for trace_id, span_id, parent_id, name, kind, start, end, error, attributes in spans:
        trace = int(trace_id, 16)
        parent = SpanContext(trace, int(parent_id, 16), True, sampled) if parent_id else None
        out.append(
            ReadableSpan(
                name,
                SpanContext(trace, int(span_id, 16), False, sampled),
                parent,
                resource,
                dict(attributes),
                kind=SpanKind(kind - 1),  # the SDK counts from INTERNAL = 0, OTLP from 1
                status=failed if error else ok,
                start_time=round(start * 1e9),
                end_time=round(end * 1e9),
                instrumentation_scope=scope,
            )
        )
    return out


def _batches(spans: list[Any], size: int) -> list[list[Any]]:
    return [spans[i : i + size] for i in range(0, len(spans), size)]


async def _ours(url: str, batches: list[list[Any]], timeout: float = 10.0) -> tuple[float, int]:
    """CPU seconds of our exporter's ``export`` of every batch, and the spans accepted."""
    from gateway.config import TracingConfig
    from gateway.observability.exporter import SpanExporter

    exporter = SpanExporter(TracingConfig(otlp_endpoint=url, timeout=timeout))
    exporter.start()
    await exporter.export(batches[0])  # the connection opened, as in a gateway that runs
    exporter.exported = 0
    start = time.process_time()
    for batch in batches:
        await exporter.export(batch)
    took = time.process_time() - start
    await exporter.stop()
    return took, exporter.exported


def _library(url: str, batches: list[list[Any]], convert: bool) -> tuple[float, int]:
    """CPU seconds of the library exporter's ``export`` of every batch (``convert``: each
    batch made into SDK spans first, as the gateway's tuples would be), and the spans
    accepted."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import SpanExportResult

    exporter = OTLPSpanExporter(endpoint=url, timeout=10)
    exporter.export(_sdk_spans(batches[0]))
    given = batches if convert else [_sdk_spans(b) for b in batches]
    accepted = 0
    start = time.process_time()
    for batch in given:
        spans = _sdk_spans(batch) if convert else batch
        if exporter.export(spans) is SpanExportResult.SUCCESS:
            accepted += len(batch)
    took = time.process_time() - start
    exporter.shutdown()
    return took, accepted


async def _lag(work: Any) -> tuple[float, float]:
    """The event loop's longest lateness (a 1 ms ticker's) while ``work()`` is awaited, and
    the wall seconds it took."""
    loop = asyncio.get_running_loop()
    done = asyncio.Event()
    late = [0.0]

    async def tick() -> None:
        while not done.is_set():
            at = loop.time()
            await asyncio.sleep(0.001)
            late[0] = max(late[0], loop.time() - at - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done.set()
    await ticker
    return late[0], took


async def _stalls(url: str, batch: list[Any], timeout: float) -> dict[str, tuple[float, float]]:
    """Loop lag and wall time of one export of ``batch`` to ``url``: ours, the library's
    called on the loop, and the library's in a thread (``asyncio.to_thread``)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    from gateway.config import TracingConfig
    from gateway.observability.exporter import SpanExporter

    ours = SpanExporter(TracingConfig(otlp_endpoint=url, timeout=timeout))
    ours.start()
    theirs = OTLPSpanExporter(endpoint=url, timeout=timeout)
    sdk = _sdk_spans(batch)

    async def on_loop() -> None:
        theirs.export(sdk)

    async def in_thread() -> None:
        await asyncio.to_thread(theirs.export, sdk)

    out = {
        "ours": await _lag(lambda: ours.export(batch)),
        "library on the loop": await _lag(on_loop),
        "library in a thread": await _lag(in_thread),
    }
    await ours.stop()
    theirs.shutdown()
    return out


def otlp_bench(args: argparse.Namespace) -> None:
    import logging

    import uvloop

    logging.disable(logging.CRITICAL)  # both exporters log each failed export

    spans = _spans(args.spans)
    batches = _batches(spans, args.batch)
    rows: dict[str, list[float]] = {"ours": [], "library": [], "library, SDK spans given": []}
    with _sink() as url:
        for _ in range(args.repeat):
            took, n = uvloop.run(_ours(url, batches))
            assert n == len(spans), n
            rows["ours"].append(took / n * 1e6)
            took, n = _library(url, batches, convert=True)
            assert n == len(spans), n
            rows["library"].append(took / n * 1e6)
            took, n = _library(url, batches, convert=False)
            rows["library, SDK spans given"].append(took / n * 1e6)
    print(f"{len(spans)} spans in batches of {args.batch}, to a sink on loopback; CPU us a span")
    for name, values in rows.items():
        ratios = [v / o for v, o in zip(values, rows["ours"], strict=True)]
        print(
            f"  {name:<26} {statistics.median(values):7.2f}  x{statistics.median(ratios):.2f}"
            f"  ({' '.join(f'{v:.2f}' for v in values)})"
        )
    batch = batches[0]
    for what, delay, status in (("slow (answers in 1 s)", 1.0, 200), ("failing (503)", 0.0, 503)):
        with _sink(delay, status) as url:
            runs = [uvloop.run(_stalls(url, batch, args.timeout)) for _ in range(args.repeat)]
        print(f"one export of {len(batch)} spans to a {what} collector, timeout {args.timeout} s:")
        for name in runs[0]:
            late = statistics.median(r[name][0] for r in runs)
            took = statistics.median(r[name][1] for r in runs)
            print(f"  {name:<22} loop lag max {late * 1000:8.1f} ms, export took {took:6.2f} s")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "ipc-peer":
        _peer(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "docker-engine":
        _stub_engine(sys.argv[2])
        return
    if len(sys.argv) > 1 and sys.argv[1] == "docker-client":
        _docker_client(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "otlp-sink":
        _otlp_sink(float(sys.argv[2]), int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "etcd-client":
        _etcd_client(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("ipc")
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--upstreams", type=int, default=100)
    p = sub.add_parser("procfs")
    p.add_argument("--repeat", type=int, default=5)
    p = sub.add_parser("etcd")
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--calls", type=int, default=300)
    p = sub.add_parser("docker")
    p.add_argument("--repeat", type=int, default=6)
    p.add_argument("--calls", type=int, default=300)
    p = sub.add_parser("scrape")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--histograms", type=int, default=40)
    p = sub.add_parser("otlp")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--spans", type=int, default=20480)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--timeout", type=float, default=5.0)
    p = sub.add_parser("imports")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("modules", nargs="*")
    args = parser.parse_args()
    run = {
        "ipc": ipc_bench,
        "procfs": procfs_bench,
        "docker": docker_bench,
        "etcd": etcd_bench,
        "imports": imports_bench,
        "scrape": scrape_bench,
        "otlp": otlp_bench,
    }
    run[args.what](args)


if __name__ == "__main__":
    main()
