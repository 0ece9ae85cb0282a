"""How a client command ends: its exit code, and ``CliError``, the one-line error that ends it
with one (never a traceback)."""

from __future__ import annotations

import os
import sys

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE, EXIT_DEGRADED = 0, 1, 2, 3
EXIT_PIPE = 141
EXIT_CODES = """exit codes:
  0    done (with --no-wait: accepted)
  1    refused by the gateway, a followed rollout failed, or --timeout reached (the change
       goes on)
  2    the gateway cannot be reached or refuses the token; a usage or config error
  3    degraded: a scale settled with fewer ready replicas than desired (they could not be
       placed or failed; the gateway keeps retrying with backoff)
  130  interrupted
  141  standard output closed (| head)"""


class CliError(Exception):
    """A one-line error for the user, with the exit code it ends the command with."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


def closed_stdout() -> int:
    """After a ``BrokenPipeError`` on standard output (its reader went away: ``| head``): end
    quietly, as a tool killed by SIGPIPE does. What is still buffered goes nowhere, so the
    flush at exit cannot fail."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_PIPE
