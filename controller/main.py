"""The command line: ``gateway serve``, ``gateway native`` and the admin API's client commands.

``gateway serve`` is an entry point of the data plane: it puts the compiled modules on the
package's path (``gateway.native.use``) before anything imports them, then reads and checks
the config, and only then imports the event loop and the composition root
(``controller.serving``). So this module imports only what the command line needs at its top.
"""

from __future__ import annotations

import argparse
import logging
import sys

from gateway import native

from .cli.exits import closed_stdout
from .cli.parser import add_commands as add_client_commands
from .config import ConfigError, load_config
from .errors import StartRefused

log = logging.getLogger("gateway")


def serve_main(args: argparse.Namespace) -> int:
    try:
        native.use()  # first: the compiled data plane, if built from these sources
    except ImportError as e:  # GATEWAY_NATIVE=1 and it cannot be used
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    try:
        loaded = load_config(args.config, workers=args.workers)
        token = loaded.config.admin_token()
    except ConfigError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 2
    from .admin.app import is_loopback

    listen = loaded.config.admin.listen
    if token is None and not is_loopback(listen):
        print(
            f"gateway: admin.listen {listen} is not a loopback address and no admin token is "
            "configured (set admin.token_file, or the variable named by admin.token_env)",
            file=sys.stderr,
        )
        return 2
    level = loaded.config.log_level.upper()
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    if token is None:
        log.warning("no admin token configured: the admin API on %s is open to local users", listen)
    del token  # run_gateway reads it again; it is never logged
    import uvloop

    from .serving import serve

    try:
        uvloop.run(serve(loaded))
    except StartRefused as e:  # nothing was touched: the running gateway, if any, serves on
        print(f"gateway: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"gateway: {e}", file=sys.stderr)
        return 1
    return 0


def _workers_arg(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of workers or 'auto': {value!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gateway",
        description="A load-balancing gateway: health-gated routing, zero-downtime rollouts.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("-c", "--config", default="configs/gateway.yaml")
    serve.add_argument(
        "--workers",
        type=_workers_arg,
        metavar="N",
        help="processes serving traffic (overrides the config's workers): 1 = this process, "
        "N > 1 worker processes, auto = one per CPU",
    )
    serve.set_defaults(func=serve_main)
    build = sub.add_parser(
        "native", help="build the compiled data plane (mypyc), or say whether it is used"
    )
    build.add_argument("action", choices=["build", "status"])
    build.add_argument(
        "--no-profile",
        action="store_true",
        help="build: compile once, without the training load's profile (half the time)",
    )
    build.set_defaults(func=native_main)
    add_client_commands(sub)
    return parser


def native_main(args: argparse.Namespace) -> int:
    if args.action == "build":
        try:
            profile = native.build(profile=not args.no_profile)
        except (OSError, native.BuildError) as e:
            print(f"gateway: the compiled data plane was not built: {e}", file=sys.stderr)
            return 1
        print(f"profile: {profile}")
    print(native.status())
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    """The ``gateway`` command. A closed standard output (``| head``) ends any of it quietly
    with 141, its help included: flushed here, where that is caught, not at exit."""
    try:
        try:
            args = build_parser().parse_args(argv)  # --help prints, then raises SystemExit
            code: int = args.func(args)
        finally:
            sys.stdout.flush()
    except BrokenPipeError:
        return closed_stdout()
    return code


if __name__ == "__main__":
    sys.exit(cli_main())
