"""An event model of ``bench/inference.py``: the picks alone, without processes or CPU noise.

    PYTHONPATH=. .venv/bin/python bench/inference_model.py [--duration 30 --seeds 57,58,59]
        [--lag 0.005] [--prefix-chars 2200] [--compare old_inference.py]

The same replicas (``inference.Replica``'s prefix cache, a batch of 8, a FIFO, prefill per
uncached character, 32 tokens of decode), workloads (``Shared``, ``Unique``) and Poisson
arrivals as ``bench/inference.py`` with its defaults, in simulated time: each request is
picked by ``balancer.least_outstanding`` or by ``gateway.pool.inference.pick`` (the gateway's
code, with the in-flight counts it would see: a request counts from its pick to the end of
its answer, and the blocks of the prompts each replica was sent, as ``ServicePool.sent``
keeps them), reaches its replica 0.5 ms later, and the replicas are scraped every 50 ms, the
report arriving ``--lag`` seconds later with the gateway's count read then (as
``load_scraper`` does). The prefix key is the prompt's first ``--prefix-chars`` (2,200, as
the bench's). Prints TTFT p50 and p99 (ms) and the cache hit rate per workload, seed and
policy; ``--compare`` adds the pick of another copy of ``inference.py`` (say the one before a
change, from ``git show``; one that takes a ``home`` and a ring, as before the blocks, is
given the replica each prefix key first went to).
Because the model is deterministic, a difference between two picks is the picks', not the
machine's; what it leaves out (the gateway's and the replicas' CPU, the network stack) is
what the real bench adds.
"""

from __future__ import annotations

import argparse
import collections
import heapq
import importlib.util
import inspect
import itertools
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import inference as bench
from gateway.pool import balancer, hashring, prefixes
from gateway.pool import inference as pool_inference
from gateway.pool.upstream import Upstream

SCRAPE = 0.05
REACH = 0.0005
PREFIX_CHARS = 2200


def run(
    workload: str,
    seed: int,
    duration: float,
    lag: float,
    pick: ModuleType | None,
    prefix_chars: int = PREFIX_CHARS,
) -> Any:
    """One run: (TTFT p50 ms, TTFT p99 ms, hit rate); ``pick`` None: least_outstanding."""
    args = argparse.Namespace(
        systems=8, chats=96, turns=8, batch=8, cache_blocks=3000, prefill_us=50.0,
        decode_ms=4.0, tokens=32,
    )  # fmt: skip
    rng = random.Random(seed)
    load = bench.Shared(args, rng) if workload == "shared" else bench.Unique(args, rng)
    ups = [Upstream(f"u{i}", "sim", "127.0.0.1", 9000 + i) for i in range(4)]
    replicas = {u.id: bench.Replica(args) for u in ups}
    running = dict.fromkeys(replicas, 0)
    chars = dict.fromkeys(replicas, 0)
    waiting: dict[str, collections.deque[Any]] = {u: collections.deque() for u in replicas}
    inflight = dict.fromkeys(replicas, 0)
    reports: dict[str, pool_inference.ReplicaLoad] = {}
    ring = hashring.Ring([u.id for u in ups])
    seen: set[int] = set()
    placed: dict[int, str] = {}  # an older pick's memory (``--compare``), unbounded here
    sent = prefixes.Sent()  # the service pool's memory
    by_blocks = "matched" in inspect.signature(pick.pick).parameters if pick else False
    events: list[tuple[float, int, str, Any]] = []
    ttft: list[float] = []
    order = itertools.count()

    def push(at: float, kind: str, data: Any) -> None:
        heapq.heappush(events, (at, next(order), kind, data))

    arrivals, at = random.Random(seed + 1), 0.0
    while (at := at + arrivals.expovariate(100.0)) < duration:
        push(at, "arrive", None)
    for k in range(int(duration / SCRAPE) + 1):
        push(k * SCRAPE, "scrape", None)

    def begin(now: float, uid: str, request: Any) -> None:
        text, sent, _ = request
        chars[uid] += len(text)
        first = now + (len(text) - replicas[uid]._cached(text)) * args.prefill_us / 1e6
        ttft.append(first - sent)
        push(first + args.tokens * args.decode_ms / 1000, "end", (uid, request))

    cursor = 0
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            _, body, chat = load.next()
            text = bench.prompt_text(body)
            cursor += 1
            if pick is None:
                chosen = balancer.least_outstanding(ups, inflight, rng, cursor)
            elif by_blocks:
                blocks = prefixes.blocks_of(text[:prefix_chars].encode())
                matched = sent.matched(blocks, [u.id for u in ups])
                chosen = pick.pick(ups, inflight, reports, now, cursor, matched, 2.0)
                sent.sent(blocks, chosen.id)
            else:
                key = hashring.key_hash(text[:prefix_chars].encode())
                home = placed.get(key)
                fresh = key not in seen
                seen.add(key)
                homed = {"home": home} if "home" in inspect.signature(pick.pick).parameters else {}
                chosen = pick.pick(
                    ups, inflight, reports, now, cursor, ring, key, 2.0, fresh, **homed
                )
                placed.setdefault(key, chosen.id)
            inflight[chosen.id] += 1
            push(now + REACH, "reach", (chosen.id, (text, now, chat)))
        elif kind == "reach":
            uid, request = data
            if running[uid] >= args.batch:
                waiting[uid].append(request)
            else:
                running[uid] += 1
                begin(now, uid, request)
        elif kind == "end":
            uid, request = data
            chars[uid] -= len(request[0])
            load.done(request[2])
            inflight[uid] -= 1
            if waiting[uid]:
                begin(now, uid, waiting[uid].popleft())
            else:
                running[uid] -= 1
        elif kind == "scrape":
            kv = {u: min(1.0, chars[u] / bench.BLOCK / args.cache_blocks) for u in replicas}
            push(now + lag, "report", {u: (len(waiting[u]), running[u], kv[u]) for u in kv})
        else:
            reports = {
                u: pool_inference.ReplicaLoad(w, r, k, now, now + 0.2, inflight[u])
                for u, (w, r, k) in data.items()
            }
    ttft.sort()
    queries = sum(r.queries for r in replicas.values())
    hits = sum(r.hits for r in replicas.values()) / queries
    return ttft[len(ttft) // 2] * 1000, ttft[int(0.99 * len(ttft))] * 1000, hits


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--seeds", default="57,58,59")
    parser.add_argument("--lag", type=float, default=0.005, help="a report's delay (s)")
    parser.add_argument("--workloads", default="unique,shared")
    parser.add_argument("--compare", type=Path, help="another inference.py to pick with")
    parser.add_argument("--prefix-chars", type=int, default=PREFIX_CHARS)
    args = parser.parse_args()
    picks: list[tuple[str, ModuleType | None]] = [
        ("least_outstanding", None),
        ("inference", pool_inference),
    ]
    if args.compare:
        spec = importlib.util.spec_from_file_location("gateway.pool._compared", args.compare)
        assert spec is not None
        assert spec.loader is not None
        compared = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = compared  # its dataclass looks itself up there
        spec.loader.exec_module(compared)
        picks.append((f"inference ({args.compare.name})", compared))
    for workload in args.workloads.split(","):
        for seed in map(int, args.seeds.split(",")):
            for name, module in picks:
                p50, p99, hits = run(
                    workload, seed, args.duration, args.lag, module, args.prefix_chars
                )
                print(
                    f"{workload:7} seed {seed} {name:34} TTFT p50 {p50:6.1f} ms  "
                    f"p99 {p99:6.1f} ms  hit rate {hits:5.1%}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
