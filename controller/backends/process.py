"""The process backend: replicas as local subprocesses, each in a process group of its own.

Invariants:

- A replica is one ``/bin/sh -c`` process (its script: ``procshell``) started in a new
  session, so its pid is also its process group id. Signals go to that group, by the pgid
  recorded at start (or verified at adoption), and never to anything else: never to group 0
  or 1, never to the gateway's own.
- A slot (counted against ``capacity``) and a port are held from the moment ``start`` accepts a
  launch until the replica's exit has been reported. Two replicas of one backend never share a
  port.
- A replica is over when its group is over. When its main process ends (on its own or on
  ``stop``), the exit is reported as soon as no live member of its group is left: at once in
  the common case; otherwise the rest of the group gets SIGTERM (on ``stop`` it already had
  it) and, after the grace (``stop_grace_default``, or the one ``stop`` gave), SIGKILL. If
  members outlast SIGKILL by ``GROUP_GONE_AFTER_KILL``, the exit is reported anyway after a
  last SIGKILL to the group.
- Each exit is reported exactly once, to the exit handler; ``stop`` returns only after that
  report. The replica's log is size-checked before the report.

Environment: a replica does not inherit the gateway's environment (which may hold the admin
token or cloud credentials). It starts from ``base_env`` (by default ``PATH``, ``HOME``,
``LANG``, ``LC_ALL``, ``TZ`` and ``TMPDIR`` of the gateway, and ``PYTHONUNBUFFERED=1``), then the
template's ``env``, then what the backend sets and the template cannot override: ``PORT``,
``HOST``, ``REPLICA_ID``, ``SERVICE`` and ``REVISION``.

Exit detection: no pipe joins a replica to the gateway, so what is watched is its main
process: through the child watcher of ``asyncio.create_subprocess_exec`` for a replica we
spawned (its exit status is known), through a pidfd (or ``/proc`` every 0.5 s where pidfds are
missing) for an adopted one (not our child: ``code`` is None). The rest of the group is then
polled (``procfs.group_gone``), every 10 ms at first and 100 ms at most, until it is gone.

Logs: stdout and stderr are a descriptor of ``<log_dir>/<replica_id>.log`` opened for
appending, so a replica writes its log itself and needs no gateway process to do so (see
``proclog``). One timer per backend (every ``log_check_interval``), ``logs()`` and each exit
report copy-and-truncate a log over ``log_max_bytes`` into ``<replica_id>.log.1``. Logs stay
after the replica ends.

Adoption (after a gateway restart): a replica is taken back when ``/proc/<pid>/stat`` still
shows the start time and process group of its handle, so a reused pid is never mistaken for
it. It has written to its log file all along, and keeps doing so. A replica with no record
to adopt it by (its gateway was killed between the spawn and the record's write) is found
by its log instead: ``sweep``, once adoption is done, stops every group leader whose standard
output is a ``<log_dir>/<id>.log`` of no replica of the backend.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import re
import signal
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import BackendError, NoCapacity, StartFailed
from ..tasks import guarded_task
from . import procfs, proclog
from .base import Exit, ExitHandler, Launch, Running
from .procshell import exit_reason, shell_script

if TYPE_CHECKING:
    from .base import Backend

log = logging.getLogger(__name__)

MiB = 1024 * 1024
INHERITED_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR")
"""Names a replica's environment takes from the gateway's (when ``base_env`` is not given)."""
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
NO_CAPACITY_RETRY_AFTER = 5.0
GROUP_GONE_AFTER_KILL = 1.0
"""After SIGKILL, how long members of the group (in uninterruptible sleep, say) may linger
before the exit is reported anyway."""
_REPLICA_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


def _conforms(backend: ProcessBackend) -> Backend:  # pragma: no cover - checked by mypy
    return backend


class ProcessBackend:
    """Runs each replica's commands with ``/bin/sh -c`` as a local process group."""

    name: str = "process"

    def __init__(
        self,
        capacity: int | None,
        port_range: tuple[int, int],
        log_dir: Path,
        log_max_bytes: int = MiB,
        stop_grace_default: float = 10.0,
        host: str = "127.0.0.1",
        base_env: Mapping[str, str] | None = None,
        log_check_interval: float = 1.0,
    ) -> None:
        low, high = port_range
        if not 0 < low <= high < 65536:
            raise ValueError(f"not a port range: {low}-{high}")
        if capacity is not None and capacity < 0:
            raise ValueError("capacity must be at least 0")
        if log_max_bytes < 1:
            raise ValueError("log_max_bytes must be at least 1")
        if log_check_interval <= 0:
            raise ValueError("log_check_interval must be more than 0")
        self._capacity = capacity
        self._port_range = (low, high)
        self._log_dir = Path(log_dir)
        self._log_max_bytes = log_max_bytes
        self._log_check_interval = log_check_interval
        self._stop_grace_default = stop_grace_default
        self._host = host
        if base_env is None:
            base_env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
            base_env = {"PYTHONUNBUFFERED": "1", **base_env}
        self._base_env = dict(base_env)
        self._replicas: dict[str, _Replica] = {}
        self._exit_handler: ExitHandler | None = None
        self._log_timer: asyncio.TimerHandle | None = None
        self._closed = False

    # -- the Backend protocol -------------------------------------------------------------

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def in_use(self) -> int:
        return len(self._replicas)

    def set_exit_handler(self, handler: ExitHandler) -> None:
        self._exit_handler = handler

    async def start(self, launch: Launch) -> Running:
        """Spawn the replica; raises NoCapacity or StartFailed. A command that then fails
        (even "not found", status 127) is an exit, reported through the exit handler."""
        plan = self._prepare(launch)
        rid = launch.replica_id
        loop = asyncio.get_running_loop()
        try:
            # Reserve the slot and the port before the first await: concurrent starts must not
            # both pass the capacity check or pick the same port.
            replica = _Replica(
                launch=launch, port=plan.port, log_path=plan.log_path, done=loop.create_future()
            )
            self._replicas[rid] = replica
            try:
                # No pipe: the replica writes its log itself and outlives this process. Hazard:
                # asyncio kills a child whose transport is closed while it runs; nothing here
                # closes one (it closes itself once the child has exited).
                process = await asyncio.create_subprocess_exec(
                    "/bin/sh",
                    "-c",
                    plan.script,
                    start_new_session=True,
                    env=plan.env,
                    cwd=plan.cwd,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=plan.log_fd,
                    stderr=plan.log_fd,
                )
            except BaseException as exc:
                # On cancellation asyncio itself kills and reaps a process it had spawned.
                del self._replicas[rid]
                replica.done.set_result(None)  # a stop() that came meanwhile has nothing to wait
                if isinstance(exc, OSError):
                    raise StartFailed(f"cannot start replica {rid}: {exc}") from exc
                raise
        finally:
            os.close(plan.log_fd)  # the replica has its own copies
        pid = process.pid
        replica.pid = replica.pgid = pid
        stat = procfs.read_stat(pid)
        replica.start_time = stat.start_time if stat is not None else None
        replica.watcher = guarded_task(self._watch_child(replica, process), f"replica:{rid}")
        self._watch_logs()
        if replica.terminating:  # stop() came while we were spawning
            self._signal(replica, signal.SIGKILL if replica.killed.is_set() else signal.SIGTERM)
        log.info("started replica %s (pid %d, port %d)", rid, pid, plan.port)
        return self._running(replica)

    def _prepare(self, launch: Launch) -> _Plan:
        """Every check that can refuse a start, then the port, environment, script and log."""
        if self._closed:
            raise StartFailed("the process backend is closed")
        rid = launch.replica_id
        if rid in self._replicas:
            raise StartFailed(f"replica {rid} is already running")
        if not _REPLICA_ID.match(rid):
            raise StartFailed(f"replica id {rid!r} cannot name a log file")
        template = launch.template
        if not template.commands:
            raise StartFailed("the template has no command to run")
        if self._capacity is not None and self.in_use >= self._capacity:
            raise NoCapacity(
                f"no capacity: {self.in_use} of {self._capacity} slots in use",
                retry_after=NO_CAPACITY_RETRY_AFTER,
            )
        cwd = template.working_dir
        if cwd is not None and not Path(cwd).is_dir():
            what = "is not a directory" if Path(cwd).exists() else "does not exist"
            raise StartFailed(f"working directory {cwd} {what}")
        port = self._allocate_port(template.port)
        env = self._environment(launch, port)
        script = shell_script(template.commands, env.get("PATH", DEFAULT_PATH), cwd)
        log_path = self._log_path(rid)
        try:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            log_fd = proclog.open_for_replica(log_path)
        except OSError as exc:
            raise StartFailed(f"cannot open the log file {log_path}: {exc}") from exc
        return _Plan(port=port, env=env, script=script, cwd=cwd, log_path=log_path, log_fd=log_fd)

    async def stop(self, replica_id: str, grace: float) -> None:
        """SIGTERM to the replica's group, SIGKILL after ``grace``; returns once its exit was
        reported. Unknown or already ended replicas: nothing to do."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        if not replica.leader_exited:
            replica.stop_requested = True
        self._terminate(replica, max(grace, 0.0))
        await asyncio.shield(replica.done)

    def adopt(self, launch: Launch, handle: dict[str, Any]) -> Running | None:
        """Take back a replica of a previous gateway process if its pid still names it."""
        rid = launch.replica_id
        if self._closed:
            return None
        if rid in self._replicas:
            return self._running(self._replicas[rid])
        pid, pgid, port, start_time = (
            _int(handle, key) for key in ("pid", "pgid", "port", "start_time")
        )
        if pid is None or pgid is None or port is None or start_time is None:
            return None
        if not procfs.signalable(pgid) or not _REPLICA_ID.match(rid):
            return None
        loop = asyncio.get_running_loop()
        replica = _Replica(
            launch=launch,
            port=port,
            log_path=self._log_path(rid),
            done=loop.create_future(),
            pid=pid,
            pgid=pgid,
            start_time=start_time,
        )
        replica.exit_watch = procfs.watch_exit(
            pid, pgid, start_time, lambda: self._adopted_exited(replica)
        )
        if replica.exit_watch is None:
            return None  # gone, or its pid now names another process
        self._replicas[rid] = replica
        self._watch_logs()
        log.info("adopted replica %s (pid %d, port %d)", rid, pid, port)
        return self._running(replica)

    def kill_all(self) -> None:
        """SIGKILL to every replica's group now, reporting nothing: for a gateway that exits
        at once (a second signal) and must not leave them running."""
        for replica in self._replicas.values():
            self._signal(replica, signal.SIGKILL)

    async def sweep(self) -> list[str]:
        """Stop the replicas a previous gateway process of this log directory left running
        with nothing to adopt them by: spawned just before it was killed, before their record
        was written. Call it once adoption is done. SIGTERM to each group, SIGKILL after
        ``stop_grace_default``; returns their ids."""
        strays = {
            pid: rid
            for pid, rid in procfs.leaders_writing_to(self._log_dir, ".log").items()
            if rid not in self._replicas and procfs.signalable(pid)
        }
        for pid, rid in strays.items():
            log.warning(
                "stopping replica %s (pid %d): a previous gateway process left it running "
                "with no record to adopt it by",
                rid,
                pid,
            )
            procfs.signal_group(pid, signal.SIGTERM)
        await asyncio.gather(*(self._end_stray(pid) for pid in strays))
        return sorted(strays.values())

    async def _end_stray(self, pgid: int) -> None:
        killed = asyncio.Event()

        def kill() -> None:
            killed.set()
            procfs.signal_group(pgid, signal.SIGKILL)

        timer = asyncio.get_running_loop().call_later(self._stop_grace_default, kill)
        try:
            await procfs.group_gone(pgid, killed, GROUP_GONE_AFTER_KILL)
        finally:
            timer.cancel()

    def has_logs(self, replica_id: str) -> bool:
        """Whether this backend holds a log of the replica (its live file or its rotation):
        one it started, or adopted, here; kept after it ends."""
        if not _REPLICA_ID.match(replica_id):
            return False
        path = self._log_path(replica_id)
        return path.exists() or proclog.rotated(path).exists()

    def logs(self, replica_id: str, tail: int) -> list[str]:
        """The last ``tail`` lines of the replica's log and its rotation; kept after it ends.
        A log over ``log_max_bytes`` is rotated first."""
        if tail <= 0 or not _REPLICA_ID.match(replica_id):
            return []
        path = self._log_path(replica_id)
        proclog.rotate_if_over(path, self._log_max_bytes)
        return proclog.tail(path, tail)

    async def close(self) -> None:
        """Stop watching; leave every replica running for the next gateway process to adopt.

        A ``stop`` still waiting gets a BackendError. Replicas keep writing their logs (no
        longer size-checked until a gateway adopts them).
        """
        self._closed = True
        if self._log_timer is not None:
            self._log_timer.cancel()
            self._log_timer = None
        tasks: list[asyncio.Task[None]] = []
        for replica in self._replicas.values():
            if replica.watcher is not None and not replica.watcher.done():
                replica.watcher.cancel()
                tasks.append(replica.watcher)
            if replica.kill_timer is not None:
                replica.kill_timer.cancel()
            if replica.exit_watch is not None:
                replica.exit_watch.cancel()
            if not replica.done.done():
                if replica.stop_requested:
                    rid = replica.launch.replica_id
                    error = BackendError(f"the process backend closed while stopping {rid}")
                    replica.done.set_exception(error)
                else:
                    replica.done.cancel()
        self._replicas.clear()
        if tasks:
            await asyncio.wait(tasks)

    def __repr__(self) -> str:
        low, high = self._port_range
        return (
            f"<ProcessBackend in_use={self.in_use} capacity={self._capacity} "
            f"ports={low}-{high}{' closed' if self._closed else ''}>"
        )

    # -- logs -------------------------------------------------------------------------------

    def rotate_logs(self) -> list[str]:
        """The periodic check: copy-and-truncate each current replica's log that is over
        ``log_max_bytes``. Returns the ids of the replicas whose log was rotated."""
        return [
            rid
            for rid, replica in list(self._replicas.items())
            if proclog.rotate_if_over(replica.log_path, self._log_max_bytes)
        ]

    def _watch_logs(self) -> None:
        """Run the periodic check while there are replicas (one timer for all of them)."""
        if self._log_timer is None and not self._closed:
            loop = asyncio.get_running_loop()
            self._log_timer = loop.call_later(self._log_check_interval, self._on_log_timer)

    def _on_log_timer(self) -> None:
        self._log_timer = None
        try:
            self.rotate_logs()
        finally:
            if self._replicas:
                self._watch_logs()

    # -- starting ---------------------------------------------------------------------------

    def _allocate_port(self, fixed: int | None) -> int:
        held = {r.port: rid for rid, r in self._replicas.items()}
        if fixed is not None:
            if fixed in held:
                raise StartFailed(f"port {fixed} is held by replica {held[fixed]}")
            if not _bindable(self._host, fixed):
                raise StartFailed(f"port {fixed} on {self._host} is in use")
            return fixed
        low, high = self._port_range
        for port in range(low, high + 1):
            # Free to bind now; a process that takes it before the replica binds makes the
            # replica fail, which is then an ordinary exit.
            if port not in held and _bindable(self._host, port):
                return port
        raise StartFailed(f"port range {low}-{high} exhausted")

    def _environment(self, launch: Launch, port: int) -> dict[str, str]:
        env = dict(self._base_env)
        env.setdefault("PATH", DEFAULT_PATH)
        env.update(launch.template.env)
        env.update(
            PORT=str(port),
            HOST=self._host,
            REPLICA_ID=launch.replica_id,
            SERVICE=launch.service,
            REVISION=str(launch.revision),
        )
        return env

    def _log_path(self, replica_id: str) -> Path:
        return self._log_dir / f"{replica_id}.log"

    def _running(self, replica: _Replica) -> Running:
        return Running(
            replica_id=replica.launch.replica_id,
            host=self._host,
            port=replica.port,
            pid=replica.pid,
            handle={
                "pid": replica.pid,
                "pgid": replica.pgid,
                "port": replica.port,
                "start_time": replica.start_time,
                "log": str(replica.log_path),
            },
        )

    # -- watching ---------------------------------------------------------------------------

    async def _watch_child(self, replica: _Replica, process: asyncio.subprocess.Process) -> None:
        code = await asyncio.shield(process.wait())
        await self._finish(replica, code)

    def _adopted_exited(self, replica: _Replica) -> None:
        rid = replica.launch.replica_id
        replica.watcher = guarded_task(self._finish(replica, None), f"replica:{rid}")

    async def _finish(self, replica: _Replica, code: int | None) -> None:
        """The main process ended: wind the group down, then report the exit."""
        replica.leader_exited = True
        try:
            gone = await self._wind_down(replica)
        except Exception:  # a bug here must not lose the exit report
            log.exception("winding down replica %s", replica.launch.replica_id)
            gone = False
        self._report(replica, code, sweep=not gone)

    async def _wind_down(self, replica: _Replica) -> bool:
        """Let the rest of the group end, within the grace period; True once none is left,
        False when some outlasted SIGKILL by ``GROUP_GONE_AFTER_KILL``."""
        if not procfs.group_alive(replica.pgid):
            return True  # the common case: nothing to signal (the group id may be free now)
        if not replica.terminating:
            self._terminate(replica, self._stop_grace_default)
        return await procfs.group_gone(replica.pgid, replica.killed, GROUP_GONE_AFTER_KILL)

    def _report(self, replica: _Replica, code: int | None, sweep: bool) -> None:
        if sweep:
            # Nothing of the replica outlives its report. Only when members were seen alive:
            # a group id seen empty may already name another group.
            self._signal(replica, signal.SIGKILL)
        if replica.kill_timer is not None:
            replica.kill_timer.cancel()
            replica.kill_timer = None
        rid = replica.launch.replica_id
        if self._replicas.get(rid) is replica:
            del self._replicas[rid]
        proclog.rotate_if_over(replica.log_path, self._log_max_bytes)
        requested = replica.stop_requested
        if requested:
            reason = "stopped"
            if replica.killed.is_set():
                reason += f" (SIGKILL after {replica.kill_grace:g} s grace)"
        elif code is None:
            reason = "exited (exit status unknown: adopted after a restart)"
        else:
            # A replica that exits on its own often says why last: keep that with its code.
            # One killed by a signal was cut off; its last line says nothing of it.
            reason = exit_reason(code)
            if code >= 0 and (last := proclog.last_line(replica.log_path)):
                reason += f": {last}"
        event = Exit(replica_id=rid, code=code, reason=reason, requested=requested)
        log.info("replica %s: %s", rid, reason)
        if self._exit_handler is not None:
            try:
                self._exit_handler(event)
            except Exception:
                log.exception("exit handler failed for replica %s", rid)
        if not replica.done.done():
            replica.done.set_result(None)

    # -- signals ----------------------------------------------------------------------------

    def _terminate(self, replica: _Replica, grace: float) -> None:
        """SIGTERM to the group now (once), SIGKILL at the earliest deadline asked for."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if replica.kill_timer is None and not replica.killed.is_set():
            replica.kill_timer = loop.call_at(deadline, self._kill, replica)
            replica.kill_deadline, replica.kill_grace = deadline, grace
        elif replica.kill_timer is not None and deadline < replica.kill_deadline:
            replica.kill_timer.cancel()
            replica.kill_timer = loop.call_at(deadline, self._kill, replica)
            replica.kill_deadline, replica.kill_grace = deadline, grace
        if not replica.terminating:
            replica.terminating = True
            self._signal(replica, signal.SIGTERM)

    def _kill(self, replica: _Replica) -> None:
        replica.kill_timer = None
        replica.killed.set()
        self._signal(replica, signal.SIGKILL)

    def _signal(self, replica: _Replica, sig: signal.Signals) -> None:
        procfs.signal_group(replica.pgid, sig)


@dataclass(frozen=True, slots=True)
class _Plan:
    port: int
    env: dict[str, str]
    script: str
    cwd: str | None
    log_path: Path
    log_fd: int
    """Ours to close once the replica was spawned (or was not)."""


@dataclass(eq=False)
class _Replica:
    launch: Launch
    port: int
    log_path: Path
    done: asyncio.Future[None]
    """Resolved once the exit has been reported."""
    pid: int = 0
    pgid: int = 0
    start_time: int | None = None
    watcher: asyncio.Task[None] | None = None
    """Spawned: waits for the exit and reports it. Adopted: reports it, once told of it."""
    exit_watch: procfs.ExitWatch | None = None
    """Adopted only: tells of the main process's exit."""
    stop_requested: bool = False
    leader_exited: bool = False
    terminating: bool = False
    kill_timer: asyncio.TimerHandle | None = None
    kill_deadline: float = 0.0
    kill_grace: float = 0.0
    killed: asyncio.Event = field(default_factory=asyncio.Event)


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As servers do, so a port in TIME_WAIT after its last replica counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except PermissionError:
            return False
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return False
            raise StartFailed(f"cannot bind {host}:{port}: {exc}") from exc
    return True


def _int(handle: Mapping[str, Any], key: str) -> int | None:
    value = handle.get(key)
    return value if type(value) is int else None


__all__ = [
    "DEFAULT_PATH",
    "GROUP_GONE_AFTER_KILL",
    "INHERITED_ENV",
    "NO_CAPACITY_RETRY_AFTER",
    "MiB",
    "ProcessBackend",
    "exit_reason",
    "shell_script",
]
