"""Errors of the control plane.

ControllerError
├── SpecError            422  a spec or request that cannot be applied (field path + reason)
├── NotFound             404  no such service, revision or replica
├── Conflict             409  the action does not fit the current state
├── DocumentError        400  a YAML or JSON document that cannot be read (not UTF-8, syntax)
│   └── DocumentTooLarge 413  past a limit of ``documents``: ``limit`` names which
├── StoreUnavailable     503  the state database cannot be written
│   └── Deposed          503  a write fenced by this node's leadership, refused: another leads
├── WriteTooLarge        413  one write more than one etcd transaction takes: ``limit`` names which
├── BackendError              a backend could not do what it was asked
│   ├── NoCapacity            the fleet is full; ``retry_after`` hints when to try again
│   └── StartFailed           the replica could not be started (bad command, directory...)
│       └── HostFault         its host did not answer, or failed it: not the revision's fault
└── StartRefused              the gateway did not start, and touched nothing (exit 2)
    ├── StateDirInUse         another gateway process holds the state directory's lock
    └── ListenFailed          an address to listen on could not be bound
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

Limit = Literal["depth", "nodes"]
TransactionLimit = Literal["operations", "bytes"]


class ControllerError(Exception):
    status = 500
    code = "controller_error"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class SpecError(ControllerError):
    status = 422
    code = "invalid_spec"

    def __init__(self, message: str, errors: list[dict[str, str]] | None = None) -> None:
        super().__init__(message, errors=errors or [])
        self.errors = errors or []


class NotFound(ControllerError):
    status = 404
    code = "not_found"


class Conflict(ControllerError):
    status = 409
    code = "conflict"


class DocumentError(ControllerError):
    status = 400
    code = "bad_request"


class DocumentTooLarge(DocumentError):
    """Nested deeper, or with more nodes, than ``documents`` reads: refused while parsing."""

    status = 413
    code = "document_too_large"

    def __init__(self, message: str, limit: Limit, allowed: int) -> None:
        super().__init__(message, limit=limit, allowed=allowed)
        self.limit = limit
        self.allowed = allowed


class StoreUnavailable(ControllerError):
    status = 503
    code = "store_unavailable"


class Deposed(StoreUnavailable):
    """A write fenced by this node's leadership was refused by etcd: the lease behind it is
    gone and another node may lead. Nothing of the write happened; the node stops acting."""

    code = "deposed"


class WriteTooLarge(ControllerError):
    """A write of the etcd store that one etcd transaction cannot hold (``limit``: its
    operations or its bytes, ``size`` of ``allowed``): refused before anything of it is
    applied, in the mirror or in etcd, since a write cut in several transactions could be
    seen, or left, half done."""

    status = 413
    code = "write_too_large"

    def __init__(self, message: str, limit: TransactionLimit, size: int, allowed: int) -> None:
        super().__init__(message, limit=limit, size=size, allowed=allowed)
        self.limit = limit
        self.size = size
        self.allowed = allowed


class BackendError(ControllerError):
    code = "backend_error"


class NoCapacity(BackendError):
    code = "no_capacity"

    def __init__(self, message: str, retry_after: float = 1.0, **details: object) -> None:
        super().__init__(message, **details)
        self.retry_after = retry_after


class StartFailed(BackendError):
    code = "start_failed"


class HostFault(StartFailed):
    """The host chosen for the replica did not answer, or answered a server error of its own
    (a Docker Engine gone, or on its way out): a fault of the host, not of the revision, so it
    does not count against a rollout (its ``progress_deadline`` still bounds it)."""

    code = "host_fault"


class StartRefused(ControllerError):
    """``gateway serve`` stopped before it touched anything: no replica was started, adopted
    or stopped, and the store was not opened."""

    code = "start_refused"


class StateDirInUse(StartRefused):
    """Another gateway process holds the lock of this state directory (``statelock``)."""

    code = "state_dir_in_use"

    def __init__(self, state_dir: Path, lock: Path, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "pid not written yet"
        super().__init__(
            f"state directory {state_dir} is in use by another gateway ({holder}, lock {lock})",
            pid=pid,
        )
        self.state_dir = state_dir
        self.lock = lock
        self.pid = pid


class ListenFailed(StartRefused):
    """A listener's address could not be bound (in use, not local, not permitted)."""

    code = "listen_failed"
