"""Loopback ports for the servers a test starts (pebble, etcd, prometheus, gateways) and port
ranges for the replicas its gateways start.

A free port is found by binding it and closing the socket; the server binds it later, and
nothing may take it in between:

- not this process: a port is not handed out twice in a row (the kernel once gave one port to
  two binds to port 0 in a row, and pebble then failed to bind its second listener);
- not another test process of the same run (pytest-xdist's workers): each worker takes its
  ports and its replicas' ranges from an area of its own (``PYTEST_XDIST_WORKER`` of
  ``PYTEST_XDIST_WORKER_COUNT``), all below the kernel's ephemeral range (from 32768 by
  default), so a connection's local port cannot take one either. Without xdist, the kernel
  picks a free port (a bind to port 0).

Replica ranges (``port_block``) are handed out in turn through the area, from a random start:
a range comes back only after the whole area has been handed out, so a gateway of one test
never finds a replica of an earlier one, or its port in TIME_WAIT, in its range.
"""

from __future__ import annotations

import os
import random
import socket

PORTS = (10000, 20000)
"""Where ``free_port`` takes ports under xdist (split between the workers)."""
BLOCKS = (20000, 32000)
"""Where ``port_block`` takes replicas' ranges (split between xdist's workers)."""

_given: set[int] = set()
_next: dict[tuple[int, int], int] = {}


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on at ``host`` now, and not handed out before in this process
    (under xdist: not in the last few thousand, and in this worker's area)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low, high = _area(PORTS)
    for _ in range(high - low if _workers() else 1000):
        wanted = _turn((low, high), 1) if _workers() else 0
        with socket.socket(family) as sock:
            try:
                sock.bind((host, wanted))
            except OSError:
                continue
            port = int(sock.getsockname()[1])
        if wanted or port not in _given:
            _given.add(port)
            return port
    raise RuntimeError(f"no free port at {host} in {low}-{high}")


def port_block(size: int) -> int:
    """The first of ``size`` consecutive ports for a backend's ``port_range``, apart from any
    other range this run hands out now."""
    return _turn(_area(BLOCKS), size)


def _turn(area: tuple[int, int], size: int) -> int:
    low, high = area
    start = _next.get(area)
    if start is None:
        start = low + random.randrange((high - low) // size) * size
    if start + size > high:
        start = low
    _next[area] = start + size
    return start


def _workers() -> int:
    """How many xdist workers share the machine's ports (0: this process runs alone)."""
    if not os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
        return 0
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))


def _area(whole: tuple[int, int]) -> tuple[int, int]:
    """This process's share of ``whole``."""
    count = _workers()
    if not count:
        return whole
    low, high = whole
    share = (high - low) // count
    first = low + int(os.environ["PYTEST_XDIST_WORKER"][2:]) * share
    return first, first + share
