"""The ``gateway`` CLI's client commands: a client of the admin API, nothing more.

``apply``, ``status``, ``rollout status|history|pause|resume|abort|undo``, ``scale``,
``drain``, ``undrain``, ``logs`` and ``delete``. Each finds the admin API from ``--admin`` /
``--token``, else ``GATEWAY_ADMIN_URL`` / ``GATEWAY_ADMIN_TOKEN``, else the gateway config
named by ``-c``, else ``http://127.0.0.1:8081``; each prints a table or, with ``--json``, the
API's JSON.

Exit codes (``EXIT_CODES``, shown by each command's ``--help``): 0 done; 1 refused by the
gateway, a followed rollout that failed (its reason printed), or ``--timeout`` reached; 2 the
gateway cannot be reached or refuses the token, or a usage or config error; 3 degraded: a
scale settled short of its count (``scale_outcome``); 141 the reader of standard output went
away (``| head``): the command ends quietly, as a tool killed by SIGPIPE does. Errors are one
line on standard error, never a traceback.

``apply``, ``scale`` and ``rollout resume|abort|undo`` follow what they start until its
outcome, unless ``--no-wait``: they listen to the server-sent events of the service and read
the service's state after each (and at least every ``POLL`` seconds, should the stream break),
printing a progress line whenever it changes. ``--timeout`` stops following; what was started
goes on.

Modules: ``admin_api`` (the calls to the admin API), ``following`` (a started
rollout or scale, until its outcome), ``render`` (the text printed), ``commands`` (one
coroutine per command), ``target`` (where the admin API is), ``parser`` (the argparse
subcommands), ``dispatch`` (running one), ``exits`` (the exit codes and ``CliError``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .admin_api import Client
    from .commands import (
        COMMANDS,
        Command,
        cmd_apply,
        cmd_delete,
        cmd_drain,
        cmd_logs,
        cmd_rollout,
        cmd_scale,
        cmd_status,
        pick_log_replicas,
    )
    from .dispatch import run_command
    from .exits import (
        EXIT_CODES,
        EXIT_DEGRADED,
        EXIT_FAILED,
        EXIT_OK,
        EXIT_PIPE,
        EXIT_UNUSABLE,
        CliError,
    )
    from .following import (
        GONE,
        PAUSED_BY_REQUEST,
        PENDING,
        POLL,
        Follow,
        ScaleOutcome,
        follow,
        follow_change,
        replica_ids,
        scale_outcome,
    )
    from .parser import add_commands, add_follow_options
    from .render import describe_apply, progress_text, revision_text, revisions_text, table
    from .target import (
        DEFAULT_URL,
        REQUEST_TIMEOUT,
        TOKEN_ENV,
        URL_ENV,
        Target,
        admin_url,
        resolve_target,
    )

_WHERE = {
    "COMMANDS": ".commands",
    "CliError": ".exits",
    "Client": ".admin_api",
    "Command": ".commands",
    "DEFAULT_URL": ".target",
    "EXIT_CODES": ".exits",
    "EXIT_DEGRADED": ".exits",
    "EXIT_FAILED": ".exits",
    "EXIT_OK": ".exits",
    "EXIT_PIPE": ".exits",
    "EXIT_UNUSABLE": ".exits",
    "Follow": ".following",
    "GONE": ".following",
    "PAUSED_BY_REQUEST": ".following",
    "PENDING": ".following",
    "POLL": ".following",
    "REQUEST_TIMEOUT": ".target",
    "ScaleOutcome": ".following",
    "TOKEN_ENV": ".target",
    "Target": ".target",
    "URL_ENV": ".target",
    "add_commands": ".parser",
    "add_follow_options": ".parser",
    "admin_url": ".target",
    "cmd_apply": ".commands",
    "cmd_delete": ".commands",
    "cmd_drain": ".commands",
    "cmd_logs": ".commands",
    "cmd_rollout": ".commands",
    "cmd_scale": ".commands",
    "cmd_status": ".commands",
    "describe_apply": ".render",
    "follow": ".following",
    "follow_change": ".following",
    "pick_log_replicas": ".commands",
    "progress_text": ".render",
    "replica_ids": ".following",
    "resolve_target": ".target",
    "revision_text": ".render",
    "revisions_text": ".render",
    "run_command": ".dispatch",
    "scale_outcome": ".following",
    "table": ".render",
}
"""Each public name's module: the names are imported on first use (PEP 562), so that
``gateway serve``, which registers the client commands (``parser``), imports no HTTP client."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "COMMANDS",
    "DEFAULT_URL",
    "EXIT_CODES",
    "EXIT_DEGRADED",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_PIPE",
    "EXIT_UNUSABLE",
    "GONE",
    "PAUSED_BY_REQUEST",
    "PENDING",
    "POLL",
    "REQUEST_TIMEOUT",
    "TOKEN_ENV",
    "URL_ENV",
    "CliError",
    "Client",
    "Command",
    "Follow",
    "ScaleOutcome",
    "Target",
    "add_commands",
    "add_follow_options",
    "admin_url",
    "cmd_apply",
    "cmd_delete",
    "cmd_drain",
    "cmd_logs",
    "cmd_rollout",
    "cmd_scale",
    "cmd_status",
    "describe_apply",
    "follow",
    "follow_change",
    "pick_log_replicas",
    "progress_text",
    "replica_ids",
    "resolve_target",
    "revision_text",
    "revisions_text",
    "run_command",
    "scale_outcome",
    "table",
]
