"""An ``ssh://user@host`` engine: the remote engine's socket forwarded to a local unix socket.

One ``ssh -nNT -L LOCAL.sock:REMOTE.sock`` child per host, which the backend supervises: it is
started again with backoff whenever it ends (the network went away, the remote sshd
restarted), and the engine client speaks HTTP over the local socket as over any unix engine.
``BatchMode`` (no prompt: a key or an agent), ``ExitOnForwardFailure`` (no child without its
forward), keep-alives (a dead link ends the child within ~10 s). The child is stopped, by its
pid, when the backend closes; the local socket is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

BACKOFF_FIRST, BACKOFF_MAX = 0.5, 10.0
STABLE = 30.0
"""A child that ran this long starts the backoff over when it ends."""
SOCKET_WAIT = 10.0
STOP_WAIT = 5.0


@dataclass(frozen=True, slots=True)
class SshOptions:
    """How to reach an ``ssh://`` engine's host."""

    identity_file: str | None = None
    known_hosts_file: str | None = None
    """None: ssh's own (``~/.ssh/known_hosts``); the host key is checked either way."""
    socket: str = "/var/run/docker.sock"
    """The engine's socket on the remote host."""


def ssh_command(engine: str, local: str, options: SshOptions) -> list[str]:
    """The ``ssh`` command line forwarding ``local`` to the engine's remote socket."""
    parts = urlsplit(engine)
    if parts.scheme != "ssh" or not parts.hostname:
        raise ValueError(f"not an ssh engine: {engine!r} (ssh://USER@HOST[:PORT])")
    command = [
        "ssh",
        "-nNT",
        "-o", "BatchMode=yes",
        "-o", "ExitOnForwardFailure=yes",
        "-o", "StreamLocalBindUnlink=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", "ServerAliveInterval=5",
        "-o", "ServerAliveCountMax=2",
    ]  # fmt: skip
    if parts.port:
        command += ["-p", str(parts.port)]
    if options.identity_file is not None:
        command += ["-i", options.identity_file, "-o", "IdentitiesOnly=yes"]
    if options.known_hosts_file is not None:
        command += ["-o", f"UserKnownHostsFile={options.known_hosts_file}"]
    destination = parts.hostname if parts.username is None else f"{parts.username}@{parts.hostname}"
    return [*command, "-L", f"{local}:{options.socket}", destination]


class Tunnel:
    """The supervised ``ssh`` child of one host. ``run`` until cancelled; ``ready`` is set
    while the local socket takes connections."""

    def __init__(self, engine: str, local: str, options: SshOptions) -> None:
        self.engine = engine
        self.local = local
        self.command = ssh_command(engine, local, options)
        self.ready = asyncio.Event()
        self.starts = 0
        self.error = ""
        """Why the last child ended (its last line on stderr)."""
        self._process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        process = self._process
        return None if process is None or process.returncode is not None else process.pid

    async def run(self) -> None:
        backoff = BACKOFF_FIRST
        loop = asyncio.get_running_loop()
        try:
            while True:
                began = loop.time()
                await self._once()
                if loop.time() - began >= STABLE:
                    backoff = BACKOFF_FIRST
                log.warning(
                    "ssh tunnel to %s ended (%s); again in %.1fs", self.engine, self.error, backoff
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
        finally:
            await self._stop()

    async def _once(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local)
        self.starts += 1
        process = await asyncio.create_subprocess_exec(
            *self.command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        self._process = process
        assert process.stderr is not None
        reading = asyncio.ensure_future(process.stderr.read())
        try:
            # The forward listens once the socket exists (ExitOnForwardFailure: or ssh ends).
            loop = asyncio.get_running_loop()
            deadline = loop.time() + SOCKET_WAIT
            while process.returncode is None and not await self._listening():
                if loop.time() > deadline:
                    process.terminate()
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(reading), 0.05)
            if process.returncode is None:
                self.ready.set()
            output = await reading
            await process.wait()
        finally:
            self.ready.clear()
            if not reading.done():
                reading.cancel()
        lines = output.decode("utf-8", "replace").strip().splitlines()
        self.error = lines[-1] if lines else f"exit status {process.returncode}"

    async def _listening(self) -> bool:
        try:
            _, writer = await asyncio.open_unix_connection(self.local)
        except OSError:
            return False
        writer.close()
        return True

    async def _stop(self) -> None:
        self.ready.clear()
        process = self._process
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(asyncio.shield(process.wait()), STOP_WAIT)
            except TimeoutError:
                process.kill()
                await process.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.local)

    def __repr__(self) -> str:
        state = "ready" if self.ready.is_set() else "down"
        return f"<Tunnel {self.engine} {state} starts={self.starts}>"
