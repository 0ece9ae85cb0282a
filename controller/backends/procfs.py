"""The operating system's view of a replica's processes: who they are, whether the group
lives, signals to the group, and the exit of a process that is not our child.

A pid alone does not name a process across a gateway restart (pids are reused); a pid with the
start time of ``/proc/<pid>/stat`` does. Zombies count as gone: they run nothing, and one whose
parent does not reap it (a container without a reaping init) would otherwise live forever.
Signals go to a process group only, never to group 0 or 1 and never to the gateway's own.
Linux only, as the process backend is.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..tasks import wait_set

log = logging.getLogger(__name__)

POLL_INTERVAL = 0.5
"""Where pidfds are missing, how often ``/proc`` is read to see a watched process end."""
GROUP_POLL_FIRST = 0.01
GROUP_POLL_MAX = 0.1
_DEAD_STATES = ("Z", "X")


@dataclass(frozen=True, slots=True)
class Stat:
    """The fields of ``/proc/<pid>/stat`` the backend uses."""

    state: str
    pgrp: int
    start_time: int
    """Clock ticks after boot (field 22)."""


def read_stat(pid: int) -> Stat | None:
    """The stat of process ``pid``, or None when there is no such process (or no ``/proc``)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    try:
        # The command name (field 2) is in parentheses and may hold spaces and ')'.
        fields = data[data.rindex(b")") + 2 :].split()
        return Stat(state=fields[0].decode(), pgrp=int(fields[2]), start_time=int(fields[19]))
    except (ValueError, IndexError):
        return None


def is_alive(pid: int, pgid: int, start_time: int | None) -> bool:
    """True when ``pid`` still names the process started at ``start_time`` in group ``pgid``,
    and it is not a zombie."""
    stat = read_stat(pid)
    return (
        stat is not None
        and start_time is not None
        and stat.start_time == start_time
        and stat.pgrp == pgid
        and stat.state not in _DEAD_STATES
    )


def signalable(pgid: int) -> bool:
    """Whether ``pgid`` may name a replica's group: 0 is our own group to ``killpg`` (and the
    pgid before a spawn completes), 1 is init's."""
    return pgid > 1 and pgid != os.getpgrp()


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """``sig`` to every process of group ``pgid``; nothing if the group is gone or not one a
    replica can have."""
    if not signalable(pgid):
        return
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError:
        log.warning("not allowed to signal process group %d", pgid)


def group_alive(pgid: int) -> bool:
    """True while process group ``pgid`` has a member that is not a zombie.

    ``killpg(pgid, 0)`` answers the common case (an empty group) without reading ``/proc``;
    only when it finds someone is ``/proc`` scanned, to tell live members from zombies.
    """
    if not signalable(pgid):
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # a member exists, and it is not ours to signal: count it as alive
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for name in entries:
        if name.isdigit():
            stat = read_stat(int(name))
            if stat is not None and stat.pgrp == pgid and stat.state not in _DEAD_STATES:
                return True
    return False


def leaders_writing_to(directory: Path, suffix: str) -> dict[int, str]:
    """Leaders of live process groups (pid == pgid) whose standard output is a file
    ``<directory>/<name><suffix>``: pid -> name. Another user's processes are not seen."""
    base = os.path.realpath(directory)
    found: dict[int, str] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            target = os.readlink(f"/proc/{entry}/fd/1")
        except OSError:
            continue
        folder, _, name = target.removesuffix(" (deleted)").rpartition("/")
        if folder != base or not name.endswith(suffix) or len(name) == len(suffix):
            continue
        pid = int(entry)
        stat = read_stat(pid)
        if stat is not None and stat.pgrp == pid and stat.state not in _DEAD_STATES:
            found[pid] = name.removesuffix(suffix)
    return found


async def group_gone(pgid: int, killed: asyncio.Event, linger: float) -> bool:
    """Returns True once group ``pgid`` has no live member, polling at intervals that grow
    from ``GROUP_POLL_FIRST`` to ``GROUP_POLL_MAX``; False if members are still there
    ``linger`` seconds after ``killed`` was set (after SIGKILL: in uninterruptible sleep, say).
    """
    loop = asyncio.get_running_loop()
    delay = GROUP_POLL_FIRST
    give_up: float | None = None
    while group_alive(pgid):
        if killed.is_set():
            if give_up is None:
                give_up = loop.time() + linger
            elif loop.time() >= give_up:
                return False
            await asyncio.sleep(delay)
        else:  # the next poll, or SIGKILL, whichever comes first
            await wait_set(killed, delay)
        delay = min(delay * 2, GROUP_POLL_MAX)
    return True


class ExitWatch:
    """Calls ``on_exit`` once, on the event loop, when a process that is not our child ends:
    through a pidfd, or by reading ``/proc`` every ``POLL_INTERVAL`` where pidfds are missing.
    Make one with ``watch_exit``."""

    def __init__(
        self, pid: int, pgid: int, start_time: int, pidfd: int | None, on_exit: Callable[[], None]
    ) -> None:
        self._identity = (pid, pgid, start_time)
        self._pidfd = pidfd
        self._on_exit = on_exit
        self._poll: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        if pidfd is not None:
            self._loop.add_reader(pidfd, self._exited)
        else:
            self._poll = self._loop.call_later(POLL_INTERVAL, self._check)

    def cancel(self) -> None:
        """Stop watching (idempotent); ``on_exit`` is not called after this."""
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None

    def _check(self) -> None:
        self._poll = None
        if is_alive(*self._identity):
            self._poll = self._loop.call_later(POLL_INTERVAL, self._check)
        else:
            self._exited()

    def _exited(self) -> None:
        self.cancel()
        self._on_exit()


def watch_exit(
    pid: int, pgid: int, start_time: int, on_exit: Callable[[], None]
) -> ExitWatch | None:
    """Watch process ``pid`` if it is still the one started at ``start_time`` in group
    ``pgid``; None if it is not (gone, or its pid reused). Needs a running loop."""
    if not is_alive(pid, pgid, start_time):
        return None
    pidfd: int | None = None
    if hasattr(os, "pidfd_open"):
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return None
        except OSError:
            pidfd = None  # no pidfds in this kernel: poll /proc instead
    # Checked again now that a pidfd pins the process: it is still the one asked for.
    if not is_alive(pid, pgid, start_time):
        if pidfd is not None:
            os.close(pidfd)
        return None
    return ExitWatch(pid, pgid, start_time, pidfd, on_exit)
