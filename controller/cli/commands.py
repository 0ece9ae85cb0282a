"""The client commands: each reads its arguments, calls the admin API, prints what it got,
and follows what it started; it returns the exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import quote

from ..config import ConfigError, read_document
from .admin_api import Client
from .exits import EXIT_OK, EXIT_UNUSABLE, CliError
from .following import follow_change, replica_ids
from .render import (
    ago,
    certificate_table,
    describe_apply,
    dump,
    host_table,
    node_table,
    progress_text,
    rollout_table,
    service_detail,
    service_table,
    table,
)


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
        dump({"result": result, "rollout": record}, out)
    return code


async def cmd_status(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.name:
        view = await client.call("GET", f"/api/services/{quote(args.name)}")
        if args.json:
            dump(view, out)
        else:
            service_detail(view, args.all, out)
        return EXIT_OK
    data = await client.call("GET", "/api/services")
    hosts = (await client.call("GET", "/api/hosts"))["hosts"]
    acme = await client.call("GET", "/api/certificates", allow=(404,)) or {}
    certificates = acme.get("certificates") or []
    cluster = await client.call("GET", "/api/cluster", allow=(404,)) or {}
    if args.json:
        dump({**data, "hosts": hosts, "certificates": certificates, "cluster": cluster}, out)
        return EXIT_OK
    if cluster.get("store") == "etcd":
        node_table(cluster, out)
        print(file=out)
    if not data["services"]:
        print("no services", file=out)
    else:
        service_table(data["services"], out)
    if any(h["backend"] != "process" for h in hosts):
        print(file=out)
        host_table(hosts, out)
    if certificates:
        print(file=out)
        certificate_table(certificates, out)
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
        dump(data, out) if args.json else print(text, file=out)
        return EXIT_OK
    if action == "history":
        history = await client.call("GET", f"/api/services/{name}/rollouts")
        if args.json:
            dump(history, out)
            return EXIT_OK
        rollout_table(history["rollouts"], out)
        return EXIT_OK
    body = None
    if action == "undo" and args.to_revision is not None:
        body = {"revision": args.to_revision}
    rollout = await client.call("POST", f"/api/services/{name}/rollout/{action}", body)

    def say(line: str) -> None:
        if not args.json:
            print(line, file=out, flush=True)

    if args.json:
        dump(rollout, out)
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
        dump(result, out)
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
        dump(upstream, out)
    else:
        print(
            f"{args.name}: upstream {upstream['id']} ({upstream['address']}) "
            f"{upstream['state']}, {upstream['inflight']} in flight",
            file=out,
        )
    return EXIT_OK


async def cmd_token(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    """``token list|add|revoke``: a service's bearer tokens, by id. ``add`` makes a token
    (printed once) unless ``--stdin`` gives one: never on the command line, where ``ps`` and
    the shell's history would keep it."""
    path = f"/api/services/{quote(args.name)}/tokens"
    if args.token_command == "list":
        data = await client.call("GET", path)
        if args.json:
            dump(data, out)
        elif not data["tokens"]:
            print(f"{args.name}: no tokens", file=out)
        else:
            rows = [["ID", "SOURCE", "LABEL", "ADDED"]]
            for t in data["tokens"]:
                added = ago(t["created_at"]) if t["created_at"] is not None else "-"
                rows.append([t["id"], t["source"], t["label"] or "-", added])
            table(rows, out)
        return EXIT_OK
    if args.token_command == "revoke":
        data = await client.call("DELETE", f"{path}/{quote(args.id)}")
        if args.json:
            dump(data, out)
        else:
            print(f"{args.name}: token {data['id']} revoked", file=out)
        return EXIT_OK
    body: dict[str, Any] = {"label": args.label}
    if args.stdin:
        token = sys.stdin.readline().strip()
        if not token:
            raise CliError("no token on standard input", EXIT_UNUSABLE)
        body["token"] = token
    data = await client.call("POST", path, body)
    if args.json:
        dump(data, out)
    else:
        print(f"{args.name}: token {data['token']['id']} added", file=out)
        if data["secret"] is not None:
            print(f"token (shown once, keep it now): {data['secret']}", file=out)
    return EXIT_OK


def pick_log_replicas(replicas: list[dict[str, Any]], *, failed: bool) -> list[str]:
    """Whose logs ``logs`` shows: the failed replicas (``--failed``), else the live ones, else
    the one that failed last (what a user wants to read when nothing runs)."""
    gone = sorted((r for r in replicas if r["state"] == "failed"), key=lambda r: r["since"])
    if failed:
        return [r["id"] for r in gone]
    live = [r["id"] for r in replicas if r["state"] not in ("stopped", "failed")]
    return live or [r["id"] for r in gone[-1:]]


async def cmd_logs(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    name = quote(args.name)
    if args.replica:
        ids = [args.replica]
    else:
        view = await client.call("GET", f"/api/services/{name}")
        ids = pick_log_replicas(view["replicas"], failed=args.failed)
    results = []
    for rid in ids:
        path = f"/api/services/{name}/replicas/{quote(rid)}/logs?tail={args.tail}"
        results.append(await client.call("GET", path))
    if args.json:
        dump(results, out)
        return EXIT_OK
    if not ids:  # nothing to read is said, not printed as nothing
        print(f"{args.name}: no {'failed ' if args.failed else ''}replicas", file=out)
    for logs in results:
        prefix = f"[{logs['replica']}] " if len(results) > 1 else ""
        for line in logs["lines"]:
            print(prefix + line, file=out)
        if not logs["lines"]:
            print(f"{logs['replica']}: no output", file=out)
    return EXIT_OK


async def cmd_delete(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    data = await client.call("DELETE", f"/api/services/{quote(args.name)}")
    if args.json:
        dump(data, out)
    else:
        print(f"{args.name}: deleting (every replica is drained, then stopped)", file=out)
    return EXIT_OK


Command = Callable[[Client, argparse.Namespace, TextIO], Coroutine[Any, Any, int]]

COMMANDS: dict[str, Command] = {
    "apply": cmd_apply,
    "status": cmd_status,
    "rollout": cmd_rollout,
    "scale": cmd_scale,
    "drain": cmd_drain,
    "undrain": cmd_drain,
    "logs": cmd_logs,
    "delete": cmd_delete,
    "token": cmd_token,
}
"""Each command's coroutine, by the ``command`` its parser sets (``parser.add_commands``)."""
