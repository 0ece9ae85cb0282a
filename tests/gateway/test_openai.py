"""What the gateway reads of a request body on a model path, and its errors in OpenAI's
shape (``gateway.proxy.openai``), and the model table (``gateway.pool.models``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import ModelConfig, parse_settings
from gateway.errors import BadRequest, ModelNotFound, NoRoutableUpstream, TooManyRequests
from gateway.pool.models import ModelTable
from gateway.proxy import openai

CHAT = {
    "model": "llama",
    "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hi"},
    ],
    "stream": True,
}


def test_scan_reads_the_model_and_the_prompt_of_a_whole_body() -> None:
    data = json.dumps(CHAT).encode()
    asked = openai.scan(data)
    assert asked.model == "llama"
    assert json.loads(asked.prompt) == CHAT["messages"]


@pytest.mark.parametrize(
    ("body", "model"),
    [
        (b'{"prompt": "x", "model": "m"}', "m"),  # not first
        (b' \n{ "model" :\t"m" }', "m"),
        (b'{"input": ["a"], "model": "e"}', "e"),
        (b'{"model": 3}', None),  # not a string
        (b'["model", "m"]', None),  # not an object
        (b'{"nested": {"model": "no"}}', None),  # only the top level counts
        (b'{"messages": [{"content": "\\"model\\": \\"no\\""}]}', None),
        (b"", None),
        (b"not json", None),
        (b'{"model": "m\xff"}', "m\ufffd"),
    ],
)
def test_scan_finds_the_top_level_model_only(body: bytes, model: str | None) -> None:
    assert openai.scan(body).model == model


def test_a_body_cut_short_keeps_what_came_before_the_cut() -> None:
    data = json.dumps(CHAT).encode()
    cut = data[: data.index(b"terse")]
    asked = openai.scan(cut)
    assert asked.model == "llama"
    # The prompt's text as far as it goes: a prefix of the whole body's.
    assert openai.scan(data).prompt.startswith(asked.prompt)
    assert asked.prompt.startswith('[{"role": "system"')
    # A model after the cut is not found.
    late = json.dumps({"messages": CHAT["messages"], "model": "llama"}).encode()
    assert openai.scan(late[:40]).model is None


@given(st.text(max_size=200), st.integers(min_value=0, max_value=400))
def test_the_prompt_text_of_a_cut_body_is_a_prefix_of_the_whole_ones(
    content: str, cut: int
) -> None:
    data = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    whole = openai.scan(data).prompt
    part = openai.scan(data[:cut]).prompt
    assert whole.startswith(part.rstrip("\ufffd"))


def test_errors_take_openais_shape() -> None:
    answer = openai.error_answer(ModelNotFound("The model 'x' does not exist", model="x"))
    assert answer.status == 404
    assert json.loads(answer.body) == {
        "error": {
            "message": "The model 'x' does not exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    busy = openai.error_answer(NoRoutableUpstream("none", retry_after=2))
    assert (busy.status, busy.headers["Retry-After"]) == (503, "2")
    assert json.loads(busy.body)["error"]["type"] == "server_error"
    limited = openai.error_answer(TooManyRequests("slow down", 1, (("RateLimit-Limit", "5"),)))
    assert limited.headers["RateLimit-Limit"] == "5"
    assert json.loads(limited.body)["error"]["type"] == "rate_limit_error"
    assert openai.error_answer(BadRequest("no")).close


def model(name: str, *aliases: str) -> ModelConfig:
    return parse_settings(ModelConfig, {"name": name, "aliases": list(aliases)})


def test_the_model_table_maps_names_and_aliases_and_lists_them() -> None:
    table = ModelTable.build([("b", model("mistral")), ("a", model("llama", "llama-3"))])
    assert table.service("llama-3") == "a"
    assert table.service("mistral") == "b"
    assert table.service("gpt") is None
    listing = json.loads(table.listing)
    assert listing["object"] == "list"
    assert [(m["id"], m["owned_by"], m["object"]) for m in listing["data"]] == [
        ("llama", "a", "model"),
        ("llama-3", "a", "model"),
        ("mistral", "b", "model"),
    ]


def test_a_name_met_twice_stays_with_the_first_service_by_name() -> None:
    table = ModelTable.build([("z", model("llama")), ("a", model("llama"))])
    assert table.service("llama") == "a"


@pytest.mark.parametrize(
    "data",
    [
        {"name": ""},
        {"name": "bad name"},
        {"name": "m", "aliases": ["m"]},
        {"name": "m", "aliases": ["x", "x"]},
        {"name": "m", "aliases": [f"a{i}" for i in range(17)]},
        {"name": "m", "extra": 1},
    ],
)
def test_bad_models_are_refused(data: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=r"."):
        parse_settings(ModelConfig, data)
