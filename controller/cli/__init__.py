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

Modules: ``client`` (where the admin API is, and the calls to it), ``following`` (a started
rollout or scale, until its outcome), ``render`` (the text printed), ``commands`` (one
coroutine per command), ``dispatch`` (the argparse subcommands, and running one), ``exits``
(the exit codes and ``CliError``).
"""

from __future__ import annotations

from .client import (
    DEFAULT_URL,
    REQUEST_TIMEOUT,
    TOKEN_ENV,
    URL_ENV,
    Client,
    Target,
    admin_url,
    resolve_target,
)
from .commands import (
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
from .dispatch import add_commands, add_follow_options, run_command
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
from .render import (
    describe_apply,
    progress_text,
    revision_text,
    revisions_text,
    table,
)

__all__ = [
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
