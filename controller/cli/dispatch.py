"""The client commands on the ``gateway`` parser, and running one: its errors become one line
on standard error and an exit code; a closed standard output (``| head``) ends it quietly."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from typing import TextIO

import aiohttp

from .client import REQUEST_TIMEOUT, TOKEN_ENV, URL_ENV, Client, resolve_target
from .commands import (
    Command,
    cmd_apply,
    cmd_delete,
    cmd_drain,
    cmd_logs,
    cmd_rollout,
    cmd_scale,
    cmd_status,
    cmd_token,
)
from .exits import EXIT_CODES, EXIT_PIPE, EXIT_UNUSABLE, CliError


async def run_command(
    command: Command,
    args: argparse.Namespace,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """Run one client command; errors become one line on ``err`` and an exit code."""
    out = out or sys.stdout
    err = err or sys.stderr
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


def _runner(command: Command) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            code = asyncio.run(run_command(command, args))
            sys.stdout.flush()  # here, not at exit, where a closed pipe would be reported
            return code
        except BrokenPipeError:
            # The reader went away (``| head``): end quietly, as a tool killed by SIGPIPE
            # does. What is still buffered goes nowhere, so the flush at exit cannot fail.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_PIPE
        except KeyboardInterrupt:
            print("gateway: interrupted", file=sys.stderr)
            return 130

    return run


def add_follow_options(parser: argparse.ArgumentParser) -> None:
    """The options of a command that follows what it started until its outcome."""
    parser.add_argument(
        "--no-wait", action="store_true", help="return at once; do not follow the change"
    )
    parser.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="stop following after this long (exit 1; the change goes on)",
    )


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register the client commands on the ``gateway`` parser's subcommands."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--admin", metavar="URL", help=f"admin API URL (${URL_ENV})")
    common.add_argument("--token", help=f"admin API token (${TOKEN_ENV})")
    common.add_argument("-c", "--config", help="a gateway config to find the admin API in")
    common.add_argument("--json", action="store_true", help="machine-readable output")

    def add(name: str, command: Command, help: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(
            name,
            parents=[common],
            help=help,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.set_defaults(func=_runner(command), client_command=command, command=name)
        return parser

    apply = add("apply", cmd_apply, "apply a service spec and follow its rollout or scale")
    apply.add_argument("-f", "--file", required=True, help="a YAML or JSON service spec")
    apply.add_argument("--dry-run", action="store_true", help="only show what would change")
    add_follow_options(apply)

    status = add("status", cmd_status, "services, or one service's replicas")
    status.add_argument("name", nargs="?")
    status.add_argument("--all", action="store_true", help="stopped and failed replicas too")

    # No common options on "rollout" itself: argparse would let its defaults override the
    # values given after the action ("rollout status --json web").
    rollout = sub.add_parser("rollout", help="watch and control rollouts")
    rollout.set_defaults(func=_runner(cmd_rollout), client_command=cmd_rollout, command="rollout")
    actions = rollout.add_subparsers(dest="rollout_command", required=True)
    for action, text in (
        ("status", "the active rollout, or the last one"),
        ("history", "every rollout, newest first"),
        ("pause", "pause the active rollout"),
        ("resume", "resume a paused rollout and follow it"),
        ("promote", "skip the remaining steps (a canary to 100%, blue/green switched) and follow"),
        ("abort", "stop the rollout, go back to the revision it started from and follow that"),
        ("undo", "roll back to the previous revision (or --to-revision) and follow it"),
    ):
        parser = actions.add_parser(
            action,
            parents=[common],
            help=text,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("name")
        if action == "undo":
            parser.add_argument("--to-revision", type=int, metavar="N")
        if action in ("resume", "promote", "abort", "undo"):
            add_follow_options(parser)

    scale = add("scale", cmd_scale, "set a service's replica count and follow the scale")
    scale.add_argument("name")
    scale.add_argument("replicas", type=int)
    add_follow_options(scale)

    for name, text in (("drain", "send no new requests to an upstream"),
                       ("undrain", "take a manual drain back")):  # fmt: skip
        parser = add(name, cmd_drain, text)
        parser.add_argument("name")
        parser.add_argument("upstream")

    logs = add("logs", cmd_logs, "a service's replica output")
    logs.add_argument("name")
    logs.add_argument("--replica", metavar="ID")
    logs.add_argument("--tail", type=int, default=100)
    logs.add_argument(
        "--failed",
        action="store_true",
        help="the failed replicas' logs (by default: the live ones, or the last failed one)",
    )

    delete = add("delete", cmd_delete, "drain and stop a service, then forget it")
    delete.add_argument("name")

    # Like "rollout": the common options on each action, none on "token" itself.
    token = sub.add_parser("token", help="a service's bearer tokens (auth)")
    token.set_defaults(func=_runner(cmd_token), client_command=cmd_token, command="token")
    token_actions = token.add_subparsers(dest="token_command", required=True)
    for action, text in (
        ("list", "the service's tokens by id"),
        ("add", "add a token (made and printed once, or read from --stdin)"),
        ("revoke", "revoke a token added through the API"),
    ):
        parser = token_actions.add_parser(
            action,
            parents=[common],
            help=text,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        parser.add_argument("name")
        if action == "add":
            parser.add_argument("--label", default="", help="who or what the token is for")
            parser.add_argument(
                "--stdin", action="store_true", help="read the token from standard input"
            )
        elif action == "revoke":
            parser.add_argument("id")
