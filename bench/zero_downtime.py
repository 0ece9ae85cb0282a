"""The zero-downtime harness: rollouts and faults under continuous load, every request counted.

    .venv/bin/python bench/zero_downtime.py [--scenario N ...] [--duration S] [--concurrency C]
                                            [--workers N] [--backend process|docker]
                                            [--docker-host URL] [--image BASE] [--keep-image]

Each scenario starts the real gateway as a process of its own (``python -m controller.main
serve``: process backend, traffic and admin listeners on free loopback ports, a temporary
state directory, an admin token), drives it through the admin API, runs replicas of
``bench/replica_app.py`` (which say which revision and replica answered, and take
``startup_delay`` seconds to start) and keeps ``bench/loadgen.py`` busy against it: short
requests, slow requests, SSE streams and uploads on kept-alive and fresh connections, and a
few WebSockets that echo a message every 100 ms. Every request's outcome is recorded.

Scenarios (issue 6):

1. rolling update of 4 replicas r1 -> r2, 2 s start-up;
2. the same with ``max_surge: 2`` (2a), and with ``max_unavailable: 1`` (2b);
3. a new revision that exits at once (3a), never passes its probe (3b), passes and crashes
   after 3 s (3c): each rollout fails and is rolled back, revision 1 serves throughout;
4. capacity exhausted: a scale-up (4a) and a new revision (4b) that cannot be placed;
5. SIGKILL of a serving replica every few seconds while traffic flows;
6. an apply that supersedes a rollout in progress (6a), an undo in the middle of one (6b);
7. a slow request and an SSE stream in flight on an old replica when its drain starts
   complete; a WebSocket open past ``drain_timeout`` is closed with 1001 (expected);
8. SIGTERM to the gateway process with requests in flight: they complete, it exits 0;
9. a canary r1 -> r2 at 20 % then 50 % (analysed), then 100 %: the share of requests r2
   answered at each step, within 4 binomial standard deviations + 2 points (issue 27);
10. blue/green r1 -> r2: no traffic to r2 before ``rollout promote``, then all of it, then
    ``rollout undo`` takes all traffic back to r1 with nothing started;
11. a gRPC service (``upstream_protocol: http2``, replicas of ``tests/e2e/grpc_replica.py``,
    the gRPC health probe) rolled r1 -> r2 under grpcio clients (``GrpcLoad``): unary calls
    back to back and server-streaming calls held open across the drains, which must wait
    for them (issue 55). Process backend only.

``--workers N`` runs every scenario against a gateway with N worker processes (its results
go to a section of their own).

``--backend docker`` runs the replicas as containers of one Docker Engine (``--docker-host``,
default ``$DOCKER_HOST`` or the local socket), configured as two hosts ``a`` and ``b`` with a
port range and half the capacity each, ports published on 127.0.0.1 only. The replica app
needs aiohttp: once per run an image is built (``docker build`` through the CLI) FROM
``--image`` (a base with Python 3.11 at ``python3``, no registry needed) with the app and
aiohttp's distributions copied from this interpreter's site-packages, tagged by the digest of
what went into it, and removed at the end unless ``--keep-image`` (or it was there before).
Scenario 5 kills a container through the engine (SIGKILL, found by its ``gateway.instance``
and ``gateway.replica`` labels); every container with the gateway's instance label is removed
at the end. Its results go to a section of their own.

A request failed when it got a non-2xx answer the replica did not produce itself, a
connection error, a timeout, a short or wrong body, a broken SSE stream, a wrong or missing
WebSocket echo, or a WebSocket closed under it (1001 too, except where scenarios 7 and 8 say
it is the expected behaviour). Failures of streams, uploads and WebSockets that were in
flight on a replica at the moment it crashed or was SIGKILLed are reported as such in the
notes: they still count as failed.

Each scenario is bounded (every wait has a deadline), stops by itself and, in a ``finally``,
stops the gateway (SIGTERM, then SIGKILL of its process group) and SIGKILLs the process group
of any replica still alive (replicas write ``<id>.pid`` into the scenario's directory; a pid
is signalled only while ``/proc`` shows it is that replica), or removes any container left
with its instance label. The table goes to stdout and, when every scenario ran (or with
``--results yes``), to the marked section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import importlib.metadata
import json
import os
import platform
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.loadgen import KiB, LoadGen, LoadMix, MiB, Outcome, Summary, summarize  # noqa: E402
from controller.backends.docker import EngineClient, EngineError  # noqa: E402

APP = ROOT / "bench" / "replica_app.py"
GRPC_APP = ROOT / "tests" / "e2e" / "grpc_replica.py"
GRPC_TICKS = 20
"""Scenario 11: the answers of each held server stream."""
RESULTS = ROOT / "bench" / "RESULTS.md"
START_MARK = "<!-- zero-downtime:start -->"
END_MARK = "<!-- zero-downtime:end -->"
SERVICE = "web"
LIVE = frozenset({"requested", "starting", "ready", "unhealthy"})
LEAVING = frozenset({"draining", "stopping"})
WALL_OFFSET = time.time() - time.monotonic()
"""Journal times are wall-clock; outcomes are monotonic."""
DEFAULT_BASE_IMAGE = "local/bookworm-python:test"
"""A Debian minbase with python3 (what ``.ci/run`` imports): no registry needed."""
IMAGE_REPOSITORY = "local/zero-downtime-replica"
IMAGE_APP_DIR = "/replica"
"""Where the image holds the replica app, its libraries under ``site``."""
DOCKER_HOSTS = ("a", "b")
LABEL_REPLICA = "gateway.replica"
CRASHED_AT = re.compile(r"crashing on purpose \(CRASH_AFTER\) at (\d+\.\d+)")
"""The last line of a replica app that crashed on purpose (``replica_app._crash``)."""


@dataclass(frozen=True)
class Profile:
    """Timings and sizes of one run of the scenarios (``FULL``, or ``SHORT`` for CI)."""

    replicas: int = 4
    startup_delay: float = 2.0
    probe_interval: float = 0.2
    start_timeout: float = 10.0
    drain_timeout: float = 10.0
    retries: int = 2
    """Failed target replicas replaced before a rollout fails."""
    retry_backoff: float = 0.3
    bad_start_timeout: float = 4.0
    """3b: how long a replica that never passes its probe gets."""
    crash_after: float = 3.0
    """3c: seconds after binding."""
    crash_min_ready: float | None = None
    """3c: ``min_ready`` of the crashing revision. None (the default strategy): the crashes
    must come before the rollout can complete, which 4 replicas with 2 s start-ups ensure;
    a short run (2 fast replicas) could complete it first, so it holds new replicas back."""
    warmup: float = 2.0
    """Load before the action of a scenario."""
    settle: float = 2.0
    """Load after its outcome."""
    hold: float = 8.0
    """4a: how long the unplaceable scale-up is held under load."""
    kill_every: float = 3.0
    kill_for: float = 20.0
    """5: how long replicas are SIGKILLed."""
    held_drain_timeout: float = 8.0
    """7: the drain timeout the held WebSocket outlasts."""
    held_seconds: float = 6.0
    """7: the slow request and the SSE stream held across the drain."""
    shutdown_timeout: float = 10.0
    """8: the gateway's ``proxy.shutdown_timeout``."""
    workers: int = 1
    """The gateway's ``workers``: processes serving traffic (``--workers``)."""
    deadline: float = 90.0
    """The longest any one wait may take."""
    mix: LoadMix = field(default_factory=LoadMix)
    crash_mix: LoadMix | None = None
    """3c with only requests a proxy can replay (CI: it must end with no failure); None: the
    full mix, whose streams in flight on the crashing replica are lost (and reported)."""


FULL = Profile()
SHORT = Profile(
    replicas=2,
    startup_delay=0.2,
    probe_interval=0.1,
    start_timeout=5.0,
    drain_timeout=5.0,
    retries=0,
    retry_backoff=0.1,
    bad_start_timeout=0.6,
    crash_after=0.5,
    crash_min_ready=1.0,
    warmup=0.15,
    settle=0.15,
    hold=1.0,
    kill_every=1.0,
    kill_for=3.0,
    held_drain_timeout=2.0,
    held_seconds=1.5,
    shutdown_timeout=5.0,
    deadline=20.0,
    mix=LoadMix(
        concurrency=8,
        websockets=2,
        slow=(0.1, 0.4),
        sse_events=(3, 6),
        sse_interval=0.05,
        upload=(64 * KiB, 512 * KiB),
        ws_session=(0.2, 0.5),
        timeout=15.0,
    ),
    crash_mix=LoadMix(
        concurrency=8,
        websockets=0,
        slow=(0.1, 0.4),
        long_weights=(1.0, 0.0, 0.0),
        timeout=15.0,
    ),
)


# -- processes --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def replica_process(pid: int, piddir: Path) -> bool:
    """``pid`` is alive (not a zombie) and is a replica (the app, or the gRPC replica) that
    writes into ``piddir``."""
    proc = Path(f"/proc/{pid}")
    try:
        stat = (proc / "stat").read_bytes()
        cmdline = (proc / "cmdline").read_bytes()
        environ = (proc / "environ").read_bytes()
    except OSError:
        return False
    if stat[stat.rindex(b")") + 2 :].split()[0] in (b"Z", b"X"):
        return False
    ours = f"PIDDIR={piddir}".encode() in environ.split(b"\0")
    return ours and any(app.name.encode() in cmdline for app in (APP, GRPC_APP))


# -- replicas as containers ------------------------------------------------------------------


@dataclass(frozen=True)
class Docker:
    """The Docker backend of a run: the engine the hosts name, and the replica app's image."""

    engine: str
    image: str
    base: str
    libraries: tuple[str, ...]
    """``name version`` of each distribution copied into the image."""
    version: str = "unknown"
    """The engine's."""


def docker_cli(
    engine: str, *args: str, timeout: float = 60.0, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DOCKER_HOST": engine, "DOCKER_BUILDKIT": "0"}
    done = subprocess.run(
        ["docker", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])}: {done.stderr.strip() or done.stdout}")
    return done


def replica_libraries(top: str = "aiohttp") -> list[importlib.metadata.Distribution]:
    """``top`` and what it requires on this interpreter (no extras), as installed here."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found: dict[str, importlib.metadata.Distribution] = {}
    todo = [top]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        dist = importlib.metadata.distribution(name)
        found[name] = dist
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return [found[name] for name in sorted(found)]


def build_replica_image(engine: str, base: str, workdir: Path) -> tuple[Docker, bool]:
    """The replica app's image FROM ``base``; returns it and whether it was there before.

    The app is not stdlib-only (aiohttp), and a minbase has no pip: aiohttp and its
    requirements are copied from this interpreter's site-packages (manylinux wheels, cp311),
    so the build needs no network, and checks the base's ``python3`` is this minor version
    and imports them. The tag is the digest of the base's id, the Dockerfile, the app and
    the libraries' versions.
    """
    found = docker_cli(engine, "image", "inspect", "--format", "{{.Id}}", base, check=False)
    if found.returncode != 0:
        raise RuntimeError(f"the base image {base} is not on {engine}: {found.stderr.strip()}")
    context = workdir / "image"
    site = context / "site"
    site.mkdir(parents=True)
    dists = replica_libraries()
    for dist in dists:
        for file in dist.files or []:
            if file.parts[0] == ".." or "__pycache__" in file.parts:
                continue
            target = site / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(str(dist.locate_file(file))), target)
    shutil.copyfile(APP, context / APP.name)
    check = (
        f"import sys; assert sys.version_info[:2] == {tuple(sys.version_info[:2])}, "
        "'python3 is ' + sys.version.split()[0] + ', the libraries are for another minor'; "
        "import aiohttp"
    )
    dockerfile = "\n".join(
        [
            f"FROM {base}",
            f"COPY site {IMAGE_APP_DIR}/site",
            f"COPY {APP.name} {IMAGE_APP_DIR}/{APP.name}",
            f"ENV PYTHONPATH={IMAGE_APP_DIR}/site PYTHONUNBUFFERED=1",
            f'RUN python3 -c "{check}" && python3 -m compileall -q {IMAGE_APP_DIR}',
            "",
        ]
    )
    (context / "Dockerfile").write_text(dockerfile)
    libraries = tuple(f"{d.metadata['Name']} {d.version}" for d in dists)
    digest = hashlib.sha256()
    for part in (found.stdout.strip(), dockerfile, APP.read_text(), *libraries):
        digest.update(part.encode() + b"\0")
    tag = f"{IMAGE_REPOSITORY}:{digest.hexdigest()[:12]}"
    existed = docker_cli(engine, "image", "inspect", tag, check=False).returncode == 0
    if not existed:
        docker_cli(engine, "build", "--quiet", "--tag", tag, str(context), timeout=300)
    version = docker_cli(engine, "version", "--format", "{{.Server.Version}}").stdout.strip()
    return Docker(engine, tag, base, libraries, version), existed


def remove_containers_cli(engine: str, instance: str) -> int:
    """Force-remove every container labelled with ``instance`` (the last resort of a run)."""
    found = docker_cli(
        engine, "ps", "--all", "--quiet", "--filter", f"label=gateway.instance={instance}"
    ).stdout.split()
    if found:
        docker_cli(engine, "rm", "--force", *found)
    return len(found)


class AdminError(Exception):
    pass


@dataclass
class Track:
    """Samples of the service while something happens: ready and running replicas."""

    samples: list[tuple[float, int, int, dict[int, int]]] = field(default_factory=list)
    serving: set[int] = field(default_factory=set)
    """Every revision the controller called serving meanwhile."""

    def add(self, view: dict[str, Any]) -> None:
        if view["serving_revision"] is not None:
            self.serving.add(view["serving_revision"])
        ready: dict[int, int] = {}
        running = 0
        for r in view["replicas"]:
            if r["state"] == "ready":
                ready[r["revision"]] = ready.get(r["revision"], 0) + 1
            if r["state"] in LIVE or r["state"] in LEAVING:
                running += 1
        self.samples.append((time.monotonic(), sum(ready.values()), running, ready))

    @property
    def min_ready(self) -> int:
        return min((s[1] for s in self.samples), default=0)

    @property
    def max_running(self) -> int:
        return max((s[2] for s in self.samples), default=0)

    def min_ready_of(self, revision: int) -> int:
        return min((s[3].get(revision, 0) for s in self.samples), default=0)


class Gateway:
    """The gateway as a process of its own, its admin API, and the replicas it started
    (processes, or containers with ``docker``)."""

    def __init__(
        self,
        workdir: Path,
        *,
        capacity: int | None = 16,
        shutdown_timeout: float = 10.0,
        workers: int = 1,
        docker: Docker | None = None,
    ) -> None:
        self.dir = workdir
        self.workers = workers
        self.docker = docker
        self.engine = EngineClient(docker.engine) if docker is not None else None
        self.instance: str | None = None
        """The gateway's instance id: the label of its containers."""
        self.deaths: dict[str, float] = {}
        """Replica id -> monotonic time of its container's ``die`` event: when it ended, by the
        engine (the controller hears of it only once the container was removed)."""
        self.piddir = workdir / "pids"
        self.piddir.mkdir(parents=True)
        self.capacity = capacity
        self.shutdown_timeout = shutdown_timeout
        self.port = free_port()
        self.admin_port = free_port()
        base = 26000 + random.randrange(80) * 25
        self.port_range = f"{base}-{base + 24}"
        # Apart from the process ranges (26000-27999) and tests/e2e/test_docker.py's.
        self.docker_base = 28000 + random.randrange(40) * 50
        self.token = secrets.token_urlsafe(24)
        self.process: asyncio.subprocess.Process | None = None
        self.session: aiohttp.ClientSession | None = None
        self.views: dict[str, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self.tracks: list[Track] = []
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def log_path(self) -> Path:
        return self.dir / "gateway.log"

    def config(self) -> dict[str, Any]:
        backends: dict[str, Any] = {
            "process": {"capacity": self.capacity, "port_range": self.port_range}
        }
        if self.docker is not None:
            backends["docker"] = {"hosts": self.docker_hosts()}
        return {
            "listen": f"127.0.0.1:{self.port}",
            "admin": {"listen": f"127.0.0.1:{self.admin_port}", "token_env": "GATEWAY_ADMIN_TOKEN"},
            "state_dir": str(self.dir / "state"),
            "backends": backends,
            "proxy": {"shutdown_timeout": self.shutdown_timeout},
            "access_log": {"enabled": False},
            "replicas_on_exit": "stop",
            "log_level": "info",
            "workers": self.workers,
        }

    def docker_hosts(self) -> list[dict[str, Any]]:
        """Two hosts on the one engine, as tests/e2e/test_docker.py has them: the capacity
        split between them, 20 ports each, published on 127.0.0.1."""
        assert self.docker is not None
        total = 16 if self.capacity is None else self.capacity
        n = len(DOCKER_HOSTS)
        hosts = []
        for i, name in enumerate(DOCKER_HOSTS):
            first = self.docker_base + 20 * i
            hosts.append(
                {
                    "name": name,
                    "engine": self.docker.engine,
                    "address": "127.0.0.1",
                    "capacity": {"replicas": total // n + (i < total % n)},
                    "port_range": f"{first}-{first + 19}",
                }
            )
        return hosts

    async def start(self) -> None:
        path = self.dir / "gateway.json"
        path.write_text(json.dumps(self.config(), indent=2))
        env = {**os.environ, "GATEWAY_ADMIN_TOKEN": self.token, "PYTHONPATH": str(ROOT)}
        with open(self.log_path, "wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "controller.main",
                "serve",
                "-c",
                str(path),
                cwd=ROOT,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        self.session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=aiohttp.ClientTimeout(total=10),
        )
        deadline = time.monotonic() + 20
        while True:
            if self.process.returncode is not None:
                raise RuntimeError(f"the gateway exited at start-up:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with self.session.get(f"{self.admin_url}/readyz") as response:
                    if response.status == 200:
                        break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway was not ready within 20 s:\n{self.log_tail()}")
            await asyncio.sleep(0.05)
        if self.docker is not None:
            self.instance = (self.dir / "state" / "instance-id").read_text().strip()
        self._tasks = [asyncio.create_task(self._poll()), asyncio.create_task(self._follow())]
        if self.docker is not None:
            self._tasks.append(asyncio.create_task(self._watch_engine()))

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # -- the admin API ------------------------------------------------------------------------

    async def call(self, method: str, path: str, body: Any = None) -> Any:
        assert self.session is not None
        async with self.session.request(method, self.admin_url + path, json=body) as response:
            data = await response.json(content_type=None)
            if response.status >= 300:
                raise AdminError(f"{method} {path}: {response.status} {data}")
            return data

    async def apply(self, spec: dict[str, Any]) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("PUT", f"/api/services/{spec['name']}", spec)
        return result

    async def scale(self, replicas: int, name: str = SERVICE) -> dict[str, Any]:
        result: dict[str, Any] = await self.call(
            "POST", f"/api/services/{name}/scale", {"replicas": replicas}
        )
        return result

    async def undo(self, name: str = SERVICE) -> dict[str, Any]:
        result: dict[str, Any] = await self.call("POST", f"/api/services/{name}/rollout/undo", {})
        return result

    async def rollouts(self, name: str = SERVICE) -> list[dict[str, Any]]:
        data = await self.call("GET", f"/api/services/{name}/rollouts")
        rows: list[dict[str, Any]] = data["rollouts"]
        return rows

    async def last_rollout_id(self, name: str = SERVICE) -> int:
        return max((r["id"] for r in await self.rollouts(name)), default=0)

    async def rollouts_since(self, rollout_id: int, name: str = SERVICE) -> list[dict[str, Any]]:
        return sorted((r for r in await self.rollouts(name) if r["id"] > rollout_id),
                      key=lambda r: r["id"])  # fmt: skip

    async def _poll(self) -> None:
        """The services' views every 100 ms, into ``views`` and every active ``Track``."""
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AdminError):
                data = await self.call("GET", "/api/services")
                self.views = {v["name"]: v for v in data["services"]}
                view = self.views.get(SERVICE)
                if view is not None:
                    for track in self.tracks:
                        track.add(view)
            await asyncio.sleep(0.1)

    async def _follow(self) -> None:
        """The journal as server-sent events, into ``events`` (with a monotonic ``mono``)."""
        assert self.session is not None
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                async with self.session.get(
                    f"{self.admin_url}/api/events", timeout=aiohttp.ClientTimeout(total=None)
                ) as response:
                    async for raw in response.content:
                        line = raw.decode(errors="replace").rstrip("\n")
                        if line.startswith("data: "):
                            event = json.loads(line[6:])
                            event["mono"] = event["at"] - WALL_OFFSET
                            self.events.append(event)
            await asyncio.sleep(0.2)

    async def _watch_engine(self) -> None:
        """The engine's ``die`` events of this instance's containers, into ``deaths``."""
        assert self.engine is not None
        assert self.instance is not None
        while True:
            with contextlib.suppress(EngineError):
                stream = await self.engine.events({"gateway.instance": self.instance}, None)
                try:
                    async for event in stream:
                        replica = event.get("Actor", {}).get("Attributes", {}).get(LABEL_REPLICA)
                        if event.get("Action") == "die" and replica:
                            self.deaths[replica] = event["timeNano"] / 1e9 - WALL_OFFSET
                finally:
                    stream.close()
            await asyncio.sleep(0.2)

    def exit_lag(self, replicas: Iterable[str], since: float) -> str:
        """How long after its container's ``die`` event the journal said each of ``replicas``
        failed (the docker backend reads the logs and removes the container first)."""
        failed = {e["replica"]: e["mono"] for e in self.events_of("replica_failed", since)}
        lags = [failed[r] - self.deaths[r] for r in replicas if r in failed and r in self.deaths]
        if not lags:
            return ""
        return (
            f"the controller reported each exit {min(lags) * 1000:.0f}-{max(lags) * 1000:.0f} ms "
            "after the engine's die event"
        )

    def view(self, name: str = SERVICE) -> dict[str, Any] | None:
        return self.views.get(name)

    async def fresh_view(self, name: str = SERVICE) -> dict[str, Any]:
        view: dict[str, Any] = await self.call("GET", f"/api/services/{name}")
        return view

    async def wait(
        self,
        predicate: Callable[[dict[str, Any]], bool],
        timeout: float,
        what: str,
        name: str = SERVICE,
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, AdminError):
                view = await self.fresh_view(name)
                if predicate(view):
                    return view
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            await asyncio.sleep(0.05)

    @contextlib.contextmanager
    def track(self) -> Iterator[Track]:
        track = Track()
        self.tracks.append(track)
        try:
            yield track
        finally:
            self.tracks.remove(track)

    def pid(self, replica_id: str) -> int | None:
        try:
            return int((self.piddir / f"{replica_id}.pid").read_text())
        except (OSError, ValueError):
            return None

    def replica_pids(self) -> list[int]:
        pids = []
        for path in self.piddir.glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(path.read_text()))
        return pids

    async def containers(self, **labels: str) -> list[dict[str, Any]]:
        """The engine's containers with this gateway's instance label (and ``labels``)."""
        assert self.engine is not None
        assert self.instance is not None
        return await self.engine.containers(
            {"gateway.instance": self.instance, **{f"gateway.{k}": v for k, v in labels.items()}}
        )

    async def victims(self, replicas: list[dict[str, Any]]) -> list[tuple[str, int | str]]:
        """Those of ``replicas`` that can be killed now, each with its pid or container id."""
        if self.docker is None:
            return [
                (r["id"], pid)
                for r in replicas
                if (pid := self.pid(r["id"])) and replica_process(pid, self.piddir)
            ]
        running = {
            c["Labels"][LABEL_REPLICA]: c["Id"]
            for c in await self.containers(service=SERVICE)
            if c["State"] == "running"
        }
        return [(r["id"], running[r["id"]]) for r in replicas if r["id"] in running]

    async def kill(self, victim: int | str) -> None:
        """SIGKILL a replica: its process, or its container through the engine."""
        if isinstance(victim, int):
            os.kill(victim, signal.SIGKILL)
        else:
            assert self.engine is not None
            await self.engine.kill(victim, "SIGKILL")

    def events_of(self, kind: str, since: float = 0.0) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind and e["mono"] >= since]

    # -- the end --------------------------------------------------------------------------

    def stop_watching(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    async def close(self) -> list[int | str]:
        """Stop the gateway and end every replica left; returns the pids (or container
        names) that were left."""
        self.stop_watching()
        process = self.process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), self.shutdown_timeout + 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        # With replicas_on_exit: stop, the gateway stopped its replicas before it exited.
        left: list[int | str] = []
        if self.docker is not None:
            left += await self._remove_containers()
        deadline = time.monotonic() + 3
        pids = [p for p in self.replica_pids() if replica_process(p, self.piddir)]
        while pids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            pids = [p for p in pids if replica_process(p, self.piddir)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each replica leads a process group of its own
        if self.session is not None:
            await self.session.close()
            self.session = None
        return [*left, *pids]

    async def _remove_containers(self) -> list[int | str]:
        """Force-remove the containers of this instance still there 3 s after the gateway
        exited (it removes those it stopped); returns their names."""
        assert self.engine is not None
        if self.instance is None:
            await self.engine.close()
            return []
        deadline = time.monotonic() + 3
        left: list[dict[str, Any]] = []
        try:
            while True:
                left = await self.containers()
                if not left or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            for container in left:
                await self.engine.remove(container["Id"])
        except EngineError:
            # The engine does not answer: the run's last resort (the CLI) tries again.
            return [f"instance {self.instance} (engine error)"]
        finally:
            await self.engine.close()
        return [c["Names"][0].lstrip("/") for c in left]


# -- specs and states -------------------------------------------------------------------------


def make_spec(
    p: Profile,
    gw: Gateway,
    version: str,
    *,
    replicas: int | None = None,
    env: dict[str, str] | None = None,
    **rollout: Any,
) -> dict[str, Any]:
    """The service spec of one revision of the replica app (``version`` makes it distinct):
    a process, or a container of the run's image (``backend: docker``)."""
    variables = {"VERSION": version, "STARTUP_DELAY": f"{p.startup_delay:g}", **(env or {})}
    replica: dict[str, Any]
    if gw.docker is None:
        command = f"{shlex.quote(sys.executable)} {shlex.quote(str(APP))}"
        replica = {"commands": [command], "env": {**variables, "PIDDIR": str(gw.piddir)}}
    else:
        command = f"python3 {IMAGE_APP_DIR}/{APP.name}"  # on $HOST:$PORT, the backend's
        replica = {"image": gw.docker.image, "commands": [command], "env": variables}
    return {
        "name": SERVICE,
        **({"backend": "docker"} if gw.docker is not None else {}),
        "route": {"path_prefix": "/"},
        "replicas": p.replicas if replicas is None else replicas,
        "replica": replica,
        "probes": [
            {
                "type": "http",
                "path": "/healthz",
                "interval": p.probe_interval,
                "timeout": 1.0,
                "healthy_threshold": 2,
                "unhealthy_threshold": 3,
            }
        ],
        "retries": {"attempts": 2},
        "rollout": {
            "retry_backoff": p.retry_backoff,
            "max_retry_backoff": 2.0,
            "start_timeout": p.start_timeout,
            "drain_timeout": p.drain_timeout,
            "stop_grace": 2.0,
            "retries": p.retries,
        }
        | rollout,
    }


def crashed_at(event: dict[str, Any]) -> float:
    """When a replica that crashed on purpose died: the moment its last line names (in the
    journal's reason), else when the journal heard of it (later on docker: the container is
    removed first)."""
    found = CRASHED_AT.search(event["message"])
    return float(found[1]) - WALL_OFFSET if found else float(event["mono"])


def live(view: dict[str, Any], revision: int | None = None) -> list[dict[str, Any]]:
    return [
        r
        for r in view["replicas"]
        if r["state"] in LIVE and (revision is None or r["revision"] == revision)
    ]


def ready(view: dict[str, Any], revision: int | None = None) -> list[dict[str, Any]]:
    return [r for r in live(view, revision) if r["state"] == "ready"]


def settled(view: dict[str, Any], revision: int, replicas: int) -> bool:
    """No rollout; ``replicas`` ready replicas of ``revision``, nothing else running."""
    if view["rollout"] is not None:
        return False
    if view["serving_revision"] != revision or view["target_revision"] != revision:
        return False
    if any(r["state"] in LEAVING for r in view["replicas"]):
        return False
    running = live(view)
    return len(running) == replicas and len(ready(view, revision)) == replicas


def describe_rollouts(rows: list[dict[str, Any]]) -> str:
    parts = []
    for r in rows:
        end = r["finished_at"] if r["finished_at"] is not None else time.time()
        text = (
            f"{r['kind']} r{r['from_revision']}→r{r['to_revision']} {r['status']} "
            f"in {end - r['started_at']:.1f} s"
        )
        if r["status"] == "failed" and r["reason"]:
            text += f" ({r['reason']})"
        parts.append(text)
    return "; ".join(parts) or "no rollout"


# -- rows -------------------------------------------------------------------------------------


@dataclass
class Row:
    """One scenario (or part of one): its load's outcomes and what the harness saw."""

    key: str
    title: str
    started: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    rollout: str = "-"
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """Checks that did not hold (other than failed requests)."""
    crashes: list[tuple[float, str]] = field(default_factory=list)
    """(monotonic time, replica id) of each replica that crashed or was killed."""
    expected: Callable[[Outcome], bool] | None = None
    """Failed outcomes that are the scenario's expected behaviour (a 1001 close)."""
    expected_note: str = ""
    summary: Summary = field(default_factory=Summary)

    def check(self, condition: object, what: str) -> bool:
        if not condition:
            self.problems.append(what)
        return bool(condition)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def finish(self, outcomes: list[Outcome]) -> None:
        self.outcomes = list(outcomes)
        self.summary = summarize(self.outcomes, self.expected)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed and not (self.expected and self.expected(o))]

    def on_crashed(self, o: Outcome) -> bool:
        """In flight on a replica at the moment it crashed or was killed."""
        for at, replica in self.crashes:
            if o.start <= at <= o.end + 0.05 and o.end <= at + 3.0:
                if o.replica is None or o.replica == replica:
                    return True
        return False

    @property
    def passed(self) -> bool:
        return not self.failures and not self.problems

    def failure_note(self) -> str:
        failures = self.failures
        if not failures:
            return ""
        kinds = ", ".join(
            f"{k} {n}" for k, n in sorted(self.summary.failed_by_kind.items(), key=lambda x: -x[1])
        )
        text = f"failed: {kinds}"
        if self.crashes:
            crashed = sum(1 for o in failures if self.on_crashed(o))
            other = len(failures) - crashed
            text += (
                f"; {crashed} of {len(failures)} were in flight on a replica at the moment it "
                f"died, {other} other"
            )
        return text


class Ctx:
    """What the scenarios share: the profile, a work directory, the gateways they start."""

    def __init__(
        self, profile: Profile, workroot: Path, verbose: bool = True, docker: Docker | None = None
    ) -> None:
        self.profile = profile
        self.workroot = workroot
        self.verbose = verbose
        self.docker = docker
        self.rows: list[Row] = []
        self._count = 0

    def log(self, text: str) -> None:
        if self.verbose:
            print(f"  {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)

    def row(self, key: str, title: str) -> Row:
        row = Row(key, title)
        self.rows.append(row)
        self.log(f"[{key}] {title}")
        return row

    @contextlib.asynccontextmanager
    async def gateway(self, **kwargs: Any) -> AsyncIterator[Gateway]:
        self._count += 1
        kwargs.setdefault("workers", self.profile.workers)
        kwargs.setdefault("docker", self.docker)
        gw = Gateway(self.workroot / f"gateway-{self._count}", **kwargs)
        first = len(self.rows)
        try:
            await gw.start()
            yield gw
        except BaseException:
            self.log(f"gateway log tail:\n{gw.log_tail()}")
            raise
        finally:
            left = await gw.close()
            if left:
                problem = f"replicas left running after the gateway exited: {left}"
                for row in self.rows[first:] or self.rows[-1:]:
                    row.problems.append(problem)

    @contextlib.asynccontextmanager
    async def loaded(
        self, gw: Gateway, row: Row, mix: LoadMix | None = None, settle: bool = True
    ) -> AsyncIterator[LoadGen]:
        """Load on the gateway while the block runs (after a warm-up, and a settle after)."""
        p = self.profile
        load = LoadGen(gw.url, mix or p.mix, seed=sum(map(ord, row.key)), limit=p.deadline * 4)
        await load.start()
        row.started = time.monotonic()
        try:
            await asyncio.sleep(p.warmup)
            yield load
            if settle:
                await asyncio.sleep(p.settle)
        finally:
            await load.stop()
            row.finish(load.outcomes)
            s = row.summary
            self.log(f"[{row.key}] {s.requests} requests, {s.failed} failed")


async def serve(ctx: Ctx, gw: Gateway, spec: dict[str, Any], revision: int = 1) -> dict[str, Any]:
    """Apply ``spec`` and wait until it serves at full strength."""
    await gw.apply(spec)
    return await gw.wait(
        lambda v: settled(v, revision, spec["replicas"]),
        ctx.profile.deadline,
        f"revision {revision} to serve with {spec['replicas']} replicas",
    )


def only_revision_after(row: Row, at: float, revision: int) -> None:
    after = [o for o in row.outcomes if o.kind == "short" and not o.failed and o.start > at + 0.05]
    seen = sorted({o.revision for o in after if o.revision is not None})
    row.check(
        after and seen == [revision],
        f"after the rollout, short requests answered by revisions {seen}, not only r{revision}",
    )


# -- scenarios 1 and 2: rolling updates ---------------------------------------------------------


async def rolling(
    ctx: Ctx, gw: Gateway, key: str, title: str, version: str, revision: int, **strategy: Any
) -> Row:
    p = ctx.profile
    row = ctx.row(key, title)
    floor = p.replicas - strategy.get("max_unavailable", 0)
    ceiling = p.replicas + strategy.get("max_surge", 1)
    before = await gw.last_rollout_id()
    with gw.track() as track:
        async with ctx.loaded(gw, row):
            result = await gw.apply(make_spec(p, gw, version, **strategy))
            row.check(
                (result["action"], result["revision"]) == ("rollout", revision),
                f"apply answered {result['action']} revision {result['revision']}",
            )
            await gw.wait(
                lambda v: settled(v, revision, p.replicas),
                p.deadline,
                f"{p.replicas} ready replicas of revision {revision} only",
            )
            done = time.monotonic()
    rollouts = await gw.rollouts_since(before)
    row.rollout = describe_rollouts(rollouts)
    row.check(
        [r["status"] for r in rollouts] == ["complete"], f"rollouts: {row.rollout} (not complete)"
    )
    row.check(track.min_ready >= floor, f"ready replicas fell to {track.min_ready} (floor {floor})")
    row.check(
        track.max_running <= ceiling,
        f"{track.max_running} replicas running at once (ceiling {ceiling})",
    )
    row.note(
        f"ready ≥ {track.min_ready} throughout (floor {floor}); at most {track.max_running} "
        f"replicas running (ceiling {ceiling})"
    )
    only_revision_after(row, done, revision)
    return row


async def scenario_1(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        title = f"rolling update of {p.replicas} replicas r1→r2, {p.startup_delay:g} s start-up"
        await rolling(ctx, gw, "1", title, "v2", 2)


async def scenario_2(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        await rolling(ctx, gw, "2a", "the same, max_surge 2 (r1→r2)", "v2", 2, max_surge=2)
        await rolling(
            ctx, gw, "2b", "the same, max_unavailable 1 (r2→r3)", "v3", 3, max_unavailable=1
        )


# -- scenarios 3 and 4: rollouts that fail ------------------------------------------------------


async def failing_rollout(
    ctx: Ctx,
    gw: Gateway,
    key: str,
    title: str,
    version: str,
    revision: int,
    *,
    env: dict[str, str] | None = None,
    untouched: bool = True,
    crash: bool = False,
    mix: LoadMix | None = None,
    **strategy: Any,
) -> Row:
    """Apply a revision that cannot serve; it must fail, roll back, and r1 serve throughout."""
    p = ctx.profile
    row = ctx.row(key, title)
    view = await gw.fresh_view()
    serving = view["serving_revision"]
    before_ids = {r["id"] for r in ready(view, serving)}
    before = await gw.last_rollout_id()
    with gw.track() as track:
        async with ctx.loaded(gw, row, mix=mix):
            since = time.monotonic()
            result = await gw.apply(make_spec(p, gw, version, env=env, **strategy))
            row.check(
                (result["action"], result["revision"]) == ("rollout", revision),
                f"apply answered {result['action']} revision {result['revision']}",
            )
            await gw.wait(
                lambda v: v["target_revision"] == serving and settled(v, serving, p.replicas),
                p.deadline,
                f"the rollback to revision {serving} to complete",
            )
    if crash:
        row.crashes = [
            (crashed_at(e), e["replica"])
            for e in gw.events_of("replica_failed", since)
            if e["revision"] == revision and "exited" in e["message"]
        ]
    rollouts = await gw.rollouts_since(before)
    row.rollout = describe_rollouts(rollouts)
    statuses = [(r["kind"], r["to_revision"], r["status"]) for r in rollouts]
    row.check(
        statuses == [("rollout", revision, "failed"), ("rollback", serving, "complete")],
        f"rollouts were {statuses}",
    )
    low = track.min_ready_of(serving)
    if crash:
        # The rollout moves on while new replicas are up (old ones drained for them), then
        # those crash, each taking one replica away: only "never none" is the controller's.
        row.note(f"ready ≥ {track.min_ready} throughout (r{serving} ≥ {low})")
        row.check(track.min_ready >= 1, "no replica was ready at some point")
        reclaimed = gw.events_of("replica_undrained", since)
        if reclaimed:
            row.note(f"the rollback took back {len(reclaimed)} draining r{serving} replicas")
    else:
        row.note(f"ready r{serving} replicas ≥ {low} throughout")
        row.check(low >= p.replicas, f"ready r{serving} replicas fell to {low}")
    row.check(track.serving == {serving}, f"the serving revision was {sorted(track.serving)}")
    after = await gw.fresh_view()
    if untouched:
        row.check(
            {r["id"] for r in ready(after, serving)} == before_ids,
            f"the r{serving} replicas were not left alone",
        )
        row.note(f"the {len(before_ids)} r{serving} replicas were left untouched")
    failed = [e for e in gw.events_of("replica_failed", since) if e["revision"] == revision]
    if failed:
        row.note(f"{len(failed)} r{revision} replica failures: {failed[-1]['message'][-70:]}")
    if crash and row.crashes:
        row.note(f"{len(row.crashes)} r{revision} replicas crashed while serving")
        lag = gw.exit_lag([r for _, r in row.crashes], since)
        if lag:
            row.note(lag)
    return row


async def scenario_3(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        await failing_rollout(
            ctx, gw, "3a", "new revision exits at once", "v2-exit", 2, env={"CRASH_AFTER": "0"}
        )
        await failing_rollout(
            ctx,
            gw,
            "3b",
            f"new revision never passes its probe (start_timeout {p.bad_start_timeout:g} s)",
            "v3-probe",
            3,
            env={"FAIL_PROBE": "1"},
            start_timeout=p.bad_start_timeout,
        )
        extra: dict[str, Any] = {}
        title = f"new revision passes, then crashes after {p.crash_after:g} s"
        if p.crash_min_ready is not None:
            extra["min_ready"] = p.crash_min_ready
            title += f" (min_ready {p.crash_min_ready:g} s)"
        if p.crash_mix is not None:
            title += ", replayable requests only"
        await failing_rollout(
            ctx,
            gw,
            "3c",
            title,
            "v4-crash",
            4,
            env={"CRASH_AFTER": f"{p.crash_after:g}"},
            untouched=False,
            crash=True,
            mix=p.crash_mix,
            **extra,
        )


async def scenario_4(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway(capacity=p.replicas) as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        row = ctx.row("4a", f"scale-up {p.replicas}→{p.replicas + 2} beyond capacity {p.replicas}")
        view = await gw.fresh_view()
        ids = {r["id"] for r in ready(view)}
        with gw.track() as track:
            async with ctx.loaded(gw, row):
                since = time.monotonic()
                result = await gw.scale(p.replicas + 2)
                row.check(result["action"] == "scaled", f"scale answered {result['action']}")
                view = await gw.wait(
                    lambda v: "no capacity" in (v["conditions"]["reason"] or ""),
                    p.deadline,
                    "the service to report itself degraded for lack of capacity",
                )
                reason = view["conditions"]["reason"]
                await asyncio.sleep(p.hold)
                view = await gw.fresh_view()
                held = time.monotonic() - since
                row.check(view["status"] == "degraded", f"status {view['status']}, not degraded")
                row.check({r["id"] for r in ready(view)} == ids, "the serving replicas changed")
                await gw.scale(p.replicas)
                await gw.wait(
                    lambda v: v["status"] == "ready" and settled(v, 1, p.replicas),
                    p.deadline,
                    "the service to be ready again after scaling back",
                )
        attempts = [
            e for e in gw.events_of("replica_failed", since) if "no capacity" in e["message"]
        ]
        row.rollout = (
            f"no rollout (a scale): degraded for {held:.1f} s, {len(attempts)} placements "
            f"failed alone, then scaled back to {p.replicas}"
        )
        row.note(f"reported: {reason!r}")
        row.note(f"ready ≥ {track.min_ready} throughout; the {len(ids)} replicas untouched")
        row.check(track.min_ready >= p.replicas, f"ready fell to {track.min_ready}")
        row.check(attempts, "no placement was attempted")
        await failing_rollout(
            ctx, gw, "4b", f"new revision that cannot be placed (capacity {p.replicas})", "v2", 2
        )


# -- scenario 5: SIGKILL of serving replicas ----------------------------------------------------


async def scenario_5(ctx: Ctx) -> None:
    p = ctx.profile
    rng = random.Random(5)
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        what = "a serving replica" if gw.docker is None else "a serving replica's container"
        row = ctx.row("5", f"SIGKILL of {what} every {p.kill_every:g} s")
        seen: list[float] = []
        calls: list[float] = []
        with gw.track() as track:
            async with ctx.loaded(gw, row, mix=p.crash_mix):
                since = time.monotonic()
                end = since + p.kill_for
                while time.monotonic() + p.kill_every <= end:
                    await asyncio.sleep(p.kill_every)
                    view = await gw.fresh_view()
                    victims = await gw.victims(ready(view))
                    if not victims:
                        row.problems.append("no ready replica to kill")
                        continue
                    replica_id, victim = rng.choice(victims)
                    killed = time.monotonic()
                    await gw.kill(victim)
                    calls.append(time.monotonic() - killed)
                    row.crashes.append((killed, replica_id))
                    await gw.wait(
                        lambda v, rid=replica_id: all(
                            r["id"] != rid or r["state"] not in LIVE for r in v["replicas"]
                        ),
                        p.deadline,
                        f"the controller to see {replica_id} gone",
                    )
                    seen.append(time.monotonic() - killed)
                last = time.monotonic()
                await gw.wait(
                    lambda v: settled(v, 1, p.replicas),
                    p.deadline,
                    f"{p.replicas} ready replicas again after the last kill",
                )
                back = time.monotonic() - last
        started = [e for e in gw.events_of("replica_started", since)]
        row.rollout = (
            f"no rollout: {len(row.crashes)} SIGKILLs, {len(started)} replacements; "
            f"{p.replicas} ready {back:.1f} s after the last"
        )
        note = (
            f"ready ≥ {track.min_ready} throughout; each kill seen by the controller within "
            f"{max(seen, default=0) * 1000:.0f} ms"
        )
        if gw.docker is not None:
            note += (
                f" of the kill sent (the engine answered it within "
                f"{max(calls, default=0) * 1000:.0f} ms)"
            )
        row.note(note)
        lag = gw.exit_lag([r for _, r in row.crashes], since)
        if lag:
            row.note(lag)
        row.check(len(started) >= len(row.crashes), "not every killed replica was replaced")


# -- scenario 6: superseding apply, undo --------------------------------------------------------


def halfway(new: int, old: int, replicas: int) -> Callable[[dict[str, Any]], bool]:
    """A rollout in progress: a new replica ready, an old one already taken away."""
    return lambda v: len(ready(v, new)) >= 1 and len(live(v, old)) < replicas


async def scenario_6(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        row = ctx.row("6a", "an apply (r3) supersedes the rollout r1→r2 half-way")
        before = await gw.last_rollout_id()
        async with ctx.loaded(gw, row):
            await gw.apply(make_spec(p, gw, "v2"))
            view = await gw.wait(halfway(2, 1, p.replicas), p.deadline, "the rollout half-way")
            row.note(
                f"superseded with {len(ready(view, 2))} r2 ready, {len(live(view, 1))} r1 live"
            )
            result = await gw.apply(make_spec(p, gw, "v3"))
            row.check(result["revision"] == 3, f"apply answered revision {result['revision']}")
            await gw.wait(lambda v: settled(v, 3, p.replicas), p.deadline, "r3 at full strength")
            done = time.monotonic()
        rollouts = await gw.rollouts_since(before)
        row.rollout = describe_rollouts(rollouts)
        statuses = [(r["to_revision"], r["status"]) for r in rollouts]
        row.check(statuses == [(2, "superseded"), (3, "complete")], f"rollouts were {statuses}")
        only_revision_after(row, done, 3)

        row = ctx.row("6b", "an undo in the middle of the rollout r3→r4")
        before = await gw.last_rollout_id()
        async with ctx.loaded(gw, row):
            await gw.apply(make_spec(p, gw, "v4"))
            view = await gw.wait(halfway(4, 3, p.replicas), p.deadline, "the rollout half-way")
            row.note(f"undone with {len(ready(view, 4))} r4 ready, {len(live(view, 3))} r3 live")
            await gw.undo()
            await gw.wait(lambda v: settled(v, 3, p.replicas), p.deadline, "r3 at full strength")
            done = time.monotonic()
        rollouts = await gw.rollouts_since(before)
        row.rollout = describe_rollouts(rollouts)
        kinds = [(r["kind"], r["to_revision"], r["status"]) for r in rollouts]
        row.check(
            kinds == [("rollout", 4, "superseded"), ("undo", 3, "complete")],
            f"rollouts were {kinds}",
        )
        only_revision_after(row, done, 3)


# -- scenario 7: drains -------------------------------------------------------------------------


async def scenario_7(ctx: Ctx) -> None:
    p = ctx.profile
    timeout = p.held_drain_timeout
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1", replicas=1, drain_timeout=timeout))
        row = ctx.row(
            "7",
            f"slow request and SSE stream across a drain; a WebSocket past drain_timeout "
            f"{timeout:g} s",
        )
        held: dict[str, asyncio.Task[Outcome]] = {}
        async with ctx.loaded(gw, row) as load:
            events = max(1, round(p.held_seconds / 0.1))
            held["slow"] = asyncio.create_task(load.slow(p.held_seconds))
            held["sse"] = asyncio.create_task(load.sse(events, p.held_seconds / events))
            held["ws"] = asyncio.create_task(load.websocket(timeout * 4))
            await asyncio.sleep(0.3)
            since = time.monotonic()
            await gw.apply(make_spec(p, gw, "v2", replicas=1, drain_timeout=timeout))
            await asyncio.wait(held.values(), timeout=p.deadline)
            if held["ws"].done():
                expected = held["ws"].result()
                row.expected = lambda o: o is expected and o.going_away
            await gw.wait(lambda v: settled(v, 2, 1), p.deadline, "r2 serving alone")
        slow, sse, ws = (held[k].result() for k in ("slow", "sse", "ws"))
        draining = [e for e in gw.events_of("replica_draining", since) if e["revision"] == 1]
        timeouts = [e for e in gw.events_of("replica_drain_timeout", since) if e["revision"] == 1]
        rollouts = await gw.rollouts_since(0)
        row.rollout = describe_rollouts(rollouts[-1:])
        if not row.check(draining, "no drain of the r1 replica was seen"):
            return
        drain_at = draining[0]["mono"]
        for name, o in (("slow request", slow), ("SSE stream", sse)):
            row.check(not o.failed, f"the held {name} failed: {o.error}")
            row.check(o.revision == 1, f"the held {name} was answered by r{o.revision}")
            row.check(
                o.start < drain_at < o.end,
                f"the held {name} was not in flight when the drain began",
            )
        row.check(ws.going_away, f"the held WebSocket was not closed with 1001: {ws.error or 'ok'}")
        row.check(timeouts, "no drain timeout was recorded")
        row.note(
            f"drain began {drain_at - slow.start:.1f} s into the held requests: the slow "
            f"request ({slow.status}, r{slow.revision}) and the SSE stream ({events} events) "
            f"finished {slow.end - drain_at:.1f} s and {sse.end - drain_at:.1f} s after it"
        )
        row.note(
            f"the WebSocket (r{ws.revision}, {ws.messages} echoes) closed with {ws.status} "
            f"{ws.end - drain_at:.1f} s after the drain began (expected, not counted)"
        )


# -- scenario 8: SIGTERM to the gateway ---------------------------------------------------------


async def scenario_8(ctx: Ctx) -> None:
    p = ctx.profile
    async with ctx.gateway(shutdown_timeout=p.shutdown_timeout) as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1"))
        row = ctx.row("8", "SIGTERM to the gateway process with requests in flight")
        row.expected = lambda o: o.kind == "ws" and o.going_away
        process = gw.process
        assert process is not None
        async with ctx.loaded(gw, row, settle=False) as load:
            held = [
                asyncio.create_task(load.slow(p.held_seconds / 2)),
                asyncio.create_task(load.sse(20, p.held_seconds / 2 / 20)),
                asyncio.create_task(load.upload(p.mix.upload[1])),
                asyncio.create_task(load.websocket(p.shutdown_timeout * 4)),
            ]
            await asyncio.sleep(0.3)
            # New requests stop (a gateway that stops listening refuses them: that is the
            # point of draining it at a load balancer first); what is in flight must finish.
            load.stop_new()
            await asyncio.sleep(0.1)
            inflight = load.pending()
            gw.stop_watching()
            sent = time.monotonic()
            process.send_signal(signal.SIGTERM)
            try:
                code: int | None = await asyncio.wait_for(process.wait(), p.shutdown_timeout + 10)
            except TimeoutError:
                code = None
            took = time.monotonic() - sent
            await asyncio.wait(held, timeout=p.deadline)
        kinds: dict[str, int] = {}
        for o in inflight:
            kinds[o.kind] = kinds.get(o.kind, 0) + 1
        row.rollout = f"no rollout: exit status {code} {took:.1f} s after SIGTERM"
        row.check(code == 0, f"the gateway exited with {code}")
        row.check(len(inflight) >= 3, f"only {len(inflight)} requests were in flight at SIGTERM")
        bad = [o for o in inflight if o.failed and not (o.kind == "ws" and o.going_away)]
        row.check(not bad, f"{len(bad)} requests in flight at SIGTERM failed")
        closed = [o for o in inflight if o.kind == "ws" and o.going_away]
        row.note(
            "in flight at SIGTERM: "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f"; all HTTP ones completed; {len(closed)} WebSocket closed with 1001 "
            "at shutdown (expected, not counted)"
        )


# -- scenarios 9 and 10: canary and blue/green ---------------------------------------------------


def shares(row: Row, steps: list[dict[str, Any]], revision: int) -> list[tuple[int, float, int]]:
    """Per step (its ``rollout_step`` event to the next): (weight, the share of the short
    requests ``revision`` answered, their count)."""
    out = []
    for i, event in enumerate(steps):
        weight = int(event["message"].split(" takes ")[1].split("%")[0])
        end = steps[i + 1]["mono"] if i + 1 < len(steps) else float("inf")
        window = [
            o
            for o in row.outcomes
            if o.kind == "short" and not o.failed and event["mono"] + 0.05 < o.start < end
        ]
        if window:
            got = sum(1 for o in window if o.revision == revision) / len(window)
            out.append((weight, got, len(window)))
    return out


async def scenario_9(ctx: Ctx) -> None:
    p = ctx.profile
    canary: dict[str, Any] = {
        "strategy": "canary",
        "steps": [{"weight": 20, "pause": 3}, {"weight": 50, "pause": 3}],
        "analysis": {"max_error_rate": 0.01, "min_requests": 20, "interval": 1},
    }
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1", **canary))
        row = ctx.row("9", "canary r1→r2: 20 % then 50 % (3 s each, analysed), then 100 %")
        before = await gw.last_rollout_id()
        began = time.monotonic()
        async with ctx.loaded(gw, row):
            await gw.apply(make_spec(p, gw, "v2", **canary))
            await gw.wait(lambda v: settled(v, 2, p.replicas), p.deadline * 2, "r2 in full")
            done = time.monotonic()
        rollouts = await gw.rollouts_since(before)
        row.rollout = describe_rollouts(rollouts)
        row.check([r["status"] for r in rollouts] == ["complete"], f"rollouts: {row.rollout}")
        seen = shares(row, gw.events_of("rollout_step", began), 2)
        row.check(len(seen) >= 2, f"steps seen: {seen}")
        for weight, got, n in seen[:-1]:
            tolerance = 4 * (weight / 100 * (1 - weight / 100) / n) ** 0.5 + 0.02
            row.check(abs(got - weight / 100) <= tolerance, f"at {weight}%: r2 {got:.1%} of {n}")
        row.note(
            "r2's share of the requests per step: "
            + ", ".join(f"{w}% asked, {g:.1%} of {n}" for w, g, n in seen)
        )
        only_revision_after(row, done, 2)


async def scenario_10(ctx: Ctx) -> None:
    p = ctx.profile
    bg: dict[str, Any] = {"strategy": "blue_green", "keep_previous": 60}
    async with ctx.gateway() as gw:
        await serve(ctx, gw, make_spec(p, gw, "v1", **bg))
        row = ctx.row("10", "blue/green r1→r2: preview only, promote, then an instant undo")
        before = await gw.last_rollout_id()
        async with ctx.loaded(gw, row):
            await gw.apply(make_spec(p, gw, "v2", **bg))
            await gw.wait(
                lambda v: len(ready(v, 2)) == p.replicas and (v.get("rollout") or {}).get("step"),
                p.deadline,
                "green in full at 0 %",
            )
            preview = time.monotonic()
            await asyncio.sleep(1.0)
            promoted = time.monotonic()
            await gw.call("POST", f"/api/services/{SERVICE}/rollout/promote", {})
            await gw.wait(
                lambda v: (v.get("rollout") or {}).get("weight") == 100, p.deadline, "the switch"
            )
            await asyncio.sleep(1.0)
            undone = time.monotonic()
            await gw.undo()
            await gw.wait(lambda v: settled(v, 1, p.replicas), p.deadline, "r1 alone again")
            done = time.monotonic()
        before_switch = {
            o.revision
            for o in row.outcomes
            if o.kind == "short" and not o.failed and preview < o.start < promoted
        }
        row.check(before_switch == {1}, f"before the switch, answered by {before_switch}")
        rollouts = await gw.rollouts_since(before)
        row.rollout = describe_rollouts(rollouts)
        kinds = [(r["kind"], r["to_revision"], r["status"]) for r in rollouts]
        row.check(
            kinds == [("rollout", 2, "superseded"), ("undo", 1, "complete")],
            f"rollouts were {kinds}",
        )
        started = gw.events_of("replica_started", undone)
        row.check(not started, f"the undo started {len(started)} replicas")
        to_green = [
            o.start
            for o in row.outcomes
            if o.kind == "short" and o.revision == 2 and o.start > undone
        ]
        last = f"{max(to_green) - undone:.3f} s" if to_green else "none"
        row.note(
            f"undo: nothing started; last request sent to r2 after it: {last}; "
            f"r1 alone (r2 drained, stopped) in {done - undone:.2f} s"
        )
        only_revision_after(row, done, 1)


# -- scenario 11: a gRPC service ----------------------------------------------------------------


def grpc_spec(p: Profile, gw: Gateway, version: str) -> dict[str, Any]:
    """A revision of a gRPC service: ``tests/e2e/grpc_replica.py`` replicas over h2c, the gRPC
    health probe; ``version`` is their ``NAME``, which every answer carries."""
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(GRPC_APP))} $PORT"
    return {
        "name": SERVICE,
        "route": {"path_prefix": "/"},
        "replicas": p.replicas,
        "replica": {"commands": [command], "env": {"NAME": version, "PIDDIR": str(gw.piddir)}},
        "upstream_protocol": "http2",
        "probes": [
            {
                "type": "grpc",
                "interval": p.probe_interval,
                "timeout": 1.0,
                "healthy_threshold": 2,
                "unhealthy_threshold": 3,
            }
        ],
        "rollout": {
            "start_timeout": p.start_timeout,
            "drain_timeout": p.drain_timeout,
            "stop_grace": 2.0,
            "retries": p.retries,
        },
    }


class GrpcLoad:
    """grpcio clients (``grpc.aio``, a channel each) on the gateway: ``unary`` sending unary
    calls back to back, ``streams`` each holding a server-streaming call (``Tick``: ``ticks``
    answers ``interval`` s apart) open, then the next. Every call is an ``Outcome``: failed
    unless it ended OK with every answer, in order, from one revision and replica."""

    def __init__(self, port: int, unary: int, streams: int, ticks: int, interval: float) -> None:
        self.target = f"127.0.0.1:{port}"
        self.unary, self.streams = unary, streams
        self.ticks, self.interval = ticks, interval
        self.outcomes: list[Outcome] = []
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        clients = [self._unary_client] * self.unary + [self._stream_client] * self.streams
        self._tasks = [asyncio.create_task(run(i)) for i, run in enumerate(clients)]

    async def stop(self) -> None:
        """Let every call in flight finish (a stream to its last answer), then stop."""
        self._stopping.set()
        await asyncio.gather(*self._tasks)

    @staticmethod
    def _answered(o: Outcome, message: bytes) -> list[bytes]:
        parts = message.split(b":")
        o.revision = int(parts[0][1:]) if parts[0][1:].isdigit() else None
        return parts

    async def _unary_client(self, client: int) -> None:
        import grpc

        async with grpc.aio.insecure_channel(self.target) as channel:
            unary = channel.unary_unary("/test.Echo/Unary")
            while not self._stopping.is_set():
                o = Outcome("grpc-unary", client, True, time.monotonic())
                try:
                    answer = await unary(b"ping", timeout=10)
                    parts = self._answered(o, answer)
                    if parts[1:] != [b"ping"]:
                        o.error = f"wrong answer {answer!r}"
                except grpc.RpcError as e:
                    o.error = f"{e.code().name}: {e.details()}"
                o.end = time.monotonic()
                self.outcomes.append(o)

    async def _stream_client(self, client: int) -> None:
        import grpc

        # The streams' starts spread over one stream's length: begun together, they all ended
        # together, and a drain that came in the moment between their calls had no stream
        # in flight on its replica (the likely cause of one failure of the short scenario).
        nth = client - self.unary
        await asyncio.sleep(nth * self.ticks * self.interval / self.streams)
        async with grpc.aio.insecure_channel(self.target) as channel:
            tick = channel.unary_stream("/test.Echo/Tick")
            while not self._stopping.is_set():
                o = Outcome("grpc-stream", client, True, time.monotonic())
                seen: list[bytes] = []
                try:
                    call = tick(b"%d %g" % (self.ticks, self.interval), timeout=30)
                    async for answer in call:
                        seen.append(answer)
                except grpc.RpcError as e:
                    o.error = f"{e.code().name}: {e.details()} after {len(seen)} answers"
                first = self._answered(o, seen[0]) if seen else []
                o.replica = first[1].decode() if len(first) == 3 else None
                want = [b"%s:%s:%d" % (*first[:2], i) for i in range(self.ticks)]
                if not o.error and seen != want:
                    o.error = f"{len(seen)} of {self.ticks} answers, or not in order"
                o.messages = len(seen)
                o.end = time.monotonic()
                self.outcomes.append(o)


async def scenario_11(ctx: Ctx) -> None:
    p = ctx.profile
    if ctx.docker is not None:
        raise RuntimeError("the gRPC replica needs grpcio: the process backend only")
    ticks, interval = GRPC_TICKS, p.held_seconds / GRPC_TICKS
    async with ctx.gateway() as gw:
        await serve(ctx, gw, grpc_spec(p, gw, "v1"))
        row = ctx.row(
            "11",
            f"gRPC: rolling update of {p.replicas} replicas r1→r2 under unary calls and "
            f"server streams held {p.held_seconds:g} s",
        )
        load = GrpcLoad(gw.port, p.mix.concurrency // 2, p.mix.concurrency, ticks, interval)
        before = await gw.last_rollout_id()
        await load.start()
        row.started = time.monotonic()
        try:
            await asyncio.sleep(max(p.warmup, p.held_seconds / 2))
            since = time.monotonic()
            await gw.apply(grpc_spec(p, gw, "v2"))
            await gw.wait(lambda v: settled(v, 2, p.replicas), p.deadline, "r2 alone")
            done = time.monotonic()
            await asyncio.sleep(p.settle)
        finally:
            await asyncio.wait_for(load.stop(), p.deadline)
            row.finish(load.outcomes)
            ctx.log(f"[{row.key}] {row.summary.requests} calls, {row.summary.failed} failed")
        row.rollout = describe_rollouts(await gw.rollouts_since(before))
        drains = {
            e["replica"]: e["mono"]
            for e in gw.events_of("replica_draining", since)
            if e["revision"] == 1
        }
        row.check(len(drains) == p.replicas, f"{len(drains)} r1 drains seen, not {p.replicas}")
        across = [
            (o, drains[o.replica])
            for o in row.outcomes
            if o.kind == "grpc-stream" and o.replica in drains
            and o.start < drains[o.replica] < o.end
        ]  # fmt: skip
        row.check(across, "no server stream was in flight on an r1 replica when it drained")
        whole = [o for o, _ in across if not o.failed]
        longest = max((o.end - at for o, at in across), default=0.0)
        row.note(
            f"{len(across)} server streams in flight on an r1 replica when its drain began: "
            f"{len(whole)} completed whole on it, the last {longest:.1f} s after its drain began"
        )
        after = {o.revision for o in row.outcomes if not o.failed and o.start > done + 0.05}
        row.check(after == {2}, f"after the rollout, calls answered by revisions {after}")


SCENARIOS: dict[int, Callable[[Ctx], Awaitable[None]]] = {
    1: scenario_1,
    2: scenario_2,
    3: scenario_3,
    4: scenario_4,
    5: scenario_5,
    6: scenario_6,
    7: scenario_7,
    8: scenario_8,
    9: scenario_9,
    10: scenario_10,
    11: scenario_11,
}
PROCESS_ONLY = frozenset({11})
"""Scenarios whose replicas the Docker backend's image cannot run (grpcio)."""


async def run_scenarios(
    numbers: Iterable[int],
    profile: Profile,
    workroot: Path,
    verbose: bool = True,
    docker: Docker | None = None,
) -> list[Row]:
    """Run scenarios (replicas as containers with ``docker``); an error in one becomes a
    problem of its row and the next one runs."""
    ctx = Ctx(profile, workroot, verbose, docker)
    for number in numbers:
        first = len(ctx.rows)
        try:
            await asyncio.wait_for(SCENARIOS[number](ctx), profile.deadline * 6)
        except Exception as e:
            if len(ctx.rows) == first:
                ctx.row(str(number), f"scenario {number}")
            ctx.rows[-1].problems.append(f"did not finish: {type(e).__name__}: {e}")
            ctx.log(f"[{number}] did not finish: {e!r}")
    return ctx.rows


# -- the report ---------------------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def table(rows: list[Row]) -> list[str]:
    out = [
        "| # | scenario | requests | failed | p50 ms | p99 ms | rollout: outcome, duration "
        "| revisions seen | result | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        s = row.summary
        notes = [*row.notes]
        if row.failure_note():
            notes.append(row.failure_note())
        notes += [f"CHECK FAILED: {p}" for p in row.problems]
        result = "pass" if row.passed else "FAIL"
        revisions = ", ".join(f"r{r}" for r in s.revisions) or "-"
        out.append(
            f"| {row.key} | {_cell(row.title)} | {s.requests:,} | {s.failed:,} | {_ms(s.p50)} "
            f"| {_ms(s.p99)} | {_cell(row.rollout)} | {revisions} | {result} "
            f"| {_cell('; '.join(notes))} |"
        )
    return out


def mix_table(rows: list[Row]) -> list[str]:
    out = [
        "| # | short | slow | SSE | upload | WebSocket sessions (echoes) | gRPC unary "
        "| gRPC streams (answers) | failed by kind |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        s = row.summary
        k = s.by_kind
        failed = ", ".join(f"{a} {n}" for a, n in sorted(s.failed_by_kind.items())) or "-"
        echoes = sum(o.messages for o in row.outcomes if o.kind == "ws")
        answers = sum(o.messages for o in row.outcomes if o.kind == "grpc-stream")
        out.append(
            f"| {row.key} | {k.get('short', 0):,} | {k.get('slow', 0):,} | {k.get('sse', 0):,} "
            f"| {k.get('upload', 0):,} | {k.get('ws', 0):,} ({echoes:,}) "
            f"| {k.get('grpc-unary', 0):,} | {k.get('grpc-stream', 0):,} ({answers:,}) "
            f"| {failed} |"
        )
    return out


def failure_lines(rows: list[Row], limit: int = 6) -> list[str]:
    out = []
    for row in rows:
        failures = row.failures
        if not failures:
            continue
        out.append(f"- **{row.key}** ({len(failures)}):")
        for o in failures[:limit]:
            where = f"r{o.revision} {o.replica}" if o.replica else "replica unknown"
            crashed = " [in flight on a replica when it died]" if row.on_crashed(o) else ""
            conn = "keep-alive" if o.keepalive else "fresh"
            out.append(
                f"  - {o.kind} ({conn}, {where}, +{o.start - row.started:.2f} s, "
                f"{o.took:.2f} s): {o.error}{crashed}"
            )
        if len(failures) > limit:
            out.append(f"  - ... {len(failures) - limit} more")
    return out


def report(
    rows: list[Row], command: str, took: float, profile: Profile, docker: Docker | None = None
) -> str:
    mix = profile.mix
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    if docker is None:
        backend = "process backend, loopback"
        replicas = "replicas of `bench/replica_app.py`"
    else:
        backend = (
            f"Docker backend: hosts {' and '.join(DOCKER_HOSTS)} on one engine (Docker "
            f"{docker.version}, `{docker.engine}`), half the capacity and 20 host ports each, "
            f"published on 127.0.0.1"
        )
        replicas = (
            f"replicas as containers of `bench/replica_app.py` in an image built for the run "
            f"FROM `{docker.base}` with {', '.join(docker.libraries)} copied from the bench's "
            f"venv, one container per replica"
        )
    lines = [
        "## Zero downtime"
        + (" on the Docker backend" if docker is not None else "")
        + ": rollouts and faults under load"
        + (f", {profile.workers} workers" if profile.workers > 1 else ""),
        "",
        f"Run {now} with `{command}` ({took:.0f} s in all).",
        "",
        f"Each scenario: the gateway as a process of its own ({backend}, "
        f"`replicas_on_exit: stop`, {workers_text(profile.workers)}), {replicas} "
        f"({profile.startup_delay:g} s start-up, HTTP probe every {profile.probe_interval:g} s), "
        f"and `bench/loadgen.py`: {mix.concurrency} HTTP clients, half sending short GETs back "
        f"to back, half slow requests ({mix.slow[0]:g}-{mix.slow[1]:g} s), SSE streams "
        f"({mix.sse_events[0]}-{mix.sse_events[1]} events, {mix.sse_interval:g} s apart) and "
        f"uploads ({mix.upload[0] // KiB} KiB-{mix.upload[1] / MiB:g} MiB, half chunked), in "
        f"pairs on kept-alive and fresh connections; and {mix.websockets} WebSockets, a message "
        f"every {mix.ws_interval * 1000:.0f} ms, each echo checked, sessions of "
        f"{mix.ws_session[0]:g}-{mix.ws_session[1]:g} s. Rollouts: max_surge 1, "
        f"max_unavailable 0 unless said, drain_timeout {profile.drain_timeout:g} s, "
        f"{profile.retries} retries.",
        "",
        "Failed: a non-2xx answer the replica did not produce itself, a connection error or "
        "timeout, a short or wrong body, an SSE stream cut before its last event, an upload the "
        "replica did not receive whole, a wrong or missing echo, a WebSocket closed under its "
        "client (1001 included, except the closes scenarios 7 and 8 name). p50/p99: short "
        "requests. Rollout: from the rollout records (start to finish).",
        "",
        "Scenario 11 (gRPC) has a load of its own, `GrpcLoad`: "
        f"{mix.concurrency // 2} grpcio clients sending unary calls back to back and "
        f"{mix.concurrency} each holding a server-streaming call open ({GRPC_TICKS} answers "
        f"over {profile.held_seconds:g} s), then the next, a channel each. A call failed unless "
        "it ended OK with every answer, in order, from one replica; p50/p99 there: unary calls.",
        "",
        *table(rows),
        "",
        "Requests by kind:",
        "",
        *mix_table(rows),
        "",
    ]
    failures = failure_lines(rows)
    if failures:
        lines += ["Failed requests (the first few of each scenario):", "", *failures, ""]
    lines += [
        f"Machine: nproc {os.cpu_count()}, {platform.machine()}, kernel {platform.release()}; "
        f"Python {platform.python_version()}, aiohttp {aiohttp.__version__}; "
        f"gateway at git {git_revision()}.",
    ]
    return "\n".join(lines)


def git_revision() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "gateway", "controller"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return f"{rev}{'-dirty' if dirty else ''}" if rev else "unknown"


def workers_text(workers: int) -> str:
    if workers == 1:
        return "traffic served by the gateway's own process"
    return f"traffic served by {workers} worker processes (`--workers {workers}`)"


def write_results(
    section: str, path: Path = RESULTS, workers: int = 1, backend: str = "process"
) -> None:
    """Replace the marked section of ``path`` (appending the markers at the end if absent).

    A run with worker processes, or on the Docker backend, has a section of its own.
    """
    name = "zero-downtime"
    if backend != "process":
        name += f"-{backend}"
    if workers > 1:
        name += f"-workers-{workers}"
    start_mark = START_MARK.replace("zero-downtime", name)
    end_mark = END_MARK.replace("zero-downtime", name)
    text = path.read_text() if path.exists() else ""
    block = f"{start_mark}\n{section}\n{end_mark}"
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end > start:
        text = text[:start] + block + text[end + len(end_mark) :]
    else:
        text = text.rstrip("\n") + ("\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)


# -- main ---------------------------------------------------------------------------------------


def clean_up_docker(engine: str, workroot: Path, docker: Docker | None, keep_image: bool) -> None:
    """Remove every container of the run's gateways (their instance labels) that is left, then
    the replica image unless it is kept; what fails is said, not raised."""
    for path in sorted(workroot.glob("gateway-*/state/instance-id")):
        instance = path.read_text().strip()
        try:
            removed = remove_containers_cli(engine, instance)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"containers of instance {instance} not removed: {e}", file=sys.stderr)
            continue
        if removed:
            print(f"removed {removed} containers of instance {instance}", file=sys.stderr)
    if docker is None or keep_image:
        return
    try:
        docker_cli(engine, "image", "rm", docker.image)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"the image {docker.image} was not removed: {e}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenario", type=int, action="append", choices=sorted(SCENARIOS), help="repeatable"
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=FULL.kill_for,
        help="seconds of the open-ended phases: scenario 5 kills for this long, scenario 4 "
        "holds its scale-up for 0.4 of it (default %(default)s)",
    )
    parser.add_argument("--concurrency", type=int, default=FULL.mix.concurrency)
    parser.add_argument("--websockets", type=int, default=FULL.mix.websockets)
    parser.add_argument(
        "--results",
        choices=("auto", "yes", "no"),
        default="auto",
        help="write bench/RESULTS.md: auto = when every scenario ran",
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="the gateway's worker processes (default 1)"
    )
    parser.add_argument(
        "--backend",
        choices=("process", "docker"),
        default="process",
        help="replicas as processes or as containers (default %(default)s)",
    )
    parser.add_argument(
        "--docker-host",
        default=os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock"),
        help="the engine of --backend docker (default $DOCKER_HOST or %(default)s)",
    )
    parser.add_argument(
        "--image",
        default=DEFAULT_BASE_IMAGE,
        help="--backend docker: the base of the replica image, with python3 (default %(default)s)",
    )
    parser.add_argument(
        "--keep-image", action="store_true", help="--backend docker: keep the replica image"
    )
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args(argv)
    every = [n for n in sorted(SCENARIOS) if args.backend == "process" or n not in PROCESS_ONLY]
    numbers = args.scenario or every
    profile = replace(
        FULL,
        kill_for=args.duration,
        hold=args.duration * 0.4,
        workers=args.workers,
        mix=replace(FULL.mix, concurrency=args.concurrency, websockets=args.websockets),
    )
    workroot = Path(tempfile.mkdtemp(prefix="zero-downtime-"))
    started = time.monotonic()
    docker: Docker | None = None
    image_existed = True
    try:
        if args.backend == "docker":
            docker, image_existed = build_replica_image(args.docker_host, args.image, workroot)
            print(f"replica image {docker.image} (FROM {docker.base})", file=sys.stderr)
        rows = asyncio.run(run_scenarios(numbers, profile, workroot, docker=docker))
    finally:
        if args.backend == "docker":
            clean_up_docker(args.docker_host, workroot, docker, image_existed or args.keep_image)
        if args.keep:
            print(f"work directory kept: {workroot}", file=sys.stderr)
        else:
            shutil.rmtree(workroot, ignore_errors=True)
    took = time.monotonic() - started
    command = " ".join([".venv/bin/python bench/zero_downtime.py", *(argv or sys.argv[1:])])
    section = report(rows, command.strip(), took, profile, docker)
    print(section)
    if args.results == "yes" or (args.results == "auto" and set(numbers) == set(every)):
        write_results(section, workers=args.workers, backend=args.backend)
        print(f"\nwritten to {RESULTS.relative_to(ROOT)}", file=sys.stderr)
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
