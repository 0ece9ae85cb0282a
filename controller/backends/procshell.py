"""The shell script a replica runs, and what its exit status says.

A template's commands run as one ``/bin/sh -c`` script: each runs if the one before succeeded,
and the last is ``exec``'d when that is safe, so the server is the group leader and its exit
status is the replica's. ``exit_reason`` reads that status as the shell sets it (126 and 127
from the shell itself, a negative code for a signal).
"""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterable
from pathlib import Path

_NOT_EXEC_SAFE = frozenset(";&|\n")
_SHELL_WORDS = frozenset(
    "! { } ( ) . : [ [[ alias break case cd command continue do done elif else esac eval exec "
    "exit export fi for if in readonly read return set shift source then times trap ulimit "
    "umask unalias unset until wait while".split()
)


def shell_script(commands: Iterable[str], path: str, cwd: str | None) -> str:
    """The ``sh -c`` script for a template's commands: each runs if the one before succeeded.

    Each command is a brace group ended by a newline, so a trailing comment or ``&`` in one
    cannot swallow or break the ``&&`` after it. The last command is ``exec``'d when that is
    safe (a plain command that names an executable, no ``;``, ``&``, ``|`` or newline): the
    server is then the group leader, and its exit status is the replica's.
    """
    parts = list(commands)
    if parts and _exec_safe(parts[-1], path, cwd):
        parts[-1] = f"exec {parts[-1]}"
    return " && ".join(f"{{ {command}\n}}" for command in parts)


def exit_reason(code: int) -> str:
    """``exited with code 3``, ``killed by signal 9 (SIGKILL)``."""
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:
            name = ""
        return f"killed by signal {-code}{name}"
    hint = {126: " (command not executable)", 127: " (command not found)"}.get(code, "")
    return f"exited with code {code}{hint}"


def _exec_safe(command: str, path: str, cwd: str | None) -> bool:
    if any(ch in _NOT_EXEC_SAFE for ch in command):
        return False
    words = command.split()
    if not words:
        return False
    first = words[0]
    if first in _SHELL_WORDS or "=" in first or first[0] in "({!\"'$`\\":
        return False
    if "/" in first:
        candidate = Path(first) if first.startswith("/") else Path(cwd or os.getcwd()) / first
        return candidate.is_file() and os.access(candidate, os.X_OK)
    return shutil.which(first, path=path) is not None
