"""The ``gateway`` client commands on the command line: their argparse subcommands.

Registering them imports no HTTP client: ``gateway serve`` builds the same parser. A command
runs through ``dispatch.run``, imported when it runs.
"""

from __future__ import annotations

import argparse

from .exits import EXIT_CODES
from .target import TOKEN_ENV, URL_ENV


def _run(args: argparse.Namespace) -> int:
    from .dispatch import run

    return run(args)


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

    def command(
        into: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help: str
    ) -> argparse.ArgumentParser:
        return into.add_parser(
            name,
            parents=[common],
            help=help,
            epilog=EXIT_CODES,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    def add(name: str, help: str) -> argparse.ArgumentParser:
        parser = command(sub, name, help)
        parser.set_defaults(func=_run, command=name)
        return parser

    def group(
        name: str, help: str, actions: tuple[tuple[str, str], ...]
    ) -> list[tuple[str, argparse.ArgumentParser]]:
        """A command made of actions (``rollout status``), each action's parser. The common
        options go on each action, none on the command itself: argparse would let their
        defaults override the values given after the action (``rollout status --json web``)."""
        parser = sub.add_parser(name, help=help)
        parser.set_defaults(func=_run, command=name)
        into = parser.add_subparsers(dest=f"{name}_command", required=True)
        return [(action, command(into, action, text)) for action, text in actions]

    apply = add("apply", "apply a service spec and follow its rollout or scale")
    apply.add_argument("-f", "--file", required=True, help="a YAML or JSON service spec")
    apply.add_argument("--dry-run", action="store_true", help="only show what would change")
    add_follow_options(apply)

    status = add("status", "services, or one service's replicas")
    status.add_argument("name", nargs="?")
    status.add_argument("--all", action="store_true", help="stopped and failed replicas too")

    rollout_actions = (
        ("status", "the active rollout, or the last one"),
        ("history", "every rollout, newest first"),
        ("pause", "pause the active rollout"),
        ("resume", "resume a paused rollout and follow it"),
        ("promote", "skip the remaining steps (a canary to 100%%, blue/green switched) and follow"),
        ("abort", "stop the rollout, go back to the revision it started from and follow that"),
        ("undo", "roll back to the previous revision (or --to-revision) and follow it"),
    )
    for action, parser in group("rollout", "watch and control rollouts", rollout_actions):
        parser.add_argument("name")
        if action == "undo":
            parser.add_argument("--to-revision", type=int, metavar="N")
        if action in ("resume", "promote", "abort", "undo"):
            add_follow_options(parser)

    scale = add("scale", "set a service's replica count and follow the scale")
    scale.add_argument("name")
    scale.add_argument("replicas", type=int)
    add_follow_options(scale)

    for name, text in (("drain", "send no new requests to an upstream"),
                       ("undrain", "take a manual drain back")):  # fmt: skip
        parser = add(name, text)
        parser.add_argument("name")
        parser.add_argument("upstream")

    logs = add("logs", "a service's replica output")
    logs.add_argument("name")
    logs.add_argument("--replica", metavar="ID")
    logs.add_argument("--tail", type=int, default=100)
    logs.add_argument(
        "--failed",
        action="store_true",
        help="the failed replicas' logs (by default: the live ones, or the last failed one)",
    )

    delete = add("delete", "drain and stop a service, then forget it")
    delete.add_argument("name")

    token_actions = (
        ("list", "the service's tokens by id"),
        ("add", "add a token (made and printed once, or read from --stdin)"),
        ("revoke", "revoke a token added through the API"),
    )
    for action, parser in group("token", "a service's bearer tokens (auth)", token_actions):
        parser.add_argument("name")
        if action == "add":
            parser.add_argument("--label", default="", help="who or what the token is for")
            parser.add_argument(
                "--stdin", action="store_true", help="read the token from standard input"
            )
        elif action == "revoke":
            parser.add_argument("id")
