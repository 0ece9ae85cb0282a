"""End-to-end fixtures: the real gateway (``run_gateway``) and real replica processes.

Each test gets a factory, ``gateways``, that starts a gateway in-process on 127.0.0.1 (traffic
and admin on port 0, state in ``tmp_path``, the process backend on a block of ports), and a
``Load`` helper that sends continuous traffic through the gateway and records every outcome.
Replicas are ``python3 -m http.server`` serving a directory per revision whose ``index.html``
names the revision, so every response says which revision answered it.

Teardown stops every gateway through its stop event and then checks that no replica process
any of them started (or adopted) is left; one that is gets SIGKILL (its own process group
only, by the pid the backend reported) and the test fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from controller.backends.base import Launch, Running
from controller.config import load_config
from controller.planning.model import ReplicaState
from controller.serving import Gateway, run_gateway
from controller.state import ServiceState
from tests.support.eventually import eventually
from tests.support.ports import port_block

SERVER = f"{sys.executable} -m http.server $PORT --bind 127.0.0.1"
"""The replica command: a stdlib static file server on the port the backend allocated."""

PROBE: dict[str, Any] = {
    "type": "http",
    "path": "/",
    "interval": 0.1,
    "timeout": 0.5,
    "healthy_threshold": 2,
    "unhealthy_threshold": 2,
}
ROLLOUT: dict[str, Any] = {
    "retry_backoff": 0.2,
    "max_retry_backoff": 0.4,
    "start_timeout": 10,
    "drain_timeout": 5,
    "stop_grace": 1,
}


ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_finish(session: pytest.Session) -> None:
    """The project's image build (``test_image``), when the session runs that module, starts
    now: it takes minutes, mostly of one core, and the tests before it leave CPU idle."""
    if session.config.option.collectonly:
        return
    if any(item.path.name == "test_image.py" for item in session.items):
        from . import test_image

        test_image.start_early()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A build started early and not taken (the session ended first) is stopped."""
    test_image = sys.modules.get(f"{__package__}.test_image")
    if test_image is not None:
        test_image.abandon_early()


async def gateway_process(config: Path, log: Path) -> asyncio.subprocess.Process:
    """``gateway serve -c config`` as a process of its own (this checkout's code), its output
    appended to ``log``: for what only a real process shows (SIGKILL, SIGSTOP, a restart)."""
    with open(log, "ab") as output:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "controller.main",
            "serve",
            "-c",
            str(config),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
        )


async def serve_process(config: Path) -> asyncio.subprocess.Process:
    """``controller.main serve -c config`` as a process of its own, once it says it is ready.
    Its standard error is a pipe the caller no longer reads: for short tests only."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.main", "serve", "-c", str(config),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        while b"gateway ready" not in (
            line := await asyncio.wait_for(process.stderr.readline(), 20)
        ):
            assert line, "the gateway exited before it was ready"
    except BaseException:
        process.kill()
        await process.wait()
        raise
    return process


def children(pid: int) -> set[int]:
    """The pids of the children of every thread of ``pid``."""
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out |= {int(p) for p in (task / "children").read_text().split()}
    return out


def threads(pid: int) -> list[str]:
    """The names of the threads of ``pid``."""
    return [(t / "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    state = data[data.rindex(b")") + 2 :].split()[0]
    return state not in (b"Z", b"X")


# -- the gateway ------------------------------------------------------------------------------


@dataclass
class Handle:
    """A gateway running in-process, and what its process backend started."""

    gateway: Gateway
    stop_event: asyncio.Event
    task: asyncio.Task[None]
    started_pids: list[int] = field(default_factory=list)
    """Pids of every replica this gateway's backend spawned, in order."""
    adopted_pids: list[int] = field(default_factory=list)
    """Pids of the replicas it adopted at start-up."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway.traffic.port}"

    @property
    def controller(self) -> Any:
        return self.gateway.controller

    def state(self, name: str = "web") -> ServiceState:
        return self.gateway.controller.state(name)

    def replicas(
        self, *states: ReplicaState, revision: int | None = None, name: str = "web"
    ) -> list[Any]:
        return [
            r
            for r in self.state(name).observed.replicas
            if (not states or r.state in states) and (revision is None or r.revision == revision)
        ]

    def ready(self, revision: int | None = None, name: str = "web") -> int:
        return len(self.replicas(ReplicaState.READY, revision=revision, name=name))

    def pids(self, revision: int | None = None, name: str = "web") -> dict[str, int]:
        """Replica id -> pid of the running replicas (of ``revision``)."""
        state = self.state(name)
        out = {}
        for replica in state.observed.replicas:
            running = self.gateway.controller.executor.running.get(replica.id)
            if running is None:
                continue
            rid = replica.id
            if running.pid is not None and (
                revision is None or (replica is not None and replica.revision == revision)
            ):
                out[rid] = running.pid
        return out

    def rollouts(self, name: str = "web") -> list[Any]:
        return self.gateway.controller.store.rollouts(name)

    async def stop(self, timeout: float = 15.0) -> None:
        self.stop_event.set()
        await asyncio.wait_for(asyncio.shield(self.task), timeout)


class Gateways:
    """Starts gateways for one test; ``close`` stops them and checks nothing is left."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.state_dir = tmp_path / "state"
        base = port_block(25)
        self.port_range = f"{base}-{base + 24}"
        self.handles: list[Handle] = []
        self.configs = 0
        self.other_pids: set[int] = set()
        """Replica pids seen otherwise (a gateway run as a process of its own)."""

    def config(
        self, *, capacity: int | None = 8, on_exit: str = "stop", **extra: Any
    ) -> dict[str, Any]:
        return {
            "listen": "127.0.0.1:0",
            "admin": {"listen": "127.0.0.1:0", "token_env": None},
            "state_dir": str(self.state_dir),
            "backends": {"process": {"capacity": capacity, "port_range": self.port_range}},
            "proxy": {"shutdown_timeout": 2},
            "access_log": {"enabled": False},
            "replicas_on_exit": on_exit,
            **extra,
        }

    def write_config(self, config: dict[str, Any]) -> Path:
        self.configs += 1
        path = self.tmp_path / f"gateway-{self.configs}.json"
        path.write_text(json.dumps(config))
        return path

    async def start(self, **settings: Any) -> Handle:
        """Run a gateway in-process (``run_gateway``) until ``Handle.stop`` or teardown."""
        path = self.write_config(self.config(**settings))
        loaded = load_config(path)
        stop = asyncio.Event()
        ready: asyncio.Future[Handle] = asyncio.get_running_loop().create_future()
        handle_box: list[Handle] = []

        def started(gateway: Gateway) -> None:
            handle = Handle(gateway, stop, task)
            self._instrument(handle)
            handle_box.append(handle)
            ready.set_result(handle)

        task = asyncio.create_task(run_gateway(loaded, stop, started=started))
        done, _ = await asyncio.wait({task, ready}, timeout=10, return_when=asyncio.FIRST_COMPLETED)
        if ready not in done:
            stop.set()
            if task.done():
                task.result()  # raises what stopped the start-up
            raise AssertionError("the gateway did not start within 10 s")
        handle = ready.result()
        self.handles.append(handle)
        return handle

    def _instrument(self, handle: Handle) -> None:
        """Record the pid of every replica the process backend spawns (calls it unchanged)."""
        backend = handle.gateway.controller.backends["process"]
        original = backend.start

        async def start(launch: Launch) -> Running:
            running = await original(launch)
            if running.pid is not None:
                handle.started_pids.append(running.pid)
            return running

        backend.start = start
        running = handle.gateway.controller.executor.running.values()
        handle.adopted_pids += [r.pid for r in running if r.pid is not None]

    def all_pids(self) -> set[int]:
        seen = {pid for h in self.handles for pid in h.started_pids + h.adopted_pids}
        return seen | self.other_pids

    async def close(self) -> None:
        errors = []
        for handle in self.handles:
            try:
                await handle.stop()
            except Exception as e:  # keep stopping the others
                errors.append(f"gateway did not stop cleanly: {e!r}")
        # A replica is reaped a moment after its exit was reported.
        with contextlib.suppress(AssertionError):  # those left are killed and reported below
            await eventually(lambda: not any(alive(p) for p in self.all_pids()), timeout=3)
        left = sorted(p for p in self.all_pids() if alive(p))
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # each replica leads a process group of its own
        if left:
            errors.append(f"replica processes left after the gateway stopped: {left}")
        assert not errors, "; ".join(errors)


@pytest.fixture
async def gateways(tmp_path: Path) -> AsyncIterator[Gateways]:
    g = Gateways(tmp_path)
    try:
        yield g
    finally:
        await g.close()


# -- replicas and specs -----------------------------------------------------------------------


@pytest.fixture
def site(tmp_path: Path) -> Callable[[str], str]:
    """``site("v1")``: a directory whose index.html says ``v1``, for one revision.

    Written once: naming a site again leaves it as it is, since its replicas may be serving
    it. ``http.server`` takes Content-Length from ``fstat`` and then reads the file, so a
    rewrite in place (truncate, then write) under traffic answers 200 with an empty body, or
    a length of 0 followed by the body (a 502 from the gateway).
    """

    def make(version: str) -> str:
        directory = tmp_path / "sites" / version
        index = directory / "index.html"
        if not index.exists():
            directory.mkdir(parents=True, exist_ok=True)
            index.write_text(version)
        return str(directory)

    return make


def spec(
    working_dir: str,
    replicas: int = 1,
    *,
    name: str = "web",
    commands: list[str] | None = None,
    probes: list[dict[str, Any]] | None = None,
    **rollout: Any,
) -> dict[str, Any]:
    return {
        "name": name,
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {"commands": commands or [SERVER], "working_dir": working_dir},
        "probes": probes or [PROBE],
        "retries": {"attempts": 2},
        "rollout": ROLLOUT | rollout,
    }


async def serving(handle: Handle, data: dict[str, Any], revision: int = 1) -> None:
    """Apply ``data`` and wait until all its replicas are ready and its rollout is done."""
    await handle.controller.apply(data)
    replicas = data["replicas"]
    await eventually(
        lambda: (
            handle.ready(revision) == replicas
            and handle.state().observed.serving_revision == revision
            and handle.state().observed.rollout is None
        ),
        what=f"{replicas} ready replicas of revision {revision}",
    )


# -- traffic ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    at: float
    client: int
    status: int | None
    body: str
    error: str = ""
    took: float = 0.0

    @property
    def failed(self) -> bool:
        return bool(self.error) or self.status is None or not 200 <= self.status < 300


class Load:
    """``clients`` concurrent clients sending GETs (or POSTs of ``data``) through the gateway
    until stopped.

    Even-numbered clients keep one keep-alive connection; odd ones open a fresh connection
    per request. Every outcome is recorded; a failure is a non-2xx status, a connection
    error, or a body shorter than its Content-Length. Stops by itself after ``limit`` s.
    """

    def __init__(
        self,
        url: str,
        clients: int = 8,
        limit: float = 30.0,
        path: str = "/",
        data: bytes | None = None,
    ) -> None:
        self.url = url + path
        self.data = data
        """A body to POST (None: GET)."""
        self.clients = clients
        self.limit = limit
        self.outcomes: list[Outcome] = []
        self._marks: dict[int, float] = {}
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Load:
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        await eventually(lambda: len(self.outcomes) >= self.clients, what="the first responses")
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, i: int) -> None:
        keepalive = i % 2 == 0
        connector = aiohttp.TCPConnector(force_close=not keepalive, limit=1)
        timeout = aiohttp.ClientTimeout(total=10)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limit
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            while not self._stop.is_set() and loop.time() < deadline:
                self.outcomes.append(await self._one(session, i))
                await asyncio.sleep(0.005)

    async def _one(self, session: aiohttp.ClientSession, i: int) -> Outcome:
        now = time.monotonic()
        try:
            async with session.request(
                "GET" if self.data is None else "POST", self.url, data=self.data
            ) as response:
                body = await response.read()
                length = response.content_length
                text = body.decode(errors="replace")
                error = ""
                if length is not None and len(body) != length:
                    error = f"truncated: {len(body)} of {length} bytes"
                return Outcome(now, i, response.status, text, error, time.monotonic() - now)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return Outcome(now, i, None, "", repr(e), time.monotonic() - now)

    def mark(self) -> int:
        """A point in the load: ``bodies(mark)`` counts only requests sent after it."""
        index = len(self.outcomes)
        self._marks[index] = time.monotonic()
        return index

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failed]

    def sent_since(self, since: int) -> list[Outcome]:
        """The outcomes of the requests sent after the mark ``since``: those in flight at the
        mark (sent to what served before it) are answered after it too, and left out."""
        sent_after = self._marks.get(since, 0.0)
        return [o for o in self.outcomes[since:] if o.at >= sent_after]

    def bodies(self, since: int = 0) -> set[str]:
        """The bodies answered to the requests sent after the mark ``since``."""
        return {o.body for o in self.sent_since(since) if not o.failed}

    async def more(self, count: int = 50) -> None:
        """Wait until ``count`` more requests were answered."""
        target = len(self.outcomes) + count
        await eventually(lambda: len(self.outcomes) >= target, what=f"{count} more responses")

    def summary(self) -> str:
        failures = self.failures
        sample = "; ".join(f"{o.status} {o.error or o.body[:80]}" for o in failures[:5])
        slowest = max((o.took for o in self.outcomes), default=0.0)
        return (
            f"{len(failures)} of {len(self.outcomes)} requests failed (slowest {slowest:.2f}s)"
            f": {sample}"
        )


class Watch:
    """Checks ``condition`` every 50 ms in the background; records when it did not hold."""

    def __init__(self, condition: Callable[[], bool], what: str) -> None:
        self.condition = condition
        self.what = what
        self.violations: list[float] = []
        self.checks = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Watch:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._check()

    def _check(self) -> None:
        self.checks += 1
        if not self.condition():
            self.violations.append(time.monotonic())

    async def _run(self) -> None:
        while True:
            self._check()
            await asyncio.sleep(0.05)

    def assert_held(self) -> None:
        assert self.checks > 0
        assert not self.violations, f"{self.what} did not hold {len(self.violations)} times"
