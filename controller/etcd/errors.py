"""Errors of the etcd client.

EtcdError                  etcd refused the request itself (a bad request, a missing lease...)
├── Compacted              the revision asked for was compacted: reload, then watch again
└── LeaseNotFound          the lease named by the request does not exist (expired or revoked)
EtcdUnavailable            no endpoint answered in time: refused, timeout, 5xx, no leader
"""

from __future__ import annotations


class EtcdError(Exception):
    """etcd answered, and refused: retrying the same request elsewhere would not help."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code etcd gave (3 invalid argument, 5 not found, 9 failed
        precondition, 11 out of range...), 0 when not known."""


class Compacted(EtcdError):
    """The revision a watch (or a get) started at was compacted away."""

    def __init__(self, message: str, revision: int) -> None:
        super().__init__(message, code=11)
        self.revision = revision
        """For a watch: the compaction's revision, the oldest one still readable. For a get:
        the revision asked for."""


class LeaseNotFound(EtcdError):
    """A put or a keepalive named a lease etcd no longer has."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=5)


class EtcdUnavailable(Exception):
    """No endpoint answered the call within its timeout; the message says which and why.

    A write that got this may or may not have been applied."""

    def __init__(self, message: str, reasons: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.reasons = reasons or {}
        """The last failure of each endpoint tried, by endpoint."""
