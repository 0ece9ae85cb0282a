"""The processes a benchmark starts, and what ``/proc`` says of them.

Every process gets its own process group and is stopped by pid (its group), never by name:
``Procs.stop_all`` in a ``finally`` block ends all of them. CPU time and memory are read from
``/proc/<pid>/stat`` and ``/proc/<pid>/status`` over a process tree (an nginx master and its
worker count together), so a figure is the target's own, not wrk's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

BODY = b"Hello, world\n"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Failure(Exception):
    """The benchmark cannot go on; ``str()`` says why."""


def raise_nofile() -> int:
    """Raise this process's open-file limit to its hard limit (children inherit it).

    wrk at 256 connections and the 10,000 idle connections need more than the usual 1,024.
    Returns the limit now in force.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ---------------------------------------------------------------------------------------------
# processes


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Procs:
    """Everything the benchmark started; ``stop_all`` ends each one by its process group."""

    tmp: Path
    started: list[Proc] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: list[str],
        cpu: int | None,
        stdin: int | None = subprocess.DEVNULL,
        env: dict[str, str] | None = None,
    ) -> Proc:
        """Start ``argv`` in its own session, pinned to ``cpu``, output in ``<tmp>/<name>.log``;
        ``env`` is added to this process's environment."""
        if cpu is not None:
            argv = ["taskset", "-c", str(cpu), *argv]
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                argv, stdin=stdin, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.tmp, env={**os.environ, **(env or {})},
            )  # fmt: skip
        proc = Proc(name, popen, log)
        self.started.append(proc)
        return proc

    def stop(self, proc: Proc, grace: float = 5.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``grace`` seconds."""
        if proc.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.popen.wait(grace)

    def finish(self, proc: Proc) -> None:
        """Stop ``proc`` and forget it (a short-lived helper such as one wrk run)."""
        try:
            self.stop(proc)
        finally:
            if proc.popen.stdin is not None:
                proc.popen.stdin.close()
            self.started.remove(proc)

    def stop_all_uninterrupted(self) -> None:
        """``stop_all`` with SIGTERM and SIGINT ignored meanwhile: a second signal must not
        cut the clean-up short."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            try:
                self.stop(proc)
            except Exception as e:  # keep stopping the others
                print(f"bench: could not stop {proc.name} (pid {proc.pid}): {e}", file=sys.stderr)
        # a group whose leader already left may still hold children
        for proc in self.started:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------
# /proc


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (an nginx master and its worker, say)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system time of these processes (all their threads), in seconds."""
    user, system = cpu_split(pids)
    return user + system


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """User and system time of these processes (all their threads), apart, in seconds."""
    user = system = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields:
            user += int(fields[11])  # utime
            system += int(fields[12])  # stime
    return user / CLK_TCK, system / CLK_TCK


WAKEUP_INTERRUPTS = ("RES", "CAL")
"""Rescheduling and function-call interrupts: what a core sends another to wake a task there
(on a virtual machine, each is an exit to the hypervisor)."""


def wakeup_interrupts() -> int | None:
    """``WAKEUP_INTERRUPTS`` taken so far, summed over every core (``/proc/interrupts``);
    None where the file cannot be read. Machine-wide: whatever else runs counts too."""
    try:
        lines = Path("/proc/interrupts").read_text().splitlines()
    except OSError:
        return None
    cores = len(lines[0].split()) if lines else 0
    total = 0
    for line in lines[1:]:
        name, _, counts = line.partition(":")
        if name.strip() in WAKEUP_INTERRUPTS:
            total += sum(int(n) for n in counts.split()[:cores] if n.isdigit())
    return total


def memory_mib(pids: list[int], key: str = "VmRSS") -> float:
    """The sum of one ``/proc/<pid>/status`` figure over ``pids``, in MiB.

    ``VmRSS`` is the resident set now, ``VmHWM`` its high-water mark since the start.
    """
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(f"{key}:"):
                    total += int(line.split()[1])
    return total / 1024


def open_fds(pids: list[int]) -> int:
    """How many file descriptors these processes hold (sockets included)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total


class RssSampler:
    """Samples the VmRSS of a fixed process tree from a thread, every ``interval`` seconds.

    Use as a context manager around a load run; ``samples`` holds ``(monotonic, MiB)`` pairs
    and ``max`` the largest. The thread only reads ``/proc``, so it costs the target nothing.
    """

    def __init__(self, pids: list[int], interval: float = 0.2) -> None:
        self.pids = pids
        self.interval = interval
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.monotonic(), memory_mib(self.pids)))
            if self._stop.wait(self.interval):
                return

    @property
    def max(self) -> float | None:
        return max((mib for _, mib in self.samples), default=None)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------------
# loopback


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def wait_serving(proc: Proc, url: str, deadline: float = 30.0) -> None:
    """Poll ``url`` until it answers 200 with the tiny body; bounded by ``deadline``."""
    end = time.monotonic() + deadline
    last = "no answer"
    while time.monotonic() < end:
        if proc.popen.poll() is not None:
            raise Failure(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            status, body = get(url, timeout=1.0)
            if status == 200 and body == BODY:
                return
            last = f"{status} {body[:200]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    raise Failure(f"{proc.name} not serving {url} after {deadline:.0f}s ({last}):\n{proc.tail()}")


# -- what every load benchmark does first -----------------------------------------------------

LOAD_TOOLS = ("wrk", "nginx", "taskset")


def missing_tool(tools: tuple[str, ...] = LOAD_TOOLS) -> str | None:
    """The first of ``tools`` not on PATH, or None."""
    return next((tool for tool in tools if shutil.which(tool) is None), None)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def stop_on_signals() -> None:
    """SIGTERM and SIGINT (even when started in the background) end the run through the
    ``finally`` blocks that stop every process started."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)


def work_dir(name: str) -> Path:
    """A fresh temporary directory for one run's configs and logs."""
    tmp = Path(tempfile.mkdtemp(prefix=f"gateway-{name}-"))
    tmp.chmod(0o755)  # nginx workers run as nobody when started by root
    return tmp
