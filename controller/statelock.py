"""The state directory's lock: one gateway process a state directory.

``StateLock.take`` opens ``<state_dir>/gateway.lock``, takes an exclusive ``flock`` on it
without waiting and writes this process's pid into it. The lock belongs to that open file
description: it lasts until ``release`` or the process's end (the kernel drops it at exit,
SIGKILL included, so a stale file never locks anyone out). The descriptor is not inherited,
so a replica or a worker started meanwhile never holds it.

A second taker (another process, or another open of the file in this one) gets
``StateDirInUse`` naming the holder's pid, and the directory is left as it was: the file's
pid is written only under the lock.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from .errors import StateDirInUse

LOCK_FILE = "gateway.lock"


class StateLock:
    """An exclusive ``flock`` on ``<state_dir>/gateway.lock``, held until ``release``."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, state_dir: Path) -> StateLock:
        """The lock of ``state_dir``, or ``StateDirInUse`` if another holds it."""
        path = state_dir / LOCK_FILE
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _pid(fd)
            os.close(fd)
            raise StateDirInUse(state_dir, path, holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(path, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock (closing the file drops it). The pid is left in the file: it counts
        only while the file is locked."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> StateLock:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"<StateLock {self.path} held={self.held}>"


def _pid(fd: int) -> int | None:
    """The pid the holder wrote, or None if it has not written it yet."""
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (IndexError, ValueError):
        return None
