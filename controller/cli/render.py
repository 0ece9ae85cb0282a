"""The text the client commands print: tables, progress lines, and ``--json``'s dump."""

from __future__ import annotations

import json
import time
from typing import Any, TextIO


def dump(data: Any, out: TextIO) -> None:
    print(json.dumps(data, indent=2, sort_keys=True), file=out)


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip(), file=out)


def ago(at: float | None) -> str:
    if at is None:
        return "-"
    seconds = max(0, int(time.time() - at))
    if seconds < 120:
        return f"{seconds}s ago"
    if seconds < 7200:
        return f"{seconds // 60}m ago"
    return f"{seconds // 3600}h ago"


def within(at: float | None) -> str:
    """``in 5m`` for a time to come, ``now`` for one passed; ``-`` for none."""
    if at is None:
        return "-"
    seconds = int(at - time.time())
    if seconds <= 0:
        return "now"
    if seconds < 120:
        return f"in {seconds}s"
    if seconds < 7200:
        return f"in {seconds // 60}m"
    if seconds < 172_800:
        return f"in {seconds // 3600}h"
    return f"in {seconds // 86_400}d"


def plural(count: int, word: str) -> str:
    """``1 failure``, ``2 failures``."""
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def backoff_text(backoff: dict[str, Any]) -> str:
    """A service's placement backoff (its view's ``backoff``): ``2 failures in a row, next
    start in 4s``."""
    return (
        f"{plural(backoff['failures'], 'failure')} in a row, "
        f"next start {within(backoff['retry_at'])}"
    )


def utc(at: float | None) -> str:
    if at is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(at))


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
    if rollout.get("step") is not None:
        text += f"; {rollout['strategy'].replace('_', '/')} step {rollout['step']}"
        text += f" of {rollout['steps']} at {rollout['weight']}%"
        if rollout.get("promoted"):
            text += ", promoted"
        if rollout.get("analysis"):
            text += f"; {rollout['analysis']}"
    if rollout["failures"]:
        text += f"; {rollout['failures']} failed (of {rollout['retries']} allowed)"
    if rollout["reason"]:
        text += f" ({rollout['reason']})"
    return text


def scale_text(view: dict[str, Any]) -> str:
    """A scale's progress line: ``web: 7/12 ready``, and why starts fail should they
    (``(no capacity: 3 of 3 slots in use)``). The count is the view's alone: the degraded
    condition's reason carries one of its own, read when it was set."""
    line = f"{view['name']}: {view['ready']}/{view['desired']} ready"
    backoff = view.get("backoff")
    if backoff and backoff["reason"]:
        line += f" ({backoff['reason']})"
    return line


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


def service_table(views: list[dict[str, Any]], out: TextIO) -> None:
    rows = [["NAME", "REVISION", "READY", "STATUS", "ROLLOUT"]]
    for v in views:
        rollout = v["rollout"]
        rows.append(
            [
                v["name"],
                revision_text(v),
                f"{v['ready']}/{v['desired']}",
                v["status"],
                "-" if rollout is None else _rollout_cell(rollout),
            ]
        )
    table(rows, out)
    for v in views:  # a canary's or blue/green's last analysis
        rollout = v["rollout"]
        if rollout is not None and rollout.get("analysis"):
            print(f"{v['name']}: {rollout['analysis']}", file=out)
    for v in views:  # an autoscaled service's last decision, and why
        scaling = v.get("autoscaling")
        if scaling and scaling["decision"]:
            print(
                f"{v['name']}: autoscaled {scaling['min']}..{scaling['max']}, "
                f"{ago(scaling['decided_at'])}: {scaling['decision']}",
                file=out,
            )


def _rollout_cell(rollout: dict[str, Any]) -> str:
    """``3 progressing``, and for a canary or blue/green ``canary 2/3 r4 25%``."""
    cell = f"{rollout['id']} {rollout['status']}"
    if rollout.get("step") is not None:
        strategy = rollout["strategy"].replace("_", "/")
        cell += f" {strategy} {rollout['step']}/{rollout['steps']}"
        cell += f" r{rollout['to_revision']} {rollout['weight']}%"
    return cell


def host_table(hosts: list[dict[str, Any]], out: TextIO) -> None:
    """Where replicas run; printed only when there is more than the local machine."""
    rows = [["HOST", "BACKEND", "REPLICAS", "STATE", "ENGINE"]]
    for h in hosts:
        capacity = "-" if h["capacity"] is None else str(h["capacity"])
        state = "up" if h["reachable"] else f"unreachable: {h['error']}"
        rows.append([h["name"], h["backend"], f"{h['replicas']}/{capacity}", state, h["engine"]])
    table(rows, out)


def node_table(cluster: dict[str, Any], out: TextIO) -> None:
    """The nodes of a cluster, which one leads, and whether etcd answers."""
    rows = [["NODE", "ROLE", "REPLICAS", "ADDRESS"]]
    for n in cluster["nodes"]:
        role = "leader" if n["leader"] else "follower"
        capacity = "-" if n.get("capacity") is None else str(n["capacity"])
        replicas = "-" if n.get("replicas") is None else f"{n['replicas']}/{capacity}"
        rows.append([n["name"], role, replicas, n["address"]])
    table(rows, out)
    if cluster["leader"] is None:
        print("no node leads now (an election is under way, or etcd is unreachable)", file=out)
    if not cluster.get("store_reachable", True):
        print(f"etcd unreachable from {cluster['node']}: {cluster['store_reason']}", file=out)


def service_detail(view: dict[str, Any], show_all: bool, out: TextIO) -> None:
    print(
        f"{view['name']}: {view['status']}, revision {revision_text(view)}, "
        f"{view['ready']}/{view['desired']} ready",
        file=out,
    )
    if view["conditions"]["degraded"]:
        print(f"degraded: {view['conditions']['reason']}", file=out)
    if view.get("backoff"):
        print(f"backing off: {backoff_text(view['backoff'])}", file=out)
    scaling = view.get("autoscaling")
    if scaling:
        print(
            f"autoscaled: replicas {scaling['min']}..{scaling['max']}, {scaling['metric']} "
            f"target {scaling['target']:g}, {scaling['held']} held",
            file=out,
        )
        if scaling["decision"]:
            print(f"last decision ({ago(scaling['decided_at'])}): {scaling['decision']}", file=out)
        if scaling.get("holding"):
            print(f"holding: {scaling['holding']}", file=out)
    if view.get("guards"):
        guards_text(view["guards"], out)
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
                    ago(r["since"]),
                ]
            )
        table(rows, out)
    if len(shown) < len(replicas):
        print(f"({len(replicas) - len(shown)} stopped or failed not shown: --all)", file=out)


def guards_text(guards: dict[str, Any], out: TextIO) -> None:
    """A service's auth, rate limits, affinity and in-flight cap, a line each that is on."""
    auth = guards["auth"]
    if auth is not None:
        passed = ", passed upstream" if auth["pass_token"] else ""
        print(
            f"auth: bearer in {auth['header']}{passed}, {auth['tokens']} tokens; requests "
            f"{auth['ok']} ok, {auth['missing']} missing, {auth['wrong']} wrong",
            file=out,
        )
    for r in guards["rate_limits"]:
        print(
            f"rate limit: {r['path_prefix']} by {r['key']}, {r['rps']:g}/s burst {r['burst']}",
            file=out,
        )
    if guards["rate_limits"]:
        print(f"rate limited: {guards['rate_limited']} requests (429)", file=out)
    if guards["affinity"] is not None:
        print(f"affinity: hash of {guards['affinity']}", file=out)
    cap = guards["max_in_flight_per_replica"]
    if cap:
        print(
            f"in flight per replica: at most {cap}; {guards['queued']} queued now, "
            f"{guards['queue_rejected']} rejected (503)",
            file=out,
        )


def rollout_table(rollouts: list[dict[str, Any]], out: TextIO) -> None:
    rows = [["ID", "KIND", "FROM", "TO", "STATUS", "STARTED", "REASON"]]
    for r in rollouts:
        rows.append(
            [
                str(r["id"]),
                r["kind"],
                "-" if r["from_revision"] is None else str(r["from_revision"]),
                str(r["to_revision"]),
                r["status"],
                ago(r["started_at"]),
                r["reason"],
            ]
        )
    table(rows, out)


def certificate_table(certificates: list[dict[str, Any]], out: TextIO) -> None:
    """The certificates obtained by ACME: one row per host, the last error last."""
    rows = [["CERTIFICATE", "SERVICES", "STATE", "NOT AFTER", "NEXT ORDER", "LAST ERROR"]]
    for c in certificates:
        state = c["state"]
        if c["ordering"]:
            state += " (ordering)"
        elif c["failures"]:
            state += f" ({c['failures']} failed)"
        rows.append(
            [
                c["name"],
                ",".join(c["services"]),
                state,
                utc(c["not_after"]),
                "-" if c["state"] == "skipped" else within(c["next_order"]),
                c["last_error"] or "-",
            ]
        )
    table(rows, out)


PULL_KIND = "image_pulling"
"""The journal's kind of an image pull's progress line (docker backend)."""


def pull_text(event: dict[str, Any]) -> str | None:
    """The line ``gateway apply`` prints for a journal entry while it follows: an image
    pull's progress (``pulling IMAGE on HOST: 2 of 3 layers, 4.5 of 14.0 MB``), else None."""
    if event.get("kind") != PULL_KIND or not isinstance(event.get("message"), str):
        return None
    return str(event["message"])
