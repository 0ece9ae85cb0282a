"""Routing by model on the traffic listener (``models`` in the proxy config), against real
aiohttp upstreams on loopback."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from aiohttp import web

from gateway.health.load_scraper import LoadScraper
from gateway.pool.upstream import Health
from tests.support.h2_client import H2Client

from .conftest import raw_request, routing, url

MODELS = {"models": {"path_prefix": "/v1", "max_body_read": 1024}}


def digest_app(name: str) -> web.Application:
    """An upstream that says who it is and what it got: path, body length and digest."""

    async def answer(request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response(
            {
                "upstream": name,
                "path": request.raw_path,
                "bytes": len(body),
                "sha": hashlib.sha256(body).hexdigest(),
            }
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    return app


async def two_models(pool: Any, upstream: Any, **extra: Any) -> None:
    pool.set_service(routing("llama", prefix="/llama", model={"name": "llama", "aliases": ["l3"]}))
    pool.set_service(routing("mistral", prefix="/mistral", model={"name": "mistral"}, **extra))
    await upstream("llama", "llama-1", digest_app("llama-1"))
    await upstream("mistral", "mistral-1", digest_app("mistral-1"))


async def post(client: Any, gw: Any, path: str, data: bytes, **kwargs: Any) -> tuple[int, Any]:
    async with client.post(url(gw, path), data=data, **kwargs) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_a_post_goes_to_the_service_of_its_model_body_unchanged(
    pool, upstream, gateway, client
):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    for model, expected in (("llama", "llama-1"), ("l3", "llama-1"), ("mistral", "mistral-1")):
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/x?y=1"):
            data = json.dumps({"model": model, "prompt": "hello"}).encode()
            status, body = await post(client, gw, path, data)
            assert status == 200, (model, path, body)
            assert body["upstream"] == expected
            assert body["path"] == path  # forwarded as it came
            assert body["sha"] == hashlib.sha256(data).hexdigest()


async def test_a_body_longer_than_the_read_is_relayed_whole(pool, upstream, gateway, client):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    data = json.dumps({"model": "mistral", "prompt": "x" * 200_000}).encode()

    async def chunks():  # chunked, in pieces
        for i in range(0, len(data), 7000):
            yield data[i : i + 7000]

    for body_form in (data, chunks()):
        status, body = await post(client, gw, "/v1/completions", body_form)
        assert (status, body["upstream"], body["bytes"]) == (200, "mistral-1", len(data))
        assert body["sha"] == hashlib.sha256(data).hexdigest()
    # Expect: 100-continue: the gateway asks for the body it reads.
    status, body = await post(client, gw, "/v1/completions", data, expect100=True)
    assert (status, body["bytes"]) == (200, len(data))


async def test_unknown_and_missing_models_are_openai_errors(pool, upstream, gateway, client):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    status, body = await post(client, gw, "/v1/chat/completions", b'{"model": "gpt-9"}')
    assert status == 404
    assert body == {
        "error": {
            "message": "The model 'gpt-9' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    status, body = await post(client, gw, "/v1/chat/completions", b'{"messages": []}')
    assert (status, body["error"]["code"]) == (400, "bad_request")
    late = json.dumps({"prompt": "x" * 2000, "model": "llama"}).encode()
    status, body = await post(client, gw, "/v1/completions", late)
    assert (status, body["error"]["code"]) == (400, "bad_request")
    assert "first 1024 bytes" in body["error"]["message"]


async def test_models_are_listed_in_openais_format(pool, upstream, gateway, client):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    async with client.get(url(gw, "/v1/models")) as resp:
        assert resp.status == 200
        listing = await resp.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["l3", "llama", "mistral"]
    async with client.get(url(gw, "/v1/models/l3")) as resp:
        assert (resp.status, (await resp.json())["owned_by"]) == (200, "llama")
    async with client.get(url(gw, "/v1/models/nope")) as resp:
        assert (resp.status, (await resp.json())["error"]["code"]) == (404, "model_not_found")


async def test_gateway_errors_on_model_paths_take_openais_shape(pool, upstream, gateway, client):
    token = "secret-token"
    digest = hashlib.sha256(token.encode()).hexdigest()
    await two_models(pool, upstream, auth={"tokens": {digest: "t1"}})
    pool.set_health("llama", "llama-1", Health.UNHEALTHY)
    gw = await gateway(**MODELS)
    status, body = await post(client, gw, "/v1/completions", b'{"model": "llama"}')
    assert (status, body["error"]["code"], body["error"]["type"]) == (
        503,
        "no_routable_upstream",
        "server_error",
    )
    # The model's service's auth applies.
    status, body = await post(client, gw, "/v1/completions", b'{"model": "mistral"}')
    assert (status, body["error"]["type"]) == (401, "authentication_error")
    headers = {"Authorization": f"Bearer {token}"}
    status, body = await post(
        client, gw, "/v1/completions", b'{"model": "mistral"}', headers=headers
    )
    assert (status, body["upstream"]) == (200, "mistral-1")


BIG = 20_000  # over the default max_header_size (16 KiB)


@pytest.mark.parametrize(
    ("head", "status", "code"),
    [
        (b"POST {path}?q=" + b"a" * BIG + b" HTTP/1.1\r\nHost: h\r\n\r\n", 414, "uri_too_long"),
        (b"POST {path} HTTP/1.1\r\nHost: h\r\nX-Big: " + b"b" * BIG + b"\r\n\r\n", 431, None),
        (
            b"POST {path} HTTP/1.1\r\nHost: h\r\n"
            + b"".join(b"X-%d: 1\r\n" % i for i in range(200))
            + b"\r\n",
            431,
            None,
        ),
        (b"POST {path} HTTP/1.1\r\nHost h\r\n\r\n", 400, "bad_request"),
        (b"POST {path} HTTP/1.1\r\nHost: h\r\nContent-Length: x\r\n\r\n", 400, "bad_request"),
    ],
    ids=["long-uri", "long-value", "many-headers", "malformed", "bad-length"],
)
async def test_heads_the_codec_refuses_on_model_paths_take_openais_shape(
    pool, upstream, gateway, head, status, code
):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    code = code or "header_too_large"
    for path in (b"/v1/chat/completions", b"/v1"):
        answer = await raw_request(gw.port, head.replace(b"{path}", path))
        first, _, body = answer.partition(b"\r\n\r\n")
        assert first.split(b" ", 2)[1] == b"%d" % status
        assert b"\r\nconnection: close" in first.lower()
        error = json.loads(body)["error"]
        assert (error["code"], error["type"], error["param"]) == (
            code,
            "invalid_request_error",
            None,
        )
        assert error["message"]
    # Elsewhere, the gateway's own shape, as before.
    for path in (b"/llama/v1/completions", b"/v1x"):
        answer = await raw_request(gw.port, head.replace(b"{path}", path))
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"] == code


@pytest.mark.parametrize(
    ("suffix", "headers", "authority", "status", "code"),
    [
        ("?q=" + "a" * BIG, [], "h", 414, "uri_too_long"),
        ("", [("x-big", "b" * BIG)], "h", 431, "header_too_large"),
        ("", [], "bad host!", 400, "bad_request"),
    ],
    ids=["long-target", "long-value", "bad-authority"],
)
async def test_streams_the_http2_codec_refuses_on_model_paths_take_openais_shape(
    pool, upstream, gateway, suffix, headers, authority, status, code
):
    """As HTTP/1.1's heads above: an HTTP/2 stream refused before routing (its connection
    serves on) is answered in OpenAI's shape under the prefix, in the gateway's elsewhere."""
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    client = await H2Client.connect(gw.port)
    try:
        answers = {}
        for path in ("/v1/chat/completions", "/v1", "/llama/v1/completions", "/v1x"):
            stream = client.request(
                path + suffix, method="POST", headers=headers, authority=authority
            )
            (answers[path],) = await client.get(stream)
    finally:
        await client.close()
    assert client.terminated is None
    for path in ("/v1/chat/completions", "/v1"):
        answer = answers[path]
        assert answer.status == status
        assert answer.headers[b"content-type"] == b"application/json"
        error = json.loads(answer.body)["error"]
        assert (error["code"], error["type"], error["param"]) == (
            code,
            "invalid_request_error",
            None,
        )
        assert error["message"]
    for path in ("/llama/v1/completions", "/v1x"):
        assert answers[path].status == status
        assert json.loads(answers[path].body)["error"] == code


async def test_other_paths_route_as_before(pool, upstream, gateway, client):
    await two_models(pool, upstream)
    gw = await gateway(**MODELS)
    status, body = await post(client, gw, "/llama/v1/completions", b'{"model": "mistral"}')
    assert (status, body["upstream"]) == (200, "llama-1")
    async with client.get(url(gw, "/nowhere")) as resp:
        assert (resp.status, (await resp.json())["error"]) == (404, "no_route")
    # Without ``models``, /v1 is a path as any other.
    off = await gateway()
    status, body = await post(client, off, "/v1/completions", b'{"model": "llama"}')
    assert (status, body["error"]) == (404, "no_route")


async def test_the_inference_policy_sends_a_prompt_prefix_to_one_replica(
    pool, upstream, gateway, client
):
    pool.set_service(
        routing(
            "llama",
            prefix="/llama",
            model={"name": "llama"},
            load_balancing="inference",
            inference={"prefix_chars": 60},
        )
    )
    for i in range(4):
        await upstream("llama", f"llama-{i}", digest_app(f"llama-{i}"))
    gw = await gateway(**MODELS)

    async def served(system: str, question: str) -> str:
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        data = json.dumps({"model": "llama", "messages": messages}).encode()
        status, body = await post(client, gw, "/v1/chat/completions", data)
        assert status == 200
        return str(body["upstream"])

    for system in ("You are a pirate.", "You are a lawyer.", "You answer in French."):
        # The first 60 characters of the JSON are the same: one replica, whatever follows.
        assert len({await served(system, f"question {i}") for i in range(6)}) == 1
    homes = {await served(f"You are agent number {i}.", "hi") for i in range(24)}
    assert len(homes) > 1  # distinct prefixes spread


async def test_the_inference_policy_avoids_a_replica_that_reports_a_queue(
    pool, upstream, gateway, client
):
    pool.set_service(
        routing(
            "llama",
            prefix="/llama",
            model={"name": "llama"},
            load_balancing="inference",
            inference={"prefix_chars": 0},
            load_metrics={"format": "sglang", "interval": 60, "max_age": 60},
        )
    )
    figures = {"busy": (30, 8, 0.95), "idle": (0, 1, 0.2)}

    def replica(name: str) -> web.Application:
        app = digest_app(name)
        waiting, running, usage = figures[name]

        async def metrics(request: web.Request) -> web.Response:
            return web.Response(
                text=f"sglang:num_queue_reqs {waiting}\nsglang:num_running_reqs {running}\n"
                f"sglang:token_usage {usage}\n"
            )

        app.router.add_get("/metrics", metrics)
        return app

    for name in figures:
        await upstream("llama", name, replica(name))
    gw = await gateway(**MODELS)
    sp = pool.services["llama"]
    await LoadScraper(pool).scrape(sp, sp.routing.load_metrics)
    assert set(sp.reports) == {"busy", "idle"}
    data = json.dumps({"model": "llama", "prompt": "hi"}).encode()
    seen = [(await post(client, gw, "/v1/completions", data))[1]["upstream"] for _ in range(12)]
    assert set(seen) == {"idle"}
