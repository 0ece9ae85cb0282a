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
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO
from urllib.parse import quote

import aiohttp
from yarl import URL

from gateway.config import parse_address

from .config import ConfigError, load_config, read_document

DEFAULT_URL = "http://127.0.0.1:8081"
URL_ENV = "GATEWAY_ADMIN_URL"
TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
POLL = 1.0
"""Seconds between reads of a followed service when no event arrives."""
REQUEST_TIMEOUT = 30.0
PAUSED_BY_REQUEST = "paused by request"
"""The reason the controller gives a pause that was asked for (not one caused by failure)."""

EXIT_OK, EXIT_FAILED, EXIT_UNUSABLE, EXIT_DEGRADED = 0, 1, 2, 3
EXIT_PIPE = 141
PENDING = ("requested", "starting")
"""Replica states of a start still under way: its outcome is not known yet."""
GONE = ("stopped", "failed")

ScaleOutcome = Literal["done", "degraded"]

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


@dataclass(frozen=True)
class Target:
    url: str
    token: str | None


def admin_url(listen: str) -> str:
    """The URL at which a client reaches an admin listener bound to ``listen``."""
    host, port = parse_address(listen, listen=True)
    if port == 0:
        raise CliError(f"admin.listen {listen!r} has no fixed port: pass --admin", EXIT_UNUSABLE)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def resolve_target(args: argparse.Namespace, env: dict[str, str] | None = None) -> Target:
    """Flags first, then the environment, then the gateway config, then the default."""
    environ = os.environ if env is None else env
    url = args.admin or environ.get(URL_ENV) or None
    token = args.token or environ.get(TOKEN_ENV) or None
    if args.config and (url is None or token is None):
        try:
            config = load_config(args.config).config
            token = token or config.admin_token()
        except ConfigError as e:
            raise CliError(str(e).replace("\n", " "), EXIT_UNUSABLE) from None
        url = url or admin_url(config.admin.listen)
    url = (url or DEFAULT_URL).rstrip("/")
    parsed = URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise CliError(f"not an admin API URL: {url!r} (e.g. {DEFAULT_URL})", EXIT_UNUSABLE)
    return Target(url, token)


# -- the client -------------------------------------------------------------------------------


class Client:
    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self.session = session
        self.target = target
        self.headers = {"Authorization": f"Bearer {target.token}"} if target.token else {}

    def _unreachable(self, error: BaseException) -> CliError:
        reason = str(error) or type(error).__name__
        return CliError(f"cannot reach the gateway at {self.target.url}: {reason}", EXIT_UNUSABLE)

    def _refused(self, status: int, data: Any) -> CliError:
        if status == 401:
            hint = "" if self.target.token else f" (no token given: --token or ${TOKEN_ENV})"
            return CliError(
                f"the gateway at {self.target.url} refused the token{hint}", EXIT_UNUSABLE
            )
        if isinstance(data, dict) and "message" in data:
            message = str(data["message"])
        else:
            message = f"HTTP {status}"
        return CliError(message, EXIT_FAILED)

    async def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        allow: Sequence[int] = (),
    ) -> Any:
        """The JSON of a successful answer (or of one whose status is in ``allow``)."""
        try:
            async with self.session.request(
                method, self.target.url + path, json=body, headers=self.headers
            ) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise self._unreachable(e) from None
        try:
            data = json.loads(raw) if raw else None
        except ValueError:
            data = None
        if status >= 400 and status not in allow:
            raise self._refused(status, data)
        return data

    async def service(self, name: str) -> dict[str, Any] | None:
        data = await self.call("GET", f"/api/services/{quote(name)}", allow=(404,))
        return data if isinstance(data, dict) and "name" in data else None

    @contextlib.asynccontextmanager
    async def watch(self, name: str) -> AsyncIterator[asyncio.Event]:
        """An event set on each server-sent event of the service (the stream is best-effort:
        if it cannot be opened or breaks, the follower falls back to reading every POLL)."""
        changed = asyncio.Event()
        task = asyncio.create_task(self._listen(name, changed), name=f"watch:{name}")
        try:
            yield changed
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _listen(self, name: str, changed: asyncio.Event) -> None:
        url = f"{self.target.url}/api/events?service={quote(name)}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=REQUEST_TIMEOUT)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.get(url, headers=self.headers, timeout=timeout) as response:
                if response.status != 200:
                    return
                async for line in response.content:
                    if line.startswith(b"data:"):
                        changed.set()


# -- output -----------------------------------------------------------------------------------


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def _ago(at: float | None) -> str:
    if at is None:
        return "-"
    seconds = max(0, int(time.time() - at))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def revisions_text(rollout: dict[str, Any]) -> str:
    """``revision 1 -> 2``; ``new service, revision 1`` when nothing served before."""
    if rollout["from_revision"] is None:
        return f"new service, revision {rollout['to_revision']}"
    return f"revision {rollout['from_revision']} -> {rollout['to_revision']}"


def progress_text(rollout: dict[str, Any]) -> str:
    parts = []
    for p in rollout["progress"]:
        if p["revision"] == rollout["to_revision"]:
            parts.append(f"r{p['revision']} {p['ready']}/{p['desired']} ready")
        elif p["live"] or p["ready"]:
            parts.append(f"r{p['revision']} {p['ready']} ready")
    text = f"{rollout['kind']} {rollout['id']}: {revisions_text(rollout)}, {rollout['status']}: "
    text += ", ".join(parts)
    if rollout["failures"]:
        text += f"; {rollout['failures']} failed (of {rollout['retries']} allowed)"
    if rollout["reason"]:
        text += f" ({rollout['reason']})"
    return text


def revision_text(view: dict[str, Any]) -> str:
    serving, target = view["serving_revision"], view["target_revision"]
    if serving is None:
        return f"- -> {target}"
    return str(serving) if serving == target else f"{serving} -> {target}"


def describe_apply(result: dict[str, Any], before: int | None, after: int | None) -> str:
    """One line of what an apply does; ``before``/``after``: the replica counts of a scale."""
    name, action = result["service"], result["action"]
    changes = ", ".join(result["changes"])
    prefix = "(dry run) " if result.get("dry_run") else ""
    if action == "created":
        text = f"{name}: created at revision {result['revision']}"
    elif action == "unchanged":
        text = f"{name}: unchanged (revision {result['revision']})"
    elif action == "scaled":
        counts = f"{'?' if before is None else before} -> {'?' if after is None else after}"
        text = f"{name}: scale {counts} replicas (revision {result['revision']})"
        others = [c for c in result["changes"] if c != "replicas"]
        if others:
            text += f"; also {', '.join(others)}"
    elif action == "rollout":
        text = f"{name}: revision {result['previous_revision']} -> {result['revision']}: {changes}"
    else:
        text = f"{name}: updated in place (revision {result['revision']}): {changes}"
    if result.get("rollout_id") is not None:
        text += f"; rollout {result['rollout_id']} started"
    return prefix + text


# -- following a rollout ----------------------------------------------------------------------


@dataclass
class Follow:
    """What following a rollout printed and how it ended."""

    code: int | None = None
    record: dict[str, Any] | None = None
    last: str = ""


async def _step_rollout(
    client: Client, name: str, rollout_id: int, follow: Follow, say: Callable[[str], None]
) -> None:
    view = await client.service(name)
    if view is None:
        follow.code = EXIT_FAILED
        say(f"{name}: the service is gone")
        return
    active = view["rollout"]
    if active is not None and active["id"] == rollout_id:
        line = progress_text(active)
        if line != follow.last:
            say(line)
            follow.last = line
        if active["status"] == "paused" and active["reason"] != PAUSED_BY_REQUEST:
            follow.code = EXIT_FAILED
            say(f"{active['kind']} {rollout_id} paused: {active['reason']}")
        return
    history = await client.call("GET", f"/api/services/{quote(name)}/rollouts?limit=50")
    record = next((r for r in history["rollouts"] if r["id"] == rollout_id), None)
    if record is None or record["status"] in ("progressing", "paused"):
        return  # not yet visible as finished: read again on the next event
    follow.record = record
    status, reason, title = record["status"], record["reason"], f"{record['kind']} {rollout_id}"
    if status == "complete":
        follow.code = EXIT_OK
        say(f"{title} complete: revision {record['to_revision']} serving")
        return
    follow.code = EXIT_FAILED
    say(f"{title} {status}" + (f": {reason}" if reason else ""))
    if active is not None and active["kind"] == "rollback":
        say(f"rolling back to revision {active['to_revision']} ({active['kind']} {active['id']})")
    elif view["serving_revision"] is not None:
        say(f"revision {view['serving_revision']} serving")


def scale_outcome(view: dict[str, Any], known: frozenset[str]) -> ScaleOutcome | None:
    """How a scale has settled, or None while it goes on; ``known``: the ids of the replicas
    the service had before the command.

    - ``done``: as many replicas as desired, every one of them ready (and none leaving).
    - ``degraded``: no rollout active, the service reports degraded, no start is under way,
      and a replica started since the command failed (it could not be placed, exited, or was
      not ready in time). The controller goes on retrying with backoff, but what the command
      did is known: following it longer would only wait for capacity that may never come.
      On a service already backing off, that first attempt waits out the backoff.
    """
    replicas = view["replicas"]
    present = [r for r in replicas if r["state"] not in GONE]
    if view["ready"] == view["desired"] == len(present):
        return "done"
    if view["rollout"] is not None or view["status"] != "degraded":
        return None
    if any(r["state"] in PENDING for r in replicas):
        return None
    if any(r["state"] == "failed" and r["id"] not in known for r in replicas):
        return "degraded"
    return None


async def _step_scale(
    client: Client,
    name: str,
    known: frozenset[str],
    follow: Follow,
    say: Callable[[str], None],
) -> None:
    view = await client.service(name)
    if view is None:
        follow.code = EXIT_FAILED
        say(f"{name}: the service is gone")
        return
    outcome = scale_outcome(view, known)
    reason = view["conditions"]["reason"]
    if outcome == "degraded":
        follow.code = EXIT_DEGRADED
        say(f"{name}: degraded: {reason} (retried with backoff)")
        return
    line = f"{name}: {view['ready']}/{view['desired']} ready"
    if reason and outcome is None:
        line += f" ({reason})"
    if line != follow.last:
        say(line)
        follow.last = line
    if outcome == "done":
        follow.code = EXIT_OK


async def follow_change(
    client: Client,
    name: str,
    rollout_id: int | None,
    known: frozenset[str],
    say: Callable[[str], None],
    limit: float | None,
    last: str = "",
) -> Follow:
    """Follow what a command started until its outcome: the rollout ``rollout_id``, else a
    scale (whose outcome is the active rollout's, should one be under way). ``last``: the
    progress line already printed."""
    if rollout_id is None:
        view = await client.service(name)
        if view is not None and view["rollout"] is not None:
            rollout_id = int(view["rollout"]["id"])
    if rollout_id is not None:
        followed = rollout_id

        async def step(state: Follow) -> None:
            await _step_rollout(client, name, followed, state, say)

    else:

        async def step(state: Follow) -> None:
            await _step_scale(client, name, known, state, say)

    return await follow(client, name, step, limit, last)


def replica_ids(view: dict[str, Any] | None) -> frozenset[str]:
    return frozenset() if view is None else frozenset(r["id"] for r in view["replicas"])


async def follow(
    client: Client,
    name: str,
    step: Callable[[Follow], Coroutine[Any, Any, None]],
    limit: float | None,
    last: str = "",
) -> Follow:
    """Call ``step`` after every event of the service (at least every POLL) until it ends."""
    state = Follow(last=last)
    deadline = None if limit is None else asyncio.get_running_loop().time() + limit
    async with client.watch(name) as changed:
        while True:
            changed.clear()
            await step(state)
            if state.code is not None:
                return state
            wait = POLL
            if deadline is not None:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise CliError(f"{name}: not done after {limit:g}s (it goes on)")
                wait = min(wait, left)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), wait)


# -- commands ---------------------------------------------------------------------------------


def _dump(data: Any, out: TextIO) -> None:
    print(json.dumps(data, indent=2, sort_keys=True), file=out)


def _read_spec(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        data = read_document(file)
    except ConfigError as e:
        raise CliError(str(e), EXIT_UNUSABLE) from None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        raise CliError(f"{path}: a service spec must be a mapping with a name", EXIT_UNUSABLE)
    replica = data.get("replica")
    # As in the gateway config: a relative working_dir is relative to the spec's file.
    if isinstance(replica, dict) and isinstance(replica.get("working_dir"), str):
        wd = replica["working_dir"]
        if not os.path.isabs(wd):
            replica["working_dir"] = str((file.resolve().parent / wd).resolve())
    return data


async def cmd_apply(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    data = _read_spec(args.file)
    name = data["name"]
    path = f"/api/services/{quote(name)}"
    current = await client.service(name)
    if args.dry_run:
        result = await client.call("PUT", path + "?dry_run=1", data)
    else:
        result = await client.call("PUT", path, data)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=out, flush=True)

    after = data.get("replicas")
    before = None if current is None else int(current["desired"])
    say(describe_apply(result, before, after if isinstance(after, int) else None))
    record = None
    code = EXIT_OK
    rollout_id = result.get("rollout_id")
    if not (args.dry_run or args.no_wait) and (
        rollout_id is not None or result["action"] == "scaled"
    ):
        known = replica_ids(current)
        followed = await follow_change(client, name, rollout_id, known, say, args.timeout)
        code, record = followed.code or EXIT_OK, followed.record
    if args.json:
        _dump({"result": result, "rollout": record}, out)
    return code


def _service_table(views: list[dict[str, Any]], out: TextIO) -> None:
    rows = [["NAME", "REVISION", "READY", "STATUS", "ROLLOUT"]]
    for v in views:
        rollout = v["rollout"]
        rows.append(
            [
                v["name"],
                revision_text(v),
                f"{v['ready']}/{v['desired']}",
                v["status"],
                "-" if rollout is None else f"{rollout['id']} {rollout['status']}",
            ]
        )
    table(rows, out)


def _service_detail(view: dict[str, Any], show_all: bool, out: TextIO) -> None:
    print(
        f"{view['name']}: {view['status']}, revision {revision_text(view)}, "
        f"{view['ready']}/{view['desired']} ready",
        file=out,
    )
    if view["conditions"]["degraded"]:
        print(f"degraded: {view['conditions']['reason']}", file=out)
    if view["rollout"] is not None:
        print(progress_text(view["rollout"]), file=out)
    replicas = view["replicas"]
    shown = [r for r in replicas if show_all or r["state"] not in ("stopped", "failed")]
    if shown:
        rows = [["REPLICA", "REVISION", "STATE", "HEALTH", "IN-FLIGHT", "ADDRESS", "SINCE"]]
        for r in shown:
            state = r["state"] + (f" ({r['failure']})" if r["failure"] else "")
            rows.append(
                [
                    r["id"],
                    str(r["revision"]),
                    state,
                    r["health"] or "-",
                    str(r["inflight"]),
                    r["address"] or "-",
                    _ago(r["since"]),
                ]
            )
        table(rows, out)
    if len(shown) < len(replicas):
        print(f"({len(replicas) - len(shown)} stopped or failed not shown: --all)", file=out)


async def cmd_status(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.name:
        view = await client.call("GET", f"/api/services/{quote(args.name)}")
        if args.json:
            _dump(view, out)
        else:
            _service_detail(view, args.all, out)
        return EXIT_OK
    data = await client.call("GET", "/api/services")
    if args.json:
        _dump(data, out)
    elif not data["services"]:
        print("no services", file=out)
    else:
        _service_table(data["services"], out)
    return EXIT_OK


async def cmd_rollout(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    name = quote(args.name)
    action = args.rollout_command
    if action == "status":
        view = await client.call("GET", f"/api/services/{name}")
        if view["rollout"] is not None:
            data: Any = view["rollout"]
            text = progress_text(view["rollout"])
        else:
            history = await client.call("GET", f"/api/services/{name}/rollouts?limit=1")
            data = history["rollouts"][0] if history["rollouts"] else None
            text = f"{args.name}: no rollout in progress"
            if data is not None:
                text += f"; last: {data['kind']} {data['id']} to revision "
                text += f"{data['to_revision']} {data['status']}"
                text += f": {data['reason']}" if data["reason"] else ""
        _dump(data, out) if args.json else print(text, file=out)
        return EXIT_OK
    if action == "history":
        history = await client.call("GET", f"/api/services/{name}/rollouts")
        if args.json:
            _dump(history, out)
            return EXIT_OK
        rows = [["ID", "KIND", "FROM", "TO", "STATUS", "STARTED", "REASON"]]
        for r in history["rollouts"]:
            rows.append(
                [
                    str(r["id"]),
                    r["kind"],
                    "-" if r["from_revision"] is None else str(r["from_revision"]),
                    str(r["to_revision"]),
                    r["status"],
                    _ago(r["started_at"]),
                    r["reason"],
                ]
            )
        table(rows, out)
        return EXIT_OK
    body = None
    if action == "undo" and args.to_revision is not None:
        body = {"revision": args.to_revision}
    rollout = await client.call("POST", f"/api/services/{name}/rollout/{action}", body)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=out, flush=True)

    if args.json:
        _dump(rollout, out)
    progress = progress_text(rollout)
    say(f"{args.name}: {'aborted; ' if action == 'abort' else ''}{progress}")
    # resume, abort (its rollback) and undo set a rollout going: followed as apply's is.
    if action == "pause" or args.no_wait:
        return EXIT_OK
    rollout_id = int(rollout["id"])
    followed = await follow_change(
        client, args.name, rollout_id, frozenset(), say, args.timeout, progress
    )
    return followed.code or EXIT_OK


async def cmd_scale(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    name = args.name
    current = await client.service(name)
    body = {"replicas": args.replicas}
    result = await client.call("POST", f"/api/services/{quote(name)}/scale", body)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=out, flush=True)

    if args.json:
        _dump(result, out)
    before = None if current is None else current["desired"]
    say(describe_apply(result, before, args.replicas))
    if args.no_wait or result["action"] != "scaled":
        return EXIT_OK
    followed = await follow_change(client, name, None, replica_ids(current), say, args.timeout)
    return followed.code or EXIT_OK


async def cmd_drain(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    path = f"/api/services/{quote(args.name)}/upstreams/{quote(args.upstream)}/{args.command}"
    upstream = await client.call("POST", path)
    if args.json:
        _dump(upstream, out)
    else:
        print(
            f"{args.name}: upstream {upstream['id']} ({upstream['address']}) "
            f"{upstream['state']}, {upstream['inflight']} in flight",
            file=out,
        )
    return EXIT_OK


async def cmd_logs(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    name = quote(args.name)
    if args.replica:
        ids = [args.replica]
    else:
        view = await client.call("GET", f"/api/services/{name}")
        live = [r["id"] for r in view["replicas"] if r["state"] not in ("stopped", "failed")]
        ids = live or [r["id"] for r in view["replicas"]]
    results = []
    for rid in ids:
        path = f"/api/services/{name}/replicas/{quote(rid)}/logs?tail={args.tail}"
        results.append(await client.call("GET", path))
    if args.json:
        _dump(results, out)
        return EXIT_OK
    for logs in results:
        prefix = f"[{logs['replica']}] " if len(results) > 1 else ""
        for line in logs["lines"]:
            print(prefix + line, file=out)
    return EXIT_OK


async def cmd_delete(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    data = await client.call("DELETE", f"/api/services/{quote(args.name)}")
    if args.json:
        _dump(data, out)
    else:
        print(f"{args.name}: deleting (every replica is drained, then stopped)", file=out)
    return EXIT_OK


Command = Callable[[Client, argparse.Namespace, TextIO], Coroutine[Any, Any, int]]


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
        if action in ("resume", "abort", "undo"):
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

    delete = add("delete", cmd_delete, "drain and stop a service, then forget it")
    delete.add_argument("name")
