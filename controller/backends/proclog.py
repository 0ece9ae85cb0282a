"""Replica logs: a file the replica writes to itself, kept small by copy-and-truncate.

A replica's stdout and stderr are both a descriptor of ``<replica_id>.log`` opened with
``O_WRONLY | O_APPEND | O_CREAT``: no pipe runs through the gateway, so a replica keeps
writing (and keeps running) while no gateway process exists, as during a restart.

The gateway cannot cap what a replica writes as it writes it; it caps the file afterwards, as
logrotate's ``copytruncate`` does. ``rotate_if_over`` finds a log longer than ``max_bytes``,
copies its last ``max_bytes`` to ``<replica_id>.log.1`` (replacing the rotation before it) and
truncates the live file to zero. Every writer appends (``O_APPEND``), so each next write lands
at the new end, offset 0, without a hole. Between two checks a log may grow past the cap by
what the replica writes in that time; on disk a replica holds ``max_bytes`` in its rotation
plus its live file.

Known window: what the replica writes between the last read of the copy and the truncation
(one system call apart) is lost; so is what it writes during the copy past
``READ_SLACK`` bytes (a replica that writes faster than the gateway can read). A rotation cuts
at a byte count, so the first line of ``.log.1`` may be partial.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

READ_SLACK = 1024 * 1024
"""During a copy, how much more than ``max_bytes`` is read while the replica keeps writing."""
_CHUNK = 64 * 1024


def rotated(path: Path) -> Path:
    """The one rotation kept of log ``path``."""
    return path.with_name(path.name + ".1")


def open_for_replica(path: Path) -> int:
    """A descriptor of ``path`` for a replica's stdout and stderr (appending; created if need
    be). Close-on-exec: the replica gets it by ``dup2``, nothing else the gateway spawns does.
    Raises OSError."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
    return os.open(path, flags, 0o666)


def rotate_if_over(path: Path, max_bytes: int) -> bool:
    """Copy-and-truncate ``path`` if it holds more than ``max_bytes``; True if it did.

    Never raises: a log that cannot be rotated is a warning, not a failure of the replica.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError as exc:
        log.warning("log %s: cannot open it to rotate: %s", path, exc)
        return False
    try:
        size = os.fstat(fd).st_size
        if size <= max_bytes:
            return False
        # Read to the end, not just to ``size``, then truncate at once: the replica keeps
        # writing meanwhile, and only what it writes after the last read is lost.
        os.lseek(fd, size - max_bytes, os.SEEK_SET)
        kept = bytearray()
        budget = max_bytes + READ_SLACK
        while budget > 0 and (chunk := os.read(fd, min(_CHUNK, budget))):
            kept += chunk
            budget -= len(chunk)
            del kept[:-max_bytes]
        os.ftruncate(fd, 0)
    except OSError as exc:
        log.warning("log %s: cannot rotate it: %s", path, exc)
        return False
    finally:
        os.close(fd)
    target = rotated(path)
    partial = target.with_name(target.name + ".tmp")
    try:
        partial.write_bytes(kept)
        os.replace(partial, target)
    except OSError as exc:
        log.warning("log %s: cannot write its rotation %s: %s", path, target, exc)
    return True


def tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of the rotation and the live log of ``path`` together."""
    if lines <= 0:
        return []
    data = b""
    for part in (rotated(path), path):
        try:
            data += part.read_bytes()
        except OSError:  # not written yet, or rotated away under us
            continue
    return data.decode("utf-8", "replace").splitlines()[-lines:]


LAST_LINE_MAX = 200
"""Characters of a crashed replica's last output line kept in its exit reason."""


def last_line(path: Path, window: int = 4096) -> str:
    """The last non-empty line of the live log of ``path`` (from its last ``window`` bytes),
    cut to ``LAST_LINE_MAX`` characters; empty when there is none."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(0, size - window))
            data = f.read()
    except OSError:
        return ""
    lines = [x.strip() for x in data.decode("utf-8", "replace").splitlines() if x.strip()]
    if not lines:
        return ""
    line = lines[-1]
    return line if len(line) <= LAST_LINE_MAX else line[: LAST_LINE_MAX - 1] + "…"
