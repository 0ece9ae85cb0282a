"""Inference-aware routing against the general policies, on simulated model servers.

    PYTHONPATH=. .venv/bin/python bench/inference.py [--duration 30 --repeat 3 --pure]

Four simulated OpenAI-compatible replicas (``replica`` below, one process on loopback) behind
one gateway (``gateway serve``, a ``static`` service at their four addresses, ``models:
{path_prefix: /v1}``), for each policy in turn: ``round_robin``, ``least_outstanding`` and
``inference`` (``prefix_chars`` 2,200: a system prompt and a conversation's first question,
as the JSON text counts them; ``load_metrics`` in vLLM's names every 50 ms, as the Gateway API
Inference Extension's endpoint picker scrapes; ``--no-load-metrics``: in-flight counts alone).
Replicas and gateway start afresh for each run, so every run begins with cold caches. Two
workloads, open loop (Poisson arrivals at ``--rate`` a second, one seeded draw shared by the
policies):

- ``shared``: multi-turn chats: each of ``--chats`` conversations begins with one of
  ``--systems`` system prompts (2,000 characters) and its first question, and each turn
  sends the whole history (every answer so far, 240 characters each) with a new question;
  after ``--turns`` turns a conversation starts over (a new one);
- ``unique``: a prompt of 2,000 random characters each.

A replica (the simulation): a prefix cache of ``--cache-blocks`` blocks of 64 characters
(LRU; a block is its whole prefix's hash, as vLLM's), a batch of at most ``--batch`` requests
running and a FIFO of the rest waiting; a running request first fills its prompt (prefill:
``--prefill-us`` per character not found in the cache, from its first block missing), then
writes its first token (TTFT, as the client measures it: to the first byte of the answer's
body) and decodes ``--tokens`` tokens at ``--decode-ms`` each, streamed. Its ``/metrics``
says ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (the running requests' share of the cache) and
``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (characters), from
which the hit rate is read. Times are asyncio sleeps: the simulation costs no CPU to speak of.

Reported per workload and policy, medians over ``--repeat`` interleaved repetitions (a p99
of a few thousand answers moves by tens of milliseconds between runs on a shared machine):
TTFT p50 and p99 (ms), throughput (answers a second), the cache hit rate, failed requests;
the table goes to the ``inference`` section of bench/RESULTS.md (``--output``). Everything is
on 127.0.0.1 and bounded by ``--duration``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
POLICIES = ("round_robin", "least_outstanding", "inference")
BLOCK = 64
SYSTEM_CHARS = 2000
QUESTION_CHARS = 120
ANSWER_CHARS = 240


# -- the simulated replica ---------------------------------------------------------------------


class Replica:
    """One simulated model server (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.running = 0
        self.running_chars = 0
        self.waiting: collections.deque[asyncio.Future[None]] = collections.deque()
        self.queries = 0
        self.hits = 0

    def _blocks(self, text: str) -> list[int]:
        out, h = [], 0
        for i in range(0, len(text) - len(text) % BLOCK, BLOCK):
            h = hash((h, text[i : i + BLOCK]))
            out.append(h)
        return out

    def _cached(self, text: str) -> int:
        """Characters of ``text`` found in the cache (its leading blocks); then every block
        of it is cached (the least recently used go)."""
        blocks = self._blocks(text)
        hit = 0
        for h in blocks:
            if h not in self.cache:
                break
            hit += 1
        for h in blocks:
            self.cache[h] = None
            self.cache.move_to_end(h)
        while len(self.cache) > self.args.cache_blocks:
            self.cache.popitem(last=False)
        self.queries += len(text)
        self.hits += hit * BLOCK
        return hit * BLOCK

    async def complete(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        text = prompt_text(body)
        if self.running >= self.args.batch:
            slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self.waiting.append(slot)
            await slot  # handed its slot by the request that ended (running stays counted)
        else:
            self.running += 1
        self.running_chars += len(text)
        try:
            missing = len(text) - self._cached(text)
            await asyncio.sleep(missing * self.args.prefill_us / 1e6)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for _ in range(self.args.tokens):
                await response.write(b'data: {"choices": [{"text": "x"}]}\n\n')
                await asyncio.sleep(self.args.decode_ms / 1000)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        finally:
            self.running_chars -= len(text)
            if self.waiting:
                self.waiting.popleft().set_result(None)
            else:
                self.running -= 1

    async def metrics(self, request: Any) -> Any:
        from aiohttp import web

        kv = min(1.0, self.running_chars / BLOCK / self.args.cache_blocks)
        lines = [
            f"vllm:num_requests_running {self.running}",
            f"vllm:num_requests_waiting {len(self.waiting)}",
            f"vllm:kv_cache_usage_perc {kv}",
            f"vllm:prefix_cache_queries_total {self.queries}",
            f"vllm:prefix_cache_hits_total {self.hits}",
        ]
        return web.Response(text="\n".join(lines) + "\n")

    async def health(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="ok")


def prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return "".join(f"{m['role']}: {m['content']}\n" for m in body["messages"])
    return str(body.get("prompt", ""))


async def serve_replicas(args: argparse.Namespace) -> None:
    from aiohttp import web

    runners = []
    for port in args.ports:
        replica = Replica(args)
        app = web.Application()
        app.router.add_post("/v1/chat/completions", replica.complete)
        app.router.add_post("/v1/completions", replica.complete)
        app.router.add_get("/metrics", replica.metrics)
        app.router.add_get("/", replica.health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
    await asyncio.Event().wait()


# -- the workloads -----------------------------------------------------------------------------


def words(rng: random.Random, chars: int) -> str:
    out = []
    n = 0
    while n < chars:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        out.append(word)
        n += len(word) + 1
    return " ".join(out)[:chars]


@dataclass
class Chat:
    system: str
    turns: list[dict[str, str]]
    busy: bool = False


class Shared:
    """Multi-turn chats over a few system prompts."""

    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.rng = rng
        self.args = args
        self.systems = [words(rng, SYSTEM_CHARS) for _ in range(args.systems)]
        self.chats = [self._new() for _ in range(args.chats)]

    def _new(self) -> Chat:
        return Chat(self.rng.choice(self.systems), [])

    def next(self) -> tuple[str, dict[str, Any], Chat | None]:
        free = [c for c in self.chats if not c.busy]
        chat = self.rng.choice(free) if free else self._new()
        if len(chat.turns) >= 2 * self.args.turns:
            chat.system, chat.turns = self.rng.choice(self.systems), []
        chat.turns.append({"role": "user", "content": words(self.rng, QUESTION_CHARS)})
        messages = [{"role": "system", "content": chat.system}, *chat.turns]
        chat.busy = True
        return "/v1/chat/completions", {"model": "sim", "messages": messages}, chat

    def done(self, chat: Chat | None) -> None:
        if chat is not None:
            chat.turns.append({"role": "assistant", "content": words(self.rng, ANSWER_CHARS)})
            chat.busy = False


class Unique:
    def __init__(self, args: argparse.Namespace, rng: random.Random) -> None:
        self.rng = rng

    def next(self) -> tuple[str, dict[str, Any], Chat | None]:
        return "/v1/completions", {"model": "sim", "prompt": words(self.rng, SYSTEM_CHARS)}, None

    def done(self, chat: Chat | None) -> None:
        pass


# -- one run -----------------------------------------------------------------------------------


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def gateway_config(
    tmp: Path,
    ports: list[int],
    listen: int,
    admin: int,
    policy: str,
    prefix_chars: int,
    load_factor: float,
    load_metrics: bool,
) -> dict:
    service: dict[str, Any] = {
        "name": "sim",
        "route": {"path_prefix": "/sim"},
        "backend": "static",
        "replicas": len(ports),
        "replica": {"addresses": [f"127.0.0.1:{p}" for p in ports]},
        "model": {"name": "sim"},
        "probes": [{"type": "http", "path": "/", "interval": "200ms", "healthy_threshold": 1}],
        "load_balancing": (
            {"policy": policy, "prefix_chars": prefix_chars, "max_load_factor": load_factor}
            if policy == "inference"
            else policy
        ),
        "timeouts": {"read": 60},
        "retries": {"attempts": 0},
    }
    if policy == "inference" and load_metrics:
        service["load_metrics"] = {"format": "vllm", "interval": "50ms", "max_age": "200ms"}
    return {
        "listen": f"127.0.0.1:{listen}",
        "admin": {"listen": f"127.0.0.1:{admin}", "token_env": None},
        "state_dir": str(tmp / f"state-{policy}"),
        "access_log": {"enabled": False},
        "log_level": "warning",
        "models": {"path_prefix": "/v1"},
        "replicas_on_exit": "stop",
        "services": [service],
    }


def start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **env}, cwd=REPO,
        )  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(5)


@dataclass
class Result:
    ttft: list[float]
    answered: int
    failed: int
    seconds: float
    hit_rate: float


async def drive(
    url: str, workload: Shared | Unique, arrivals: list[float], duration: float
) -> tuple[list[float], int, int, float]:
    import aiohttp

    ttft: list[float] = []
    failed = 0
    answered = 0
    loop = asyncio.get_running_loop()
    began = loop.time()

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal failed, answered
        path, body, chat = workload.next()
        sent = loop.time()
        try:
            async with session.post(url + path, json=body) as response:
                if response.status != 200:
                    failed += 1
                    await response.read()
                    return
                await response.content.readany()
                ttft.append(loop.time() - sent)
                await response.read()
                answered += 1
        except (aiohttp.ClientError, OSError, TimeoutError):
            failed += 1
        finally:
            workload.done(chat)

    timeout = aiohttp.ClientTimeout(total=duration + 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = []
        for at in arrivals:
            delay = began + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(session)))
        await asyncio.gather(*tasks)
    return ttft, answered, failed, loop.time() - began


def read_counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def run_one(args: argparse.Namespace, tmp: Path, workload_name: str, policy: str) -> Result:
    import urllib.request

    ports = free_ports(6)
    replicas, (listen, admin) = ports[:4], ports[4:]
    argv = [sys.executable, __file__, "replica", "--ports", ",".join(map(str, replicas))]
    argv += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in SIM]
    sim = start(argv, tmp / f"replicas-{workload_name}-{policy}.log", {})
    conf = tmp / f"gateway-{workload_name}-{policy}.json"
    conf.write_text(
        json.dumps(
            gateway_config(
                tmp,
                replicas,
                listen,
                admin,
                policy,
                args.prefix_chars,
                args.max_load_factor,
                not args.no_load_metrics,
            )
        )
    )
    env = {"PYTHONPATH": str(REPO), **({"GATEWAY_NATIVE": "0"} if args.pure else {})}
    gw_argv = [sys.executable, "-m", "controller.main", "serve", "-c", str(conf)]
    gw = start(gw_argv, tmp / f"gateway-{workload_name}-{policy}.log", env)
    try:
        url = f"http://127.0.0.1:{listen}"
        deadline = time.monotonic() + 30
        while True:  # the service's model answers once a replica is routable
            try:
                request = urllib.request.Request(
                    url + "/v1/completions", data=b'{"model": "sim", "prompt": "warm"}'
                )
                with urllib.request.urlopen(request, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or gw.poll() is not None:
                raise RuntimeError(f"gateway not serving: {conf}")
            time.sleep(0.2)
        time.sleep(1.0)  # every replica routable (probes every 200 ms)
        rng = random.Random(args.seed)
        workload = Shared(args, rng) if workload_name == "shared" else Unique(args, rng)
        arrivals_rng = random.Random(args.seed + 1)
        arrivals, at = [], 0.0
        while True:
            at += arrivals_rng.expovariate(args.rate)
            if at >= args.duration:
                break
            arrivals.append(at)
        ttft, answered, failed, seconds = asyncio.run(drive(url, workload, arrivals, args.duration))
        queries = hits = 0.0
        for port in replicas:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                text = r.read().decode()
            queries += read_counter(text, "vllm:prefix_cache_queries_total")
            hits += read_counter(text, "vllm:prefix_cache_hits_total")
        return Result(ttft, answered, failed, seconds, hits / queries if queries else 0.0)
    finally:
        stop(gw)
        stop(sim)


SIM = ("batch", "cache_blocks", "prefill_us", "decode_ms", "tokens")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", nargs="?", default="bench", choices=["bench", "replica"])
    parser.add_argument("--ports", type=lambda s: [int(p) for p in s.split(",")], default=[])
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--repeat", type=int, default=3, help="medians over the repetitions")
    parser.add_argument("--rate", type=float, default=100.0, help="requests a second")
    parser.add_argument("--seed", type=int, default=57)
    parser.add_argument("--systems", type=int, default=8)
    parser.add_argument("--chats", type=int, default=96)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int, default=3000)
    parser.add_argument("--prefill-us", type=float, default=50.0, help="per uncached character")
    parser.add_argument("--decode-ms", type=float, default=4.0)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument(
        "--prefix-chars", type=int, default=2200, help="inference's: a system prompt and a question"
    )
    parser.add_argument("--max-load-factor", type=float, default=2.0, help="inference's")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--no-load-metrics", action="store_true", help="inference by in-flight counts alone"
    )
    parser.add_argument("--workloads", default="shared,unique")
    parser.add_argument("--pure", action="store_true", help="the gateway's pure modules")
    parser.add_argument("--output", type=Path, default=REPO / "bench" / "RESULTS.md")
    args = parser.parse_args()
    if args.what == "replica":
        asyncio.run(serve_replicas(args))
        return 0
    import tempfile

    tmp = Path(tempfile.mkdtemp(prefix="gateway-inference-"))
    rows = []
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    runs: dict[tuple[str, str], list[Result]] = collections.defaultdict(list)
    for repetition in range(args.repeat):  # interleaved: a slow spell hits every policy
        for workload in args.workloads.split(","):
            for policy in args.policies.split(","):
                result = run_one(args, tmp, workload, policy)
                runs[workload, policy].append(result)
                print(
                    f"{repetition + 1}/{args.repeat} {workload:7} {policy:18} "
                    f"TTFT p50 {percentile(result.ttft, 0.5) * 1000:7.1f} ms  "
                    f"p99 {percentile(result.ttft, 0.99) * 1000:7.1f} ms  "
                    f"{result.answered / result.seconds:6.1f}/s  hit rate {result.hit_rate:5.1%}  "
                    f"failed {result.failed}",
                    flush=True,
                )
    for (workload, policy), results in runs.items():
        rows.append(
            (
                workload,
                policy,
                statistics.median(percentile(r.ttft, 0.5) * 1000 for r in results),
                statistics.median(percentile(r.ttft, 0.99) * 1000 for r in results),
                statistics.median(r.answered / r.seconds for r in results),
                statistics.median(r.hit_rate for r in results),
                sum(r.failed for r in results),
                ", ".join(f"{percentile(r.ttft, 0.99) * 1000:.0f}" for r in results),
            )
        )
    command = " ".join(["PYTHONPATH=. .venv/bin/python bench/inference.py", *sys.argv[1:]])
    table = [
        "| workload | policy | TTFT p50 (ms) | TTFT p99 (ms) | p99 of each run | answers/s "
        "| cache hit rate | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(
            f"| {w} | {p} | {p50:.1f} | {p99:.1f} | {each} | {rps:.1f} | {hit:.1%} | {failed} |"
            for w, p, p50, p99, rps, hit, failed, each in rows
        ),
    ]
    shown = (
        "duration",
        "repeat",
        "rate",
        *SIM,
        "prefix_chars",
        "max_load_factor",
        "no_load_metrics",
    )
    settings = ", ".join(f"{k} {getattr(args, k)}" for k in shown)
    section = "\n".join(
        [
            "<!-- inference:start -->",
            "## Inference-aware routing (issue 57): simulated model servers",
            "",
            f"{started}, `{command}` ({settings}; gateway "
            f"{'pure' if args.pure else 'as built'}). Method: `bench/inference.py`'s docstring.",
            "",
            *table,
            "<!-- inference:end -->",
        ]
    )
    print(section)
    if args.output:
        text = args.output.read_text() if args.output.exists() else ""
        pattern = re.compile(r"<!-- inference:start -->.*?<!-- inference:end -->", re.DOTALL)
        text = pattern.sub(section, text) if pattern.search(text) else text + "\n" + section + "\n"
        args.output.write_text(text)
    summary = {(w, p): (p99, hit) for w, p, _, p99, _, hit, _, _ in rows}
    for workload in args.workloads.split(","):
        lo, inf = summary.get((workload, "least_outstanding")), summary.get((workload, "inference"))
        if lo and inf:
            print(f"{workload}: inference/least_outstanding TTFT p99 {inf[0] / lo[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
