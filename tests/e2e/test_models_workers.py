"""End to end: routing by model with two worker processes (issue 57): requests naming a model
reach its service through both workers, each worker answers ``/v1/models``, and the load
figures the main process scrapes steer the ``inference`` picks of both workers.

Each request goes on a connection of its own, so the kernel spreads them over the two
workers (``SO_REUSEPORT``); which worker answered is read from the workers' reports (their
``served`` tallies), once every request has been counted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from gateway import Supervisor
from tests.support.eventually import eventually

from .conftest import Gateways, Handle
from .test_models import model_spec, serving


def one_per_connection() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def served(supervisor: Supervisor, total: int) -> dict[int, int]:
    """Each worker's requests served (by pid), once the ``total`` made are all reported."""
    await eventually(
        lambda: sum(w.served for w in supervisor.workers.values()) == total,
        what=f"the workers' reports of {total} requests",
    )
    return {w.pid: w.served for w in supervisor.workers.values()}


def by_both(before: dict[int, int], after: dict[int, int]) -> bool:
    return len(after) == 2 and all(after[pid] > before.get(pid, 0) for pid in after)


async def start(gateways: Gateways) -> tuple[Handle, Supervisor]:
    gw = await gateways.start(workers=2, models={"path_prefix": "/v1"})
    supervisor = gw.gateway.traffic
    assert isinstance(supervisor, Supervisor)
    return gw, supervisor


async def test_both_workers_route_by_model_and_list_the_models(gateways: Gateways, tmp_path: Path):
    gw, supervisor = await start(gateways)
    await serving(gw, model_spec(tmp_path, "llama", {"name": "llama-3-8b", "aliases": ["llama"]}))
    await serving(gw, model_spec(tmp_path, "mistral", {"name": "mistral-7b"}))
    made = 0
    start_counts = await served(supervisor, 0)
    async with one_per_connection() as s:
        for i in range(30):
            model, replica = (
                ("llama", "llama"),
                ("llama-3-8b", "llama"),
                ("mistral-7b", "mistral"),
            )[i % 3]
            body = json.dumps({"model": model, "prompt": "hi"})
            async with s.post(gw.url + "/v1/completions", data=body) as response:
                assert response.status == 200
                answer: dict[str, Any] = await response.json(content_type=None)
            made += 1
            assert answer["replica"].startswith(replica + "-"), answer
            assert (answer["model"], answer["path"]) == (model, "/v1/completions")
        routed = await served(supervisor, made)
        assert by_both(start_counts, routed), routed

        async with s.post(gw.url + "/v1/chat/completions", data='{"model": "gpt-5"}') as response:
            assert response.status == 404
            error = (await response.json(content_type=None))["error"]
        made += 1
        assert (error["code"], error["param"]) == ("model_not_found", "model")

        listings = set()
        for _ in range(20):
            async with s.get(gw.url + "/v1/models") as response:
                assert response.status == 200
                listing = await response.json()
            made += 1
            listings.add(tuple(sorted((m["id"], m["owned_by"]) for m in listing["data"])))
        assert listings == {
            (("llama", "llama"), ("llama-3-8b", "llama"), ("mistral-7b", "mistral"))
        }
        listed = await served(supervisor, made)
        assert by_both(routed, listed), (routed, listed)


async def test_the_scraped_load_steers_both_workers_picks(gateways: Gateways, tmp_path: Path):
    gw, supervisor = await start(gateways)
    waiting = tmp_path / "waiting"
    waiting.mkdir()
    inference = {
        "load_balancing": "inference",
        "load_metrics": {"format": "vllm", "interval": 0.1, "max_age": 5},
    }
    spec = model_spec(tmp_path, "llama", {"name": "llama"}, **inference)
    spec["replica"]["env"]["WAITING_DIR"] = str(waiting)
    await serving(gw, spec)
    replicas = {r.id for r in gw.replicas(name="llama")}
    assert len(replicas) == 2
    prompts = iter(range(1_000_000))

    async def answered_by(n: int) -> list[str]:
        async with one_per_connection() as s:
            out = []
            for _ in range(n):  # prompts that share no prefix: placed by load alone
                data = json.dumps({"model": "llama", "prompt": f"{next(prompts)} upon a time"})
                async with s.post(gw.url + "/v1/completions", data=data) as response:
                    assert response.status == 200
                    out.append((await response.json(content_type=None))["replica"])
            return out

    made = 0
    # Idle alike, the two replicas share the requests.
    assert set(await answered_by(30)) == replicas
    made += 30
    busy, idle = sorted(replicas)
    (waiting / busy).write_text("100")
    llama = gw.gateway.pool.services["llama"]
    await eventually(
        lambda: busy in llama.reports and llama.reports[busy].waiting == 100,
        what="the busy replica's queue, scraped",
    )

    async def only_idle() -> bool:
        nonlocal made
        made += 10
        return set(await answered_by(10)) == {idle}

    await eventually(only_idle, what="the workers' picks to follow the figures")
    # Every new request goes to the idle replica, whichever worker picks.
    before = await served(supervisor, made)
    after = await answered_by(40)
    made += 40
    assert after.count(busy) == 0, after
    counts = await served(supervisor, made)
    assert by_both(before, counts), (before, counts)
