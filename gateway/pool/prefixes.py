"""Where a service's prompt prefixes were sent lately (``load_balancing: inference``). PURE.

A prompt's key (its first ``prefix_chars``) is cut into blocks of ``BLOCK`` bytes, the last
one maybe shorter, and each block's hash is chained on the one before it, as vLLM's prefix
cache hashes its KV blocks: two prompts have their first k block hashes in common exactly
when they have their first k blocks in common (a system prompt; a conversation's history).
``Sent`` remembers which replica each block was sent to, the most recent ``PREFIX_BLOCKS``
(block, replica) pairs, and says how many leading blocks of a prompt each replica was sent:
what its prefix cache likely holds (the Gateway API Inference Extension's approximate
prefix-cache index works so; SGLang's router keeps a radix tree per worker).

Invariants: at most ``PREFIX_BLOCKS`` pairs are kept, the least recently sent go first; a
replica's match counts leading blocks only; a replica forgotten (``keep``) matches nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Final

BLOCK: Final = 256
"""Bytes of the prompt's text a block covers (some 64 tokens)."""
PREFIX_BLOCKS: Final = 65_536
"""(block, replica) pairs a service's pool remembers: 16 MiB of prompt text in all, more
than a dozen replicas' prefix caches hold."""


def blocks_of(key: bytes) -> list[int]:
    """The chained hashes of ``key``'s blocks (process-local: each process keeps its own
    memory, so Python's salted ``hash`` serves)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(key), BLOCK):
        h = hash((h, key[start : start + BLOCK]))
        out.append(h)
    return out


class Sent:
    """The replicas each prompt block was sent to lately (an LRU of (block, replica) pairs)."""

    __slots__ = ("limit", "pairs", "salts")

    def __init__(self, limit: int = PREFIX_BLOCKS) -> None:
        self.limit = limit
        self.pairs: OrderedDict[int, str] = OrderedDict()
        """A pair's key (a block's hash xor its replica's salt) -> the replica."""
        self.salts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"<Sent pairs={len(self.pairs)}/{self.limit} replicas={len(self.salts)}>"

    def _salt(self, uid: str) -> int:
        salt = self.salts.get(uid)
        if salt is None:
            salt = self.salts[uid] = hash(("replica", uid))
        return salt

    def matched(self, blocks: Sequence[int], ids: Sequence[str]) -> list[int]:
        """For each of ``ids``: how many of ``blocks``, from the first, it was sent."""
        pairs = self.pairs
        out: list[int] = []
        for uid in ids:
            salt = self._salt(uid)
            n = 0
            for h in blocks:
                if (h ^ salt) not in pairs:
                    break
                n += 1
            out.append(n)
        return out

    def sent(self, blocks: Sequence[int], uid: str) -> None:
        """``blocks`` went to ``uid``: the most recent pairs now."""
        pairs = self.pairs
        salt = self._salt(uid)
        for h in blocks:
            k = h ^ salt
            if k in pairs:
                pairs.move_to_end(k)
            else:
                pairs[k] = uid
        while len(pairs) > self.limit:
            pairs.popitem(last=False)

    def keep(self, ids: Collection[str]) -> None:
        """Forget every replica not in ``ids`` (one that left: its cache is not ours to
        count on when it comes back)."""
        if any(uid not in ids for uid in self.salts):
            self.pairs = OrderedDict((k, v) for k, v in self.pairs.items() if v in ids)
            self.salts = {uid: s for uid, s in self.salts.items() if uid in ids}
