"""Rate limits: a token bucket per key, in a table of bounded size. PURE (``now`` is passed in).

Each bucket is kept as one number, its *theoretical arrival time* (GCRA, the generic cell
rate algorithm of ATM networks): the moment the bucket would be full again. A request at
``now`` costs one token, ``interval = 1 / rps`` seconds of it; it is allowed if the bucket
holds one, that is if ``tat + interval - now <= burst * interval``. This is the token bucket
of ``rps`` and ``burst`` exactly, with one float per key instead of two and no refill loop.

The table of keys is capped (``max_keys``): least recently used keys are evicted first. An
evicted key's bucket starts full again, as a key never seen: the least recently used are
the likeliest to be full anyway (a key idle for ``burst / rps`` seconds is), so memory stays
bounded whatever the number of distinct keys a client makes up, at worst at the cost of a
fresh burst for keys pushed out by a flood of new ones.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from ..config import RateLimit

MAX_KEYS: Final = 65_536
"""Keys one rule keeps at most per process (about 100 bytes each)."""


class Verdict:
    """A request's fate under one rule, with what the ``RateLimit-*`` fields say."""

    __slots__ = ("allowed", "limit", "remaining", "reset", "retry_after")

    def __init__(
        self, allowed: bool, limit: int, remaining: int, reset: float, retry_after: float
    ) -> None:
        self.allowed = allowed
        self.limit = limit
        """The bucket's size (``RateLimit-Limit``)."""
        self.remaining = remaining
        """Tokens left after this request (``RateLimit-Remaining``)."""
        self.reset = reset
        """Seconds until the bucket is full again (``RateLimit-Reset``)."""
        self.retry_after = retry_after
        """Seconds until this request would be allowed (0 if it is)."""

    def __repr__(self) -> str:
        return (
            f"<Verdict allowed={self.allowed} remaining={self.remaining}/{self.limit} "
            f"reset={self.reset:g} retry_after={self.retry_after:g}>"
        )


class Buckets:
    """The buckets of one rule: ``rps`` tokens a second, ``burst`` at most, per key."""

    __slots__ = ("_tat", "burst", "evicted", "interval", "max_keys", "rps", "window")

    def __init__(self, rps: float, burst: int, max_keys: int = MAX_KEYS) -> None:
        if rps <= 0 or burst < 1 or max_keys < 1:
            raise ValueError("rps must be > 0, burst and max_keys >= 1")
        self.rps = rps
        self.burst = burst
        self.interval = 1.0 / rps
        self.window = burst * self.interval
        """How far ahead of ``now`` a key's ``tat`` may be: a full bucket's worth."""
        self.max_keys = max_keys
        self._tat: OrderedDict[str, float] = OrderedDict()
        self.evicted = 0
        """Keys pushed out of the table to keep it within ``max_keys``: a running total."""

    def allow(self, key: str, now: float) -> bool:
        """``take(key, now).allowed``, without the ``Verdict``: what every request pays."""
        table = self._tat
        tat = table.get(key)
        if tat is None:
            tat = now
        else:
            table.move_to_end(key)
            if tat < now:
                tat = now
        after = tat + self.interval
        if after - now > self.window + 1e-9:
            return False
        table[key] = after
        if len(table) > self.max_keys:
            table.popitem(last=False)
            self.evicted += 1
        return True

    def take(self, key: str, now: float) -> Verdict:
        """Spend a token of ``key``'s bucket at ``now``, if it has one."""
        table = self._tat
        tat = table.get(key)
        if tat is None:
            tat = now
        else:
            table.move_to_end(key)
            if tat < now:
                tat = now
        after = tat + self.interval
        ahead = after - now
        if ahead > self.window + 1e-9:
            retry = ahead - self.window
            return Verdict(False, self.burst, 0, tat - now, retry)
        table[key] = after
        if len(table) > self.max_keys:
            table.popitem(last=False)
            self.evicted += 1
        remaining = math.floor((self.window - ahead) / self.interval + 1e-9)
        return Verdict(True, self.burst, remaining, ahead, 0.0)

    def __len__(self) -> int:
        return len(self._tat)

    def __repr__(self) -> str:
        return (
            f"<Buckets rps={self.rps:g} burst={self.burst} keys={len(self._tat)}"
            f"/{self.max_keys} evicted={self.evicted}>"
        )


class Rule:
    """A service's rate limit (``config.RateLimit``) and its buckets in this process.

    With ``share`` processes serving (worker processes), each enforces its share: ``rps /
    share`` and ``burst // share`` (at least 1). The kernel spreads connections over the
    workers, not requests: a client on one keep-alive connection meets one worker's share,
    one spread over many connections about the whole limit (Kong's ``local`` policy).
    """

    __slots__ = ("buckets", "burst", "header", "key", "path_prefix", "rps")

    def __init__(self, limit: RateLimit, share: int = 1, max_keys: int = MAX_KEYS) -> None:
        self.path_prefix = limit.path_prefix
        self.key = limit.key
        self.header = limit.key.partition(":")[2].encode()
        self.rps = limit.rps
        self.burst = limit.burst or math.ceil(limit.rps)
        self.buckets = Buckets(self.rps / share, max(1, self.burst // share), max_keys=max_keys)

    def __repr__(self) -> str:
        return f"<Rule {self.path_prefix} {self.key} {self.buckets!r}>"


def rules(
    limits: Sequence[RateLimit], share: int = 1, max_keys: int = MAX_KEYS
) -> tuple[Rule, ...]:
    """The rules of a service's ``rate_limits``, each with empty buckets."""
    return tuple(Rule(limit, share, max_keys) for limit in limits)
