"""The retry decision (gateway/proxy/retry.py): a pure function, as a table."""

from __future__ import annotations

import pytest

from gateway.config import RetriesConfig
from gateway.pool.upstream import Upstream
from gateway.proxy.retry import may_retry, stale

A, B = (Upstream(id=i, service="web", host="127.0.0.1", port=1) for i in ("a", "b"))

BASE = {
    "method": "GET",
    "has_body": False,
    "body_taken": False,
    "response_started": False,
    "retries": 0,
    "elapsed": 0.0,
    "config": RetriesConfig(attempts=2, timeout=10.0, on_status=False),
    "routable": (A, B),
    "tried": {"a"},
}


@pytest.mark.parametrize(
    ("kind", "changes", "retried"),
    [
        ("connect", {}, True),
        ("connect", {"method": "POST", "has_body": True}, True),  # nothing reached it
        ("disconnect", {}, True),  # a stale keep-alive connection
        ("disconnect", {"method": "POST"}, False),  # not idempotent
        ("disconnect", {"has_body": True}, False),  # a body cannot be replayed
        ("refused", {"method": "POST", "has_body": True}, True),  # no replica processed it
        ("refused", {"body_taken": True}, False),  # ... but a byte of its body is gone
        ("refused", {"response_started": True}, False),
        ("status", {}, False),  # only with on_status
        ("status", {"config": RetriesConfig(on_status=True)}, True),
        ("status", {"config": RetriesConfig(on_status=True), "method": "POST"}, False),
        ("timeout", {}, False),
        ("protocol", {}, False),
        ("client", {}, False),
        ("connect", {"retries": 2}, False),  # attempts used up
        ("connect", {"response_started": True}, False),  # the client has a byte
        ("connect", {"body_taken": True}, False),  # a byte of the body left
        ("connect", {"elapsed": 10.0}, False),  # retries.timeout
        ("connect", {"tried": {"a", "b"}}, False),  # no other routable upstream
        ("connect", {"routable": (A,)}, False),
    ],
)
def test_a_failed_attempt_is_retried_only_while_nothing_is_lost(kind, changes, retried):
    assert may_retry(kind, **{**BASE, **changes}) is retried


STALE = {
    "reused": True,
    "method": "GET",
    "has_body": False,
    "body_taken": False,
    "response_started": False,
}


@pytest.mark.parametrize(
    ("kind", "changes", "is_stale"),
    [
        ("disconnect", {}, True),  # a kept connection closed as the request went out
        ("disconnect", {"method": "PUT"}, True),  # idempotent too
        ("disconnect", {"reused": False}, False),  # a new connection: the upstream failed
        ("disconnect", {"method": "POST"}, False),  # not idempotent
        ("disconnect", {"has_body": True}, False),  # a body cannot be sent again
        ("disconnect", {"body_taken": True}, False),
        ("disconnect", {"response_started": True}, False),
        ("connect", {}, False),
        ("timeout", {}, False),  # it took the request: a slow upstream, not a stale connection
        ("protocol", {}, False),
    ],
)
def test_only_a_reused_connection_closed_before_answering_a_replayable_request_is_stale(
    kind, changes, is_stale
):
    assert stale(kind, **{**STALE, **changes}) is is_stale
