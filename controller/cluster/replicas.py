"""Replicas across nodes: the keys the leader and the nodes' agents talk through, and their JSON.

Keys (``prefix`` ends with ``/``):

- ``<prefix>placements/<node>/<replica>``: a ``Placement``, written by the leader (fenced):
  "run this replica". Written again with ``stop`` set: "stop it, with this grace". Deleted:
  "stop it" (the agent's default grace), or cleaned up after its exit.
- ``<prefix>running/<replica>``: a ``RunningRecord``, written by the node that started (or
  adopted) it; bound to no lease (a restarted node adopts its replicas from it), deleted with
  the exit record's write.
- ``<prefix>failed/<replica>``: a ``FailedRecord``: the node could not start it.
- ``<prefix>exits/<replica>``: an ``ExitRecord``: it ended on the node.
- ``<prefix>capacity/<node>``: a ``CapacityRecord``, bound to the node's lease: the node's agent
  runs and takes replicas.

The leader removes the failed and exit records with their placement once it has read them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from controller.backends.base import Exit, Launch
from controller.spec import ReplicaTemplate

log = logging.getLogger(__name__)

FailureKind = Literal["no_capacity", "start_failed"]


def _base(prefix: str | bytes) -> bytes:
    raw = prefix.encode() if isinstance(prefix, str) else prefix
    return raw if raw.endswith(b"/") else raw + b"/"


@dataclass(frozen=True, slots=True)
class Keys:
    """The key layout under one cluster prefix."""

    prefix: bytes

    @classmethod
    def of(cls, prefix: str | bytes) -> Keys:
        return cls(_base(prefix))

    @property
    def nodes(self) -> bytes:
        return self.prefix + b"nodes/"

    def node(self, name: str) -> bytes:
        return self.nodes + name.encode()

    def placements(self, node: str | None = None) -> bytes:
        """Every placement, or those of ``node``."""
        base = self.prefix + b"placements/"
        return base if node is None else base + node.encode() + b"/"

    def placement(self, node: str, replica_id: str) -> bytes:
        return self.placements(node) + replica_id.encode()

    @property
    def running(self) -> bytes:
        return self.prefix + b"running/"

    @property
    def failed(self) -> bytes:
        return self.prefix + b"failed/"

    @property
    def exits(self) -> bytes:
        return self.prefix + b"exits/"

    @property
    def capacity(self) -> bytes:
        return self.prefix + b"capacity/"

    def running_key(self, replica_id: str) -> bytes:
        return self.running + replica_id.encode()

    def failed_key(self, replica_id: str) -> bytes:
        return self.failed + replica_id.encode()

    def exit_key(self, replica_id: str) -> bytes:
        return self.exits + replica_id.encode()

    def capacity_key(self, node: str) -> bytes:
        return self.capacity + node.encode()

    def split_placement(self, key: bytes) -> tuple[str, str] | None:
        """``(node, replica)`` of a key under ``placements/``; None for another key."""
        base = self.placements()
        if not key.startswith(base):
            return None
        node, sep, rid = key[len(base) :].decode(errors="replace").partition("/")
        return (node, rid) if sep and node and rid and "/" not in rid else None


def _dumps(data: dict[str, Any]) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _loads(raw: bytes, what: str) -> dict[str, Any] | None:
    try:
        data = json.loads(raw)
    except ValueError as e:
        log.warning("not a %s record: %s", what, e)
        return None
    if not isinstance(data, dict):
        log.warning("not a %s record: %r", what, raw[:100])
        return None
    return data


@dataclass(frozen=True, slots=True)
class Placement:
    """The leader's word to a node: run ``launch`` (or, with ``stop`` set, stop it)."""

    node: str
    launch: Launch
    stop: float | None = None
    """The grace of a stop the leader asked for; None while the replica should run."""

    def to_json(self) -> bytes:
        launch = self.launch
        return _dumps(
            {
                "service": launch.service,
                "revision": launch.revision,
                "replica_id": launch.replica_id,
                "template": launch.template.model_dump(mode="json"),
                "stop": self.stop,
            }
        )

    @classmethod
    def from_json(cls, node: str, raw: bytes) -> Placement | None:
        data = _loads(raw, "placement")
        if data is None:
            return None
        try:
            launch = Launch(
                service=str(data["service"]),
                revision=int(data["revision"]),
                replica_id=str(data["replica_id"]),
                template=ReplicaTemplate.model_validate(data["template"]),
            )
            stop = data.get("stop")
            return cls(node, launch, None if stop is None else float(stop))
        except (KeyError, TypeError, ValueError, ValidationError) as e:
            log.warning("not a placement record: %s", e)
            return None


@dataclass(frozen=True, slots=True)
class RunningRecord:
    """A node's word: the replica runs here. ``handle`` is its local backend's handle."""

    node: str
    service: str
    revision: int
    host: str
    port: int
    pid: int | None = None
    handle: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        return _dumps(
            {
                "node": self.node,
                "service": self.service,
                "revision": self.revision,
                "host": self.host,
                "port": self.port,
                "pid": self.pid,
                "handle": self.handle,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> RunningRecord | None:
        data = _loads(raw, "running")
        if data is None:
            return None
        try:
            pid = data.get("pid")
            handle = data.get("handle") or {}
            if not isinstance(handle, dict):
                raise TypeError("the handle is not an object")
            return cls(
                node=str(data["node"]),
                service=str(data["service"]),
                revision=int(data["revision"]),
                host=str(data["host"]),
                port=int(data["port"]),
                pid=None if pid is None else int(pid),
                handle=handle,
            )
        except (KeyError, TypeError, ValueError) as e:
            log.warning("not a running record: %s", e)
            return None


@dataclass(frozen=True, slots=True)
class FailedRecord:
    """A node's word: the replica could not be started here."""

    node: str
    kind: FailureKind
    message: str
    retry_after: float = 1.0

    def to_json(self) -> bytes:
        return _dumps(
            {
                "node": self.node,
                "kind": self.kind,
                "message": self.message,
                "retry_after": self.retry_after,
            }
        )

    @classmethod
    def from_json(cls, raw: bytes) -> FailedRecord | None:
        data = _loads(raw, "failed")
        if data is None:
            return None
        try:
            kind: FailureKind = "no_capacity" if data["kind"] == "no_capacity" else "start_failed"
            return cls(
                node=str(data["node"]),
                kind=kind,
                message=str(data["message"]),
                retry_after=float(data.get("retry_after", 1.0)),
            )
        except (KeyError, TypeError, ValueError) as e:
            log.warning("not a failed record: %s", e)
            return None


@dataclass(frozen=True, slots=True)
class ExitRecord:
    """A node's word: the replica ended here."""

    node: str
    code: int | None
    reason: str
    requested: bool

    def to_json(self) -> bytes:
        return _dumps(
            {
                "node": self.node,
                "code": self.code,
                "reason": self.reason,
                "requested": self.requested,
            }
        )

    def exit(self, replica_id: str) -> Exit:
        return Exit(replica_id, self.code, self.reason, self.requested)

    @classmethod
    def from_json(cls, raw: bytes) -> ExitRecord | None:
        data = _loads(raw, "exit")
        if data is None:
            return None
        try:
            code = data.get("code")
            return cls(
                node=str(data["node"]),
                code=None if code is None else int(code),
                reason=str(data["reason"]),
                requested=bool(data["requested"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            log.warning("not an exit record: %s", e)
            return None


@dataclass(frozen=True, slots=True)
class CapacityRecord:
    """A node's agent: how many replicas it can run (None: no limit) and runs now."""

    capacity: int | None
    in_use: int

    def to_json(self) -> bytes:
        return _dumps({"capacity": self.capacity, "in_use": self.in_use})

    @classmethod
    def from_json(cls, raw: bytes) -> CapacityRecord | None:
        data = _loads(raw, "capacity")
        if data is None:
            return None
        try:
            capacity = data.get("capacity")
            return cls(None if capacity is None else int(capacity), int(data["in_use"]))
        except (KeyError, TypeError, ValueError) as e:
            log.warning("not a capacity record: %s", e)
            return None


__all__ = [
    "CapacityRecord",
    "ExitRecord",
    "FailedRecord",
    "FailureKind",
    "Keys",
    "Placement",
    "RunningRecord",
]
