"""Running one client command: its errors become one line on standard error and an exit
code; a closed standard output (``| head``) ends it quietly."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TextIO

import aiohttp

from .admin_api import Client
from .commands import COMMANDS
from .exits import EXIT_UNUSABLE, CliError, closed_stdout
from .target import REQUEST_TIMEOUT, resolve_target


async def run_command(
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run the client command ``args`` name; errors become one line on ``err`` and an exit
    code."""
    out = out or sys.stdout
    err = err or sys.stderr
    command = COMMANDS[args.command]
    try:
        target = resolve_target(args)
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await command(Client(session, target), args, out)
    except CliError as e:
        print(f"gateway: {e.message}", file=err)
        return e.code
    except (aiohttp.InvalidURL, ValueError) as e:
        print(f"gateway: {e}", file=err)
        return EXIT_UNUSABLE


def run(args: argparse.Namespace) -> int:
    """``run_command`` on its own event loop, as the ``gateway`` command runs it."""
    try:
        code = asyncio.run(run_command(args))
        sys.stdout.flush()  # here, not at exit, where a closed pipe would be reported
        return code
    except BrokenPipeError:
        return closed_stdout()
    except KeyboardInterrupt:
        print("gateway: interrupted", file=sys.stderr)
        return 130
