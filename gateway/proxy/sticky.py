"""Sticky assignment during a traffic split: a client keeps its revision. PURE.

While a service's traffic is split by revision (a canary), the draw that chooses a side is
a hash of the request's ``sticky.header`` or ``sticky.cookie`` value instead of a random
number, so the same client lands on the same revision at every request of a step (and keeps
it as the weight grows: a draw below the weight stays below a larger one). A request without
the value gets a random draw.
"""

from __future__ import annotations

from ..config import StickyConfig
from ..wire.headers import Fields


def value(config: StickyConfig, headers: Fields) -> bytes | None:
    """The request's header value or cookie value that ``config`` names, or None."""
    if config.header is not None:
        name = config.header.lower().encode()
        for key, found in headers:
            if key.lower() == name:
                return found.strip()
        return None
    assert config.cookie is not None
    wanted = config.cookie.encode() + b"="
    for key, found in headers:
        if key.lower() != b"cookie":
            continue
        for pair in found.split(b";"):
            pair = pair.strip()
            if pair.startswith(wanted):
                return pair[len(wanted) :]
    return None


def draw(key: bytes) -> float:
    """A number in [0, 1) that ``key`` always draws, spread evenly over the keys."""
    import hashlib  # here: a worker that draws for no key imports no digests

    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
