"""The process backend with real subprocesses on loopback, on asyncio's loop and on uvloop.

A replica tells the test that it got somewhere by connecting to the test's ``Notifier`` (its
port in ``$NOTIFY_PORT``); tests await that, exits (through the exit handler) and the end of
processes (through pidfds). Nothing here sleeps to let something happen, except ``until``
polling a log file (the one thing a replica tells of only by writing it).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import os
import re
import shlex
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop

from controller.backends import Exit, Launch, ProcessBackend, Running
from controller.backends.process import exit_reason, shell_script
from controller.errors import NoCapacity, StartFailed
from controller.spec import ReplicaTemplate
from tests.support.eventually import eventually
from tests.support.ports import free_port
from tests.support.raw_servers import RawServers
from tests.support.strays import reap, spawn_stray

PY = shlex.quote(sys.executable)
REPO = Path(__file__).resolve().parents[2]

NOTIFY_PY = """
import json, os, socket, sys
payload = {"env": dict(os.environ), "pid": os.getpid(), "pgid": os.getpgrp(),
           "cwd": os.getcwd(), "args": sys.argv[1:]}
with socket.create_connection(("127.0.0.1", int(os.environ["NOTIFY_PORT"]))) as s:
    s.sendall(json.dumps(payload).encode())
"""

SERVER_PY = """
import http.server, json, os, socket
server = http.server.ThreadingHTTPServer(
    (os.environ["HOST"], int(os.environ["PORT"])), http.server.SimpleHTTPRequestHandler
)
with socket.create_connection(("127.0.0.1", int(os.environ["NOTIFY_PORT"]))) as s:
    s.sendall(json.dumps({"pid": os.getpid()}).encode())
server.serve_forever()
"""

OLD_GATEWAY_PY = """
import asyncio, json, sys
from pathlib import Path
from controller.backends import Launch, ProcessBackend
from controller.spec import ReplicaTemplate
from tests.support.ports import free_port

async def main():
    low, high, log_dir, command = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    backend = ProcessBackend(capacity=None, port_range=(low, high), log_dir=Path(log_dir))
    launch = Launch("svc", 1, "svc-1-old", ReplicaTemplate(commands=(command,)))
    running = await backend.start(launch)
    print(json.dumps(running.handle), flush=True)
    await backend.close()

if sys.argv[5:] == ["uvloop"]:  # as the gateway runs in production
    import uvloop
    uvloop.run(main())
else:
    asyncio.run(main())
"""

TICKER_PY = """
import itertools, os, time
for i in itertools.count():
    os.write(1, f"tick-{i}\\n".encode())  # one write per line, never a partial one
    time.sleep(0.05)
"""

WRITE_300 = 'i=0; while [ $i -lt 300 ]; do echo "line-$i"; i=$((i+1)); done'


# -- helpers -------------------------------------------------------------------------------


class Notifier:
    """A loopback listener; each connection's JSON body is one message."""

    def __init__(self) -> None:
        self.messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.port = 0
        self._servers = RawServers()

    async def open(self) -> None:
        server = await self._servers.start(self._accept)
        self.port = server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read()
        writer.close()
        await writer.wait_closed()
        self.messages.put_nowait(json.loads(data))

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.messages.get(), 10)

    async def close(self) -> None:
        await self._servers.close()


class Harness:
    """A backend, the exits it reported, and the replicas to stop at the end."""

    def __init__(self, backend: ProcessBackend, notifier: Notifier, scripts: Path) -> None:
        self.backend = backend
        self.notifier = notifier
        self.scripts = scripts
        self.reported: list[Exit] = []
        self.ids: list[str] = []
        self._exits: dict[str, asyncio.Future[Exit]] = {}
        self._count = 0
        backend.set_exit_handler(self._on_exit)

    @property
    def notify(self) -> str:
        """A command that sends the test its environment, pid, cwd and arguments."""
        return f"{PY} {shlex.quote(str(self.scripts / 'notify.py'))}"

    def launch(self, *commands: str, replica_id: str | None = None, **template: Any) -> Launch:
        self._count += 1
        rid = replica_id or f"svc-1-r{self._count}"
        env = {"NOTIFY_PORT": str(self.notifier.port), **template.pop("env", {})}
        spec = ReplicaTemplate(commands=commands, env=env, **template)
        return Launch(service="svc", revision=1, replica_id=rid, template=spec)

    async def start(self, *commands: str, **template: Any) -> Running:
        launch = self.launch(*commands, **template)
        self.ids.append(launch.replica_id)
        return await self.backend.start(launch)

    def _future(self, replica_id: str) -> asyncio.Future[Exit]:
        if replica_id not in self._exits:
            self._exits[replica_id] = asyncio.get_running_loop().create_future()
        return self._exits[replica_id]

    def _on_exit(self, event: Exit) -> None:
        self.reported.append(event)
        future = self._future(event.replica_id)
        if not future.done():
            future.set_result(event)

    async def exit_of(self, replica_id: str) -> Exit:
        return await asyncio.wait_for(asyncio.shield(self._future(replica_id)), 10)

    def reports_of(self, replica_id: str) -> list[Exit]:
        return [e for e in self.reported if e.replica_id == replica_id]

    async def cleanup(self) -> None:
        for rid in self.ids:
            await self.backend.stop(rid, 0.2)
        await self.backend.close()


def listener(port: int = 0) -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


async def gone(pid: int) -> None:
    """Returns once process ``pid`` has ended (it may still be a zombie)."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ended: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not ended.done():
                ended.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await asyncio.wait_for(ended, 10)
        finally:
            loop.remove_reader(fd)
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pgid_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2])


def ticks(lines: list[str]) -> list[int]:
    return [int(line.removeprefix("tick-")) for line in lines if line.startswith("tick-")]


def last_tick(backend: ProcessBackend, replica_id: str) -> int:
    return max(ticks(backend.logs(replica_id, 1)), default=-1)


Make = Callable[..., Harness]


@pytest.fixture
async def notifier() -> AsyncIterator[Notifier]:
    notifier = Notifier()
    await notifier.open()
    yield notifier
    await notifier.close()


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    folder = tmp_path / "scripts"
    folder.mkdir()
    (folder / "notify.py").write_text(NOTIFY_PY)
    (folder / "server.py").write_text(SERVER_PY)
    (folder / "ticker.py").write_text(TICKER_PY)
    return folder


def maker(tmp_path: Path, notifier: Notifier, scripts: Path) -> tuple[Make, list[Harness]]:
    made: list[Harness] = []

    def make(**kwargs: Any) -> Harness:
        kwargs.setdefault("capacity", None)
        kwargs.setdefault("log_dir", tmp_path / "logs")
        if "port_range" not in kwargs:
            low = free_port()
            kwargs["port_range"] = (low, min(low + 50, 65535))
        harness = Harness(ProcessBackend(**kwargs), notifier, scripts)
        made.append(harness)
        return harness

    return make, made


@pytest.fixture
async def make(tmp_path: Path, notifier: Notifier, scripts: Path) -> AsyncIterator[Make]:
    make, made = maker(tmp_path, notifier, scripts)
    yield make
    for harness in made:
        await harness.cleanup()


# -- environment, port, working directory --------------------------------------------------


async def test_replica_gets_port_and_identity_but_not_the_gateway_env(
    make: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "secret")
    h = make()
    running = await h.start(h.notify, env={"GREETING": "hi"})
    payload = await h.notifier.next()
    env = payload["env"]
    assert env["PORT"] == str(running.port)
    assert env["HOST"] == "127.0.0.1"
    assert (env["REPLICA_ID"], env["SERVICE"], env["REVISION"]) == ("svc-1-r1", "svc", "1")
    assert env["GREETING"] == "hi"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["PATH"] == os.environ["PATH"]
    assert "GATEWAY_ADMIN_TOKEN" not in env
    # The last command was exec'd: the replica's pid is the program's, and it leads its group.
    assert payload["pid"] == payload["pgid"] == running.pid == running.handle["pgid"]
    assert await h.exit_of(running.replica_id) == Exit(
        running.replica_id, code=0, reason="exited with code 0", requested=False
    )
    assert h.backend.in_use == 0


async def test_replica_serves_on_its_port_from_its_working_dir(
    make: Make, tmp_path: Path, scripts: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "hello.txt").write_text("hello")
    h = make()
    running = await h.start(
        "test -f hello.txt", f"{PY} {scripts / 'server.py'}", working_dir=str(site)
    )
    assert (await h.notifier.next())["pid"] == running.pid
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{running.port}/hello.txt") as response,
    ):
        assert response.status == 200
        assert await response.text() == "hello"

    await h.backend.stop(running.replica_id, grace=5)
    assert h.reports_of(running.replica_id) == [
        Exit(running.replica_id, code=-signal.SIGTERM, reason="stopped", requested=True)
    ]
    assert any("GET /hello.txt" in line for line in h.backend.logs(running.replica_id, 10))


async def test_handle_names_the_process(make: Make, tmp_path: Path) -> None:
    h = make()
    running = await h.start("sleep 1000")
    handle = running.handle
    assert set(handle) == {"pid", "pgid", "port", "start_time", "log"}
    assert handle["pid"] == running.pid
    assert handle["port"] == running.port
    stat = Path(f"/proc/{running.pid}/stat").read_text().rsplit(")", 1)[1].split()
    assert handle["start_time"] == int(stat[19])
    assert handle["log"] == str(tmp_path / "logs" / "svc-1-r1.log")
    assert json.loads(json.dumps(handle)) == handle


async def test_missing_working_dir_is_a_start_failure(make: Make, tmp_path: Path) -> None:
    h = make()
    missing = tmp_path / "nowhere"
    with pytest.raises(StartFailed, match=f"^working directory {missing} does not exist$"):
        await h.start("true", working_dir=str(missing))
    assert h.backend.in_use == 0


# -- capacity and ports ---------------------------------------------------------------------


async def test_capacity_full_raises_no_capacity(make: Make) -> None:
    h = make(capacity=1)
    first = await h.start("sleep 1000")
    with pytest.raises(NoCapacity, match=r"^no capacity: 1 of 1 slots in use$") as caught:
        await h.start("sleep 1000")
    assert caught.value.retry_after > 0
    assert "in_use=1 capacity=1" in repr(h.backend)

    await h.backend.stop(first.replica_id, 0.2)
    assert h.backend.in_use == 0
    await h.start("sleep 1000")


async def test_concurrent_starts_do_not_overbook(make: Make) -> None:
    h = make(capacity=1)
    results = await asyncio.gather(
        h.start("sleep 1000"), h.start("sleep 1000"), return_exceptions=True
    )
    assert sum(isinstance(r, Running) for r in results) == 1
    assert sum(isinstance(r, NoCapacity) for r in results) == 1


async def test_port_allocation_skips_a_port_bound_by_someone_else(make: Make) -> None:
    with listener() as taken:
        low = taken.getsockname()[1]
        h = make(port_range=(low, min(low + 30, 65535)))
        running = await h.start("sleep 1000")
        assert low < running.port <= low + 30


async def test_port_range_exhausted(make: Make) -> None:
    with listener() as taken:
        port = taken.getsockname()[1]
        h = make(port_range=(port, port))
        with pytest.raises(StartFailed, match=f"^port range {port}-{port} exhausted$"):
            await h.start("sleep 1000")
    assert h.backend.in_use == 0


async def test_a_port_is_held_by_one_replica_until_its_exit(make: Make) -> None:
    port = free_port()
    h = make(port_range=(port, port))
    first = await h.start("sleep 1000")  # never binds it: the reservation alone holds it
    assert first.port == port
    with pytest.raises(StartFailed, match="exhausted"):
        await h.start("sleep 1000")
    await h.backend.stop(first.replica_id, 0.2)
    assert (await h.start("sleep 1000")).port == port


async def test_fixed_port(make: Make) -> None:
    h = make()
    port = free_port()
    running = await h.start(h.notify, port=port)
    assert running.port == port
    assert (await h.notifier.next())["env"]["PORT"] == str(port)
    with listener() as taken:
        busy = taken.getsockname()[1]
        with pytest.raises(StartFailed, match=f"^port {busy} on 127.0.0.1 is in use$"):
            await h.start("sleep 1000", port=busy)


# -- exits ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "code", "reason"),
    [
        ("exit 3", 3, "exited with code 3"),
        (
            "no-such-command-for-sure",
            127,
            "exited with code 127 (command not found): "
            "/bin/sh: 1: no-such-command-for-sure: not found",
        ),
        (
            "echo starting; echo 'fatal: no model' >&2; exit 4",
            4,
            "exited with code 4: fatal: no model",
        ),
        ("kill -9 $$", -9, "killed by signal 9 (SIGKILL)"),
    ],
)
async def test_exit_is_reported(make: Make, command: str, code: int, reason: str) -> None:
    h = make()
    running = await h.start(command)  # a command that fails is an exit, not a start failure
    assert await h.exit_of(running.replica_id) == Exit(
        running.replica_id, code=code, reason=reason, requested=False
    )
    assert h.backend.in_use == 0
    await h.backend.stop(running.replica_id, 0.2)  # already gone: nothing to do
    assert len(h.reports_of(running.replica_id)) == 1


async def test_commands_run_in_order_while_they_succeed(make: Make) -> None:
    h = make()
    good = await h.start("echo one # a comment", "echo two")
    assert (await h.exit_of(good.replica_id)).code == 0
    assert h.backend.logs(good.replica_id, 10) == ["one", "two"]

    bad = await h.start("false", "echo never")
    assert (await h.exit_of(bad.replica_id)).code == 1
    assert h.backend.logs(bad.replica_id, 10) == []


async def test_leftovers_of_an_exited_replica_are_ended(make: Make) -> None:
    h = make()
    running = await h.start(f"sleep 1000 & {h.notify} $!; exit 3")
    (leftover,) = (await h.notifier.next())["args"]
    exit = await h.exit_of(running.replica_id)
    assert (exit.code, exit.requested) == (3, False)
    await gone(int(leftover))


async def test_leftovers_that_ignore_sigterm_get_sigkill_after_the_grace(make: Make) -> None:
    h = make(stop_grace_default=0.2)
    began = time.monotonic()
    # The trap is set before the fork: the leftover inherits SIGTERM ignored, with no race.
    running = await h.start(f"trap '' TERM; sleep 1000 & {h.notify} $!; exit 3")
    (leftover,) = (await h.notifier.next())["args"]
    assert await h.exit_of(running.replica_id) == Exit(
        running.replica_id, code=3, reason="exited with code 3", requested=False
    )
    assert time.monotonic() - began >= 0.2
    await gone(int(leftover))


# -- stop -----------------------------------------------------------------------------------


async def test_stop_ends_the_whole_process_group(make: Make) -> None:
    h = make()
    running = await h.start(f"sleep 1000 & a=$!; sleep 1000 & b=$!; {h.notify} $a $b; wait")
    children = [int(pid) for pid in (await h.notifier.next())["args"]]
    for pid in children:
        assert alive(pid)
        assert pgid_of(pid) == running.pid

    await h.backend.stop(running.replica_id, grace=5)
    exit = await h.exit_of(running.replica_id)
    assert (exit.requested, exit.reason, exit.code) == (True, "stopped", -signal.SIGTERM)
    assert running.pid is not None
    for pid in [running.pid, *children]:
        await gone(pid)
        assert not alive(pid)


async def test_sigkill_after_grace_when_sigterm_is_ignored(make: Make) -> None:
    h = make()
    running = await h.start(f"trap '' TERM; {h.notify}; sleep 1000")
    await h.notifier.next()  # the trap is set
    began = time.monotonic()
    await h.backend.stop(running.replica_id, grace=0.2)
    assert time.monotonic() - began >= 0.2
    assert h.reports_of(running.replica_id) == [
        Exit(
            running.replica_id,
            code=-signal.SIGKILL,
            reason="stopped (SIGKILL after 0.2 s grace)",
            requested=True,
        )
    ]
    assert running.pid is not None
    assert not alive(running.pid)


async def test_stop_is_idempotent_and_reports_once(make: Make) -> None:
    h = make()
    await h.backend.stop("never-started", 0.2)
    running = await h.start("sleep 1000")
    await asyncio.gather(
        h.backend.stop(running.replica_id, 5), h.backend.stop(running.replica_id, 5)
    )
    await h.backend.stop(running.replica_id, 5)
    assert [e.reason for e in h.reports_of(running.replica_id)] == ["stopped"]
    assert h.backend.in_use == 0


async def test_a_failing_exit_handler_does_not_lose_the_stop(make: Make) -> None:
    h = make()

    def broken(event: Exit) -> None:
        raise RuntimeError("handler bug")

    h.backend.set_exit_handler(broken)
    running = await h.start("sleep 1000")
    await h.backend.stop(running.replica_id, 0.2)
    assert h.backend.in_use == 0


# -- logs -----------------------------------------------------------------------------------


async def test_logs_are_captured_and_capped_with_one_rotation(make: Make, tmp_path: Path) -> None:
    h = make(log_max_bytes=1000)
    running = await h.start(WRITE_300)
    await h.exit_of(running.replica_id)  # reported after a last check of the log's size

    log = tmp_path / "logs" / f"{running.replica_id}.log"
    rotated = log.with_name(log.name + ".1")
    assert log.stat().st_size <= 1000
    assert rotated.stat().st_size == 1000
    assert h.backend.logs(running.replica_id, 3) == ["line-297", "line-298", "line-299"]
    lines = h.backend.logs(running.replica_id, 10_000)
    assert "line-0" not in lines
    numbers = [int(line.removeprefix("line-")) for line in lines[1:]]
    assert numbers == list(range(numbers[0], 300))  # nothing lost across the rotation
    assert h.backend.logs(running.replica_id, 0) == []
    assert h.backend.logs("unknown", 5) == []


async def test_has_logs_says_whether_the_replica_has_a_log_here(make: Make, tmp_path: Path) -> None:
    """What a cluster node answers for its own log of a replica (``admin.cluster``)."""
    h = make()
    running = await h.start(WRITE_300)
    await h.exit_of(running.replica_id)
    assert h.backend.has_logs(running.replica_id)  # kept after it ended
    log = tmp_path / "logs" / f"{running.replica_id}.log"
    log.rename(log.with_name(log.name + ".1"))
    assert h.backend.has_logs(running.replica_id)  # its rotation alone
    assert not h.backend.has_logs("web-9-elsewhere")
    assert not h.backend.has_logs("../logs")


async def test_rotation_copies_the_tail_and_the_writer_appends_after_the_truncation(
    make: Make, tmp_path: Path, scripts: Path
) -> None:
    h = make(log_max_bytes=200, log_check_interval=3600)  # the timer stays out of the way
    ticker = f"{PY} {shlex.quote(str(scripts / 'ticker.py'))}"
    running = await h.start(f"{WRITE_300}; {h.notify}; exec {ticker}")
    await h.notifier.next()
    rid = running.replica_id
    log = tmp_path / "logs" / f"{rid}.log"
    rotated = log.with_name(log.name + ".1")
    assert log.stat().st_size > 200

    assert h.backend.rotate_logs() == [rid]  # what the periodic check does
    assert rotated.stat().st_size == 200
    assert b"line-299\n" in rotated.read_bytes()
    assert h.backend.rotate_logs() == []  # under the cap now

    # Its stdout is O_APPEND: the next writes land at the new end, not after a hole of NULs
    # as long as the file was before.
    await eventually(lambda: log.read_bytes().count(b"\n") >= 3, what="ticks after the truncation")
    assert re.fullmatch(rb"(tick-\d+\n)+", log.read_bytes())
    assert "line-299" in h.backend.logs(rid, 10_000)
    assert h.backend.in_use == 1


async def test_logs_rotate_an_oversized_log_first(make: Make, tmp_path: Path) -> None:
    h = make(log_max_bytes=1000, log_check_interval=3600)
    running = await h.start(f"{WRITE_300}; {h.notify}; exec sleep 1000")
    await h.notifier.next()
    log = tmp_path / "logs" / f"{running.replica_id}.log"
    assert log.stat().st_size > 1000

    assert h.backend.logs(running.replica_id, 2) == ["line-298", "line-299"]
    assert log.stat().st_size == 0
    assert log.with_name(log.name + ".1").stat().st_size == 1000


async def test_the_log_check_runs_periodically(make: Make, tmp_path: Path) -> None:
    h = make(log_max_bytes=1000, log_check_interval=0.05)
    running = await h.start(f"{WRITE_300}; {h.notify}; exec sleep 1000")
    await h.notifier.next()
    log = tmp_path / "logs" / f"{running.replica_id}.log"
    rotated = log.with_name(log.name + ".1")
    await eventually(
        lambda: rotated.exists() and log.stat().st_size <= 1000, what="the periodic check"
    )
    assert h.backend.logs(running.replica_id, 1) == ["line-299"]


# -- adoption -------------------------------------------------------------------------------


async def old_gateway(
    tmp_path: Path, port: int, command: str, loop: str = "asyncio"
) -> dict[str, Any]:
    """Start a replica from another gateway process (on ``loop``) that then exits; its
    handle."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-W",
        "ignore",
        "-c",
        OLD_GATEWAY_PY,
        str(port),
        str(port),
        str(tmp_path / "logs"),
        command,
        loop,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0
    handle: dict[str, Any] = json.loads(out)
    return handle


async def test_adopt_after_restart_then_stop(make: Make, tmp_path: Path) -> None:
    port = free_port()
    handle = await old_gateway(tmp_path, port, "echo before-restart; exec sleep 1000")
    pid = handle["pid"]
    assert alive(pid)  # the old gateway is gone, its replica is not

    h = make(port_range=(port, port))
    launch = h.launch("echo before-restart; exec sleep 1000", replica_id="svc-1-old")
    running = h.backend.adopt(launch, handle)
    assert running is not None
    assert (running.pid, running.port, running.handle) == (pid, port, handle)
    assert h.backend.in_use == 1  # counts against the capacity
    assert h.backend.adopt(launch, handle) == running  # once is enough
    with pytest.raises(StartFailed, match="exhausted"):  # and its port is held
        await h.backend.start(h.launch("sleep 1000"))
    assert h.backend.logs("svc-1-old", 5) == ["before-restart"]

    await h.backend.stop("svc-1-old", grace=5)
    assert h.reports_of("svc-1-old") == [
        Exit("svc-1-old", code=None, reason="stopped", requested=True)
    ]
    await gone(pid)
    assert h.backend.in_use == 0


# The old backend keeps its replica running on close (a real gateway then exits); inside one
# test process its subprocess transport is collected later and warns. Known gap: close()
# does not detach those transports.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.parametrize("restart", ["in-process", "asyncio-gateway", "uvloop-gateway"])
async def test_a_restart_leaves_the_replica_running_and_writing_its_log(
    make: Make, tmp_path: Path, scripts: Path, restart: str
) -> None:
    """The old gateway closes its backend (and, but in-process, exits: its end of any pipe to
    the replica is gone); the new one adopts the replica, which keeps running and logging
    (no SIGPIPE, no BrokenPipeError)."""
    ticker = f"{PY} {shlex.quote(str(scripts / 'ticker.py'))}"
    port = free_port()
    if restart == "in-process":
        old = make(port_range=(port, port))
        running = await old.backend.start(old.launch(ticker, replica_id="svc-1-old"))
        await eventually(lambda: last_tick(old.backend, "svc-1-old") >= 0, what="a first tick")
        await old.backend.close()
        handle = running.handle
    else:
        handle = await old_gateway(tmp_path, port, ticker, restart.removesuffix("-gateway"))
    pid = handle["pid"]

    h = make(port_range=(port, port))
    adopted = h.backend.adopt(h.launch(ticker, replica_id="svc-1-old"), handle)
    assert adopted is not None
    assert adopted.pid == pid
    h.ids.append("svc-1-old")
    before = last_tick(h.backend, "svc-1-old")
    # Ten more ticks: at least half a second of writing after the restart.
    await eventually(lambda: last_tick(h.backend, "svc-1-old") >= before + 10, what="new ticks")
    assert alive(pid)
    assert h.reports_of("svc-1-old") == []
    numbers = ticks(h.backend.logs("svc-1-old", 10_000))
    assert numbers == list(range(len(numbers)))  # one process all along, no line lost

    await h.backend.stop("svc-1-old", grace=5)
    assert h.reports_of("svc-1-old") == [
        Exit("svc-1-old", code=None, reason="stopped", requested=True)
    ]
    await gone(pid)
    assert h.backend.in_use == 0
    # The old backend's transport is collected here, where its warning is expected, not in
    # whichever later test the collector happens to run.
    gc.collect()


async def test_adopted_replica_exit_is_reported(make: Make, tmp_path: Path) -> None:
    port = free_port()
    handle = await old_gateway(tmp_path, port, "sleep 1000")
    h = make()
    launch = h.launch("sleep 1000", replica_id="svc-1-old")
    assert h.backend.adopt(launch, handle) is not None
    os.kill(handle["pid"], signal.SIGKILL)  # started by this test, through the old gateway
    assert await h.exit_of("svc-1-old") == Exit(
        "svc-1-old",
        code=None,
        reason="exited (exit status unknown: adopted after a restart)",
        requested=False,
    )


async def test_adopt_refuses_a_process_that_is_not_the_replica(make: Make) -> None:
    first = make()
    running = await first.start("sleep 1000")
    second = make()
    launch = second.launch("sleep 1000", replica_id=running.replica_id)

    reused = {**running.handle, "start_time": running.handle["start_time"] + 1}
    assert second.backend.adopt(launch, reused) is None  # same pid, another process
    other_group = {**running.handle, "pgid": os.getpgrp()}
    assert second.backend.adopt(launch, other_group) is None
    assert second.backend.adopt(launch, {}) is None
    assert second.backend.adopt(launch, {**running.handle, "pid": "1"}) is None
    assert second.backend.in_use == 0

    await first.backend.stop(running.replica_id, 0.2)
    assert running.pid is not None
    await gone(running.pid)
    assert second.backend.adopt(launch, running.handle) is None  # it is gone


async def test_the_sweep_stops_replicas_left_with_no_record_and_only_those(
    make: Make, tmp_path: Path
) -> None:
    """A gateway killed between a replica's spawn and its record leaves the replica running,
    its port held, with nothing to adopt it by. The next backend's sweep (after adoption)
    stops such replicas, one that ignores SIGTERM too, and nothing else."""
    port = free_port()
    handle = await old_gateway(tmp_path, port, "exec sleep 1000")  # recorded: adopted
    logs = tmp_path / "logs"
    plain = spawn_stray(logs / "svc-1-stray.log", "exec sleep 1000")
    stubborn = spawn_stray(logs / "svc-2-stubborn.log", "trap '' TERM; sleep 1000 & wait")
    elsewhere = spawn_stray(tmp_path / "other" / "svc-1-x.log", "exec sleep 1000")
    not_a_log = spawn_stray(logs / "notes.txt", "exec sleep 1000")
    try:
        h = make(stop_grace_default=0.3)
        launch = h.launch("exec sleep 1000", replica_id="svc-1-old")
        assert h.backend.adopt(launch, handle) is not None
        h.ids.append("svc-1-old")
        started = await h.start("exec sleep 1000")  # this backend's own: left alone

        assert await h.backend.sweep() == ["svc-1-stray", "svc-2-stubborn"]
        await asyncio.gather(gone(plain), gone(stubborn))
        assert started.pid is not None
        assert alive(handle["pid"])  # adopted
        assert alive(started.pid)  # this backend's own
        assert alive(elsewhere)  # no replica's log of this backend
        assert alive(not_a_log)
        assert h.reports_of("svc-1-old") == []
        assert await h.backend.sweep() == []
    finally:
        for pid in (plain, stubborn, elsewhere, not_a_log):
            reap(pid)


# -- the pure bits --------------------------------------------------------------------------


def test_shell_script_execs_only_a_plain_last_command() -> None:
    path = os.environ["PATH"]
    assert shell_script(["sleep 1"], path, None) == "{ exec sleep 1\n}"
    assert shell_script(["cd /", "sleep $PORT"], path, None) == "{ cd /\n} && { exec sleep $PORT\n}"
    for command in [
        "sleep 1; sleep 2",
        "sleep 1 &",
        "sleep 1 | cat",
        "FOO=1 sleep 1",
        "exit 3",
        "cd /tmp",
        "no-such-command-for-sure",
        "(sleep 1)",
        "if true; then sleep 1; fi",
    ]:
        assert shell_script([command], path, None) == f"{{ {command}\n}}", command


def test_exit_reason() -> None:
    assert exit_reason(0) == "exited with code 0"
    assert exit_reason(126) == "exited with code 126 (command not executable)"
    assert exit_reason(-15) == "killed by signal 15 (SIGTERM)"
    assert exit_reason(-200) == "killed by signal 200"


def test_invalid_configuration() -> None:
    with pytest.raises(ValueError, match="port range"):
        ProcessBackend(capacity=None, port_range=(2000, 1000), log_dir=Path("/tmp"))
    with pytest.raises(ValueError, match="capacity"):
        ProcessBackend(capacity=-1, port_range=(2000, 2001), log_dir=Path("/tmp"))


async def test_repr_and_closed_backend(make: Make) -> None:
    h = make(capacity=3, port_range=(20000, 20999))
    assert repr(h.backend) == "<ProcessBackend in_use=0 capacity=3 ports=20000-20999>"
    await h.backend.close()
    with pytest.raises(StartFailed, match="closed"):
        await h.backend.start(h.launch("sleep 1000"))


# -- uvloop ---------------------------------------------------------------------------------

ON_UVLOOP = [
    test_replica_serves_on_its_port_from_its_working_dir,
    test_handle_names_the_process,
    test_a_port_is_held_by_one_replica_until_its_exit,
    test_exit_is_reported,
    test_commands_run_in_order_while_they_succeed,
    test_leftovers_of_an_exited_replica_are_ended,
    test_leftovers_that_ignore_sigterm_get_sigkill_after_the_grace,
    test_stop_ends_the_whole_process_group,
    test_sigkill_after_grace_when_sigterm_is_ignored,
    test_stop_is_idempotent_and_reports_once,
    test_logs_are_captured_and_capped_with_one_rotation,
    test_rotation_copies_the_tail_and_the_writer_appends_after_the_truncation,
    test_the_log_check_runs_periodically,
    test_adopt_after_restart_then_stop,
    test_a_restart_leaves_the_replica_running_and_writing_its_log,
    test_adopted_replica_exit_is_reported,
    test_adopt_refuses_a_process_that_is_not_the_replica,
]


@pytest.mark.parametrize("case", ON_UVLOOP, ids=lambda case: case.__name__)
def test_on_uvloop(case: Callable[..., Any], tmp_path: Path, scripts: Path) -> None:
    """The gateway runs on uvloop, whose subprocess and pipe transports are not asyncio's:
    the tests above again, on a uvloop loop."""

    async def run() -> None:
        notifier = Notifier()
        await notifier.open()
        make, made = maker(tmp_path, notifier, scripts)
        given: dict[str, Any] = {"make": make, "tmp_path": tmp_path, "scripts": scripts}
        given |= {"command": "exit 3", "code": 3, "reason": "exited with code 3"}
        given |= {"restart": "in-process"}
        wanted = inspect.signature(case).parameters
        try:
            await case(**{name: given[name] for name in wanted})
        finally:
            for harness in made:
                await harness.cleanup()
            await notifier.close()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        loop = runner.get_loop()
        assert type(loop).__module__.startswith("uvloop")
        runner.run(run())
