"""Following what a command started until its outcome: a rollout, or a scale.

The follower listens to the server-sent events of the service and reads the service's state
after each (and at least every ``POLL`` seconds, should the stream break), printing a progress
line whenever it changes, and each image pull's progress line as the gateway journals it
(docker backend, ``say_pulls``). A rollout ends ``EXIT_OK`` once complete, ``EXIT_FAILED``
once it ended otherwise or paused on a failure; a scale ``EXIT_OK`` once every replica is
ready, ``EXIT_DEGRADED`` once it settled short (``scale_outcome``). A ``--timeout`` reached
raises ``CliError``; what was started goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

import aiohttp

from ..tasks import wait_set
from .admin_api import Client
from .exits import EXIT_DEGRADED, EXIT_FAILED, EXIT_OK, CliError
from .render import progress_text, pull_text, scale_text

POLL = 1.0
"""Seconds between reads of a followed service when no event arrives."""
PAUSED_BY_REQUEST = "paused by request"
"""The reason the controller gives a pause that was asked for (not one caused by failure)."""
PENDING = ("requested", "starting")
"""Replica states of a start still under way: its outcome is not known yet."""
GONE = ("stopped", "failed")

ScaleOutcome = Literal["done", "degraded"]


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
    line = scale_text(view)
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

    return await follow(client, name, step, limit, last, say)


def replica_ids(view: dict[str, Any] | None) -> frozenset[str]:
    return frozenset() if view is None else frozenset(r["id"] for r in view["replicas"])


async def follow(
    client: Client,
    name: str,
    step: Callable[[Follow], Coroutine[Any, Any, None]],
    limit: float | None,
    last: str = "",
    say: Callable[[str], None] | None = None,
) -> Follow:
    """Call ``step`` after every event of the service (at least every POLL) until it ends;
    ``say`` hears the image pulls' progress lines meanwhile."""
    state = Follow(last=last)
    deadline = None if limit is None else asyncio.get_running_loop().time() + limit
    if say is None:
        return await _follow(client, name, step, state, deadline, limit)
    pulls = asyncio.create_task(say_pulls(client, name, say), name=f"pulls:{name}")
    try:
        return await _follow(client, name, step, state, deadline, limit)
    finally:
        pulls.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pulls


async def _follow(
    client: Client,
    name: str,
    step: Callable[[Follow], Coroutine[Any, Any, None]],
    state: Follow,
    deadline: float | None,
    limit: float | None,
) -> Follow:
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
            await wait_set(changed, wait)


async def say_pulls(client: Client, name: str, say: Callable[[str], None]) -> None:
    """Say each image pull progress line of the service as the gateway journals it, until
    cancelled (best effort, as ``Client.watch``: a stream that breaks says no more)."""
    url = f"{client.target.url}/api/events?service={quote(name)}"
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError, ValueError):
        async with client.session.get(url, headers=client.headers, timeout=timeout) as response:
            if response.status != 200:
                return
            async for raw in response.content:
                line = raw.decode("utf-8", "replace")
                if line.startswith("data:"):
                    event = json.loads(line[5:])
                    text = pull_text(event) if isinstance(event, dict) else None
                    if text is not None:
                        say(text)
