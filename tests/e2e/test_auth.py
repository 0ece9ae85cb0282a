"""End to end: bearer tokens on a service through the real gateway, in one process and with
two worker processes. 401s with WWW-Authenticate and a JSON body, the token stripped before
the replica sees it (or passed on when asked), tokens added and revoked through the admin API
without a restart (and in every worker), kept across a restart, counted by outcome in
/metrics and in the service's status."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.eventually import eventually

from .conftest import PROBE, Gateways, Handle, serving

ECHO = f"{sys.executable} {Path(__file__).parent / 'echo_replica.py'}"
TOKEN = "file-token-0123456789abcdef"


def echo_spec(tmp_path: Path, replicas: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": "web",
        "route": {"path_prefix": "/"},
        "replicas": replicas,
        "replica": {"commands": [ECHO], "working_dir": str(tmp_path)},
        "probes": [PROBE],
        "rollout": {"start_timeout": 10, "drain_timeout": 2, "stop_grace": 1},
        **extra,
    }


async def get(
    session: aiohttp.ClientSession, url: str, token: str | None = None, **headers: str
) -> tuple[int, Any, Any]:
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    async with session.get(url, headers=headers) as response:
        return response.status, response.headers.copy(), await response.json()


def admin(handle: Handle) -> str:
    return f"http://127.0.0.1:{handle.gateway.admin.port}"


async def metric(session: aiohttp.ClientSession, handle: Handle, line: str) -> float | None:
    async with session.get(admin(handle) + "/metrics") as response:
        for row in (await response.text()).splitlines():
            if row.startswith(line + " "):
                return float(row.rsplit(" ", 1)[1])
    return None


@pytest.mark.parametrize("workers", [0, 2])
async def test_bearer_tokens_end_to_end(gateways: Gateways, tmp_path: Path, workers: int):
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"# the CI's key\n{TOKEN}\n")
    gw = await gateways.start(**({"workers": workers} if workers else {}))
    await serving(gw, echo_spec(tmp_path, auth={"type": "bearer", "tokens_file": str(tokens_file)}))
    async with aiohttp.ClientSession() as s:
        status, headers, body = await get(s, gw.url + "/x")
        assert status == 401
        assert headers["WWW-Authenticate"].startswith("Bearer")
        assert body["error"] == "unauthorized"
        assert body["message"] == "this service needs a bearer token"
        assert "X-Request-Id" in headers
        status, _, body = await get(s, gw.url + "/x", "wrong-token-0000000000")
        assert (status, body["message"]) == (401, "the bearer token is not valid for this service")
        status, _, body = await get(s, gw.url + "/x", TOKEN)
        assert status == 200
        assert "authorization" not in body["headers"]  # stripped before the replica
        assert body["headers"]["x-forwarded-for"] == "127.0.0.1"

        # Added through the admin API: made, shown once, accepted in every process at once.
        async with s.post(admin(gw) + "/api/services/web/tokens", json={"label": "ops"}) as r:
            assert r.status == 201
            added = await r.json()
        secret = added["secret"]
        assert added["token"]["id"].startswith("tok_")

        async def accepted(token: str) -> bool:
            # Each new connection may reach another worker: all must agree, 6 times over.
            results = set()
            for _ in range(6):
                async with aiohttp.ClientSession() as fresh:
                    results.add((await get(fresh, gw.url + "/", token))[0])
            return results == {200}

        async def refused(token: str) -> bool:
            results = set()
            for _ in range(6):
                async with aiohttp.ClientSession() as fresh:
                    results.add((await get(fresh, gw.url + "/", token))[0])
            return results == {401}

        await eventually(lambda: accepted(secret), what="the new token in every process")
        async with s.get(admin(gw) + "/api/services/web/tokens") as r:
            listed = await r.json()
        assert [(t["source"], t["label"]) for t in listed["tokens"]] == [
            ("file", ""),
            ("api", "ops"),
        ]
        assert secret not in json.dumps(listed)
        async with s.delete(admin(gw) + f"/api/services/web/tokens/{added['token']['id']}") as r:
            assert r.status == 200
        await eventually(lambda: refused(secret), what="the revoked token refused everywhere")
        assert await accepted(TOKEN)

        # Counted by outcome, workers' requests included (they report every second).
        async def counted() -> bool:
            ok = await metric(s, gw, 'gateway_auth_requests_total{outcome="ok",service="web"}')
            wrong = await metric(
                s, gw, 'gateway_auth_requests_total{outcome="wrong",service="web"}'
            )
            missing = await metric(
                s, gw, 'gateway_auth_requests_total{outcome="missing",service="web"}'
            )
            return (missing, wrong) == (1, 1 + 6) and ok is not None and ok >= 1 + 6 + 6

        await eventually(counted, what="the auth counts in /metrics")
        async with s.get(admin(gw) + "/api/services/web") as r:
            guards = (await r.json())["guards"]
        assert guards["auth"]["tokens"] == 1
        assert guards["auth"]["missing"] == 1

        # pass_token: applied at once (routing), the replica sees the header.
        data = echo_spec(
            tmp_path,
            auth={"type": "bearer", "tokens_file": str(tokens_file), "pass_token": True},
        )
        await gw.controller.apply(data)

        async def passed() -> bool:
            async with aiohttp.ClientSession() as fresh:
                _, _, body = await get(fresh, gw.url + "/", TOKEN)
            return body["headers"].get("authorization") == f"Bearer {TOKEN}"

        await eventually(passed, what="pass_token in every process")


async def test_api_tokens_survive_a_restart(gateways: Gateways, tmp_path: Path):
    gw = await gateways.start()
    await serving(gw, echo_spec(tmp_path, auth={"type": "bearer", "header": "X-Api-Key"}))
    async with aiohttp.ClientSession() as s:
        async with s.post(
            admin(gw) + "/api/services/web/tokens",
            json={"token": "given-token-abcdef0123", "label": "ci"},
        ) as r:
            assert r.status == 201
            assert (await r.json())["secret"] is None  # given, so never echoed
        status, _, body = await get(s, gw.url + "/", **{"X-Api-Key": "given-token-abcdef0123"})
        assert status == 200
        assert "x-api-key" not in body["headers"]
    await gw.stop()
    gw = await gateways.start()
    await eventually(lambda: gw.ready() == 1, what="the restored replica")
    async with aiohttp.ClientSession() as s:
        status, _, _ = await get(s, gw.url + "/", **{"X-Api-Key": "given-token-abcdef0123"})
        assert status == 200
        assert (await get(s, gw.url + "/"))[0] == 401
    files = [f for f in (tmp_path / "state").rglob("*") if f.is_file()]
    assert any(f.suffix == ".db" for f in files)
    for f in files:  # the store, its journal, the logs: no token anywhere
        assert b"given-token-abcdef0123" not in f.read_bytes(), f
