"""A replica as the process backend spawns one, but by the test: what a gateway killed
between a replica's spawn and the write of its record leaves behind."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def spawn_stray(log: Path, script: str) -> int:
    """``/bin/sh -c script`` in a session of its own, its output appended to ``log`` (a
    ``<log_dir>/<replica id>.log`` for a replica): only its log names it. Its pid, which is
    also its process group's id; the caller reaps it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return os.posix_spawn(
            "/bin/sh",
            ["/bin/sh", "-c", script],
            os.environ,
            file_actions=[(os.POSIX_SPAWN_DUP2, out.fileno(), 1)],
            setsid=True,
        )


def reap(pid: int) -> None:
    """End a stray's group if it still runs, and reap it (the test spawned it)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
