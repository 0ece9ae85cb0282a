"""The tokens of an answer on a model path (``gateway.proxy.tokens``): pure, with numbers."""

from __future__ import annotations

import json

import pytest

from gateway.observability.tally import LATENCY_BUCKETS, latency_bucket
from gateway.proxy.tokens import JSON, JSON_TAIL, MAX_LINE, NONE, SSE, TokenCount, kind_of


def chunk(
    content: str | None = None, *, role: str | None = None, usage: int | None = None
) -> bytes:
    """One OpenAI chat completion chunk as an SSE event."""
    delta: dict[str, str] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    body: dict[str, object] = {"object": "chat.completion.chunk", "choices": []}
    if role is not None or content is not None:
        body["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
    if usage is not None:
        body["usage"] = {"prompt_tokens": 7, "completion_tokens": usage, "total_tokens": 7 + usage}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"
STREAM = (
    chunk(role="assistant")
    + chunk("Hel")
    + b": a comment\n\n"
    + chunk("lo")
    + chunk("", role=None)
    + chunk("!")
    + chunk(usage=5)
    + DONE
)
"""Three content chunks; a role-only delta, an empty content, a comment, usage, [DONE]."""


def test_a_stream_fed_whole_counts_its_content_chunks_and_takes_usage() -> None:
    count = TokenCount(SSE, 10.0)
    count.feed(STREAM, 10.25)
    assert (count.chunks, count.usage, count.output_tokens) == (3, 5, 5)
    assert count.ttft == 0.25
    counts, total = count.gaps.counted()
    assert (sum(counts), total) == (2, 0.0)  # two gaps, both in one read


def test_without_usage_the_output_tokens_are_the_content_chunks() -> None:
    count = TokenCount(SSE, 0.0)
    count.feed(chunk(role="assistant") + chunk("a") + chunk("b") + DONE, 1.0)
    assert (count.usage, count.output_tokens) == (-1, 2)


def test_a_stream_with_no_content_has_no_ttft_and_none_of_its_chunks_count() -> None:
    count = TokenCount(SSE, 0.0)
    count.feed(chunk(role="assistant") + b"event: ping\ndata: {}\n\n" + DONE, 1.0)
    assert (count.ttft, count.output_tokens, count.chunks) == (None, 0, 0)


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_a_stream_split_at_any_byte_counts_the_same(cut: int) -> None:
    count = TokenCount(SSE, 0.0)
    count.feed(STREAM[:cut], 1.0)
    count.feed(memoryview(STREAM)[cut:], 2.0)
    assert (count.chunks, count.output_tokens) == (3, 5)
    # The first content chunk's line ends in the first read, or not.
    first_end = STREAM.index(b"\n", STREAM.index(b"Hel"))
    assert count.ttft == (1.0 if cut > first_end else 2.0)


def test_a_stream_fed_byte_by_byte_times_each_chunk_at_its_line_end() -> None:
    count = TokenCount(SSE, 0.0)
    stream = chunk("a") + chunk("b") + chunk("c") + DONE
    ends = {i for i, byte in enumerate(stream) if byte == ord("\n")}
    content_ends = sorted(ends)[0::2][:3]  # each event's data line, then its blank line
    for i in range(len(stream)):
        count.feed(stream[i : i + 1], float(i))
    assert count.chunks == 3
    assert count.ttft == float(content_ends[0])
    counts, total = count.gaps.counted()
    assert total == float(content_ends[2] - content_ends[0])
    gap = float(content_ends[1] - content_ends[0])
    assert counts[latency_bucket(gap)] == 2  # events of one length: gaps of one length


def test_gaps_are_counted_in_the_latency_buckets() -> None:
    count = TokenCount(SSE, 0.0)
    for i, at in enumerate((0.1, 0.13, 0.2, 0.7)):
        count.feed(chunk(str(i)), at)
    counts, total = count.gaps.counted()
    assert total == pytest.approx(0.6)
    expected = [0] * (len(LATENCY_BUCKETS) + 1)
    for gap in (0.03, 0.07, 0.5):
        expected[latency_bucket(gap)] += 1
    assert list(counts) == expected
    assert count.ttft == 0.1


def test_crlf_lines_and_completions_text_are_read() -> None:
    count = TokenCount(SSE, 0.0)
    text = json.dumps({"choices": [{"index": 0, "text": "hi"}]}).encode()
    count.feed(b"data: " + text + b"\r\n\r\ndata: [DONE]\r\n\r\n", 0.5)
    assert (count.chunks, count.ttft) == (1, 0.5)


def test_tool_calls_and_reasoning_are_output() -> None:
    count = TokenCount(SSE, 0.0)
    calls = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}}]}
    reasoning = {"choices": [{"delta": {"reasoning_content": "hmm"}}]}
    count.feed(b"data: " + json.dumps(calls).encode() + b"\n\n", 1.0)
    count.feed(b"data: " + json.dumps(reasoning).encode() + b"\n\n", 2.0)
    assert count.chunks == 2


def test_a_line_too_long_to_keep_still_counts_as_a_content_chunk() -> None:
    count = TokenCount(SSE, 0.0)
    long = chunk("x" * (MAX_LINE + 10))
    for at in range(0, len(long), 4096):
        count.feed(long[at : at + 4096], 1.0)
    count.feed(b": not data " + b"y" * (MAX_LINE + 10) + b"\n\n" + DONE, 2.0)
    assert (count.chunks, count.ttft, len(count._line)) == (1, 1.0, 0)


def test_broken_json_is_no_chunk() -> None:
    count = TokenCount(SSE, 0.0)
    count.feed(b'data: {"choices": [\n\ndata: [1, 2]\n\ndata: "x"\n\n', 1.0)
    assert (count.chunks, count.output_tokens) == (0, 0)


def test_a_json_answer_takes_its_usage_from_its_end() -> None:
    body = json.dumps(
        {
            "choices": [{"message": {"content": 'say "completion_tokens": 99' + "z" * 5000}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 42, "total_tokens": 45},
        }
    ).encode()
    for cut in (1, 100, len(body) - 20, len(body) - 1):
        count = TokenCount(JSON, 0.0)
        count.feed(body[:cut], 1.0)
        count.feed(memoryview(body)[cut:], 2.0)
        assert (count.output_tokens, count.ttft) == (42, None)
        assert len(count._line) <= JSON_TAIL


def test_a_json_answer_without_usage_has_unknown_tokens() -> None:
    count = TokenCount(JSON, 0.0)
    count.feed(
        json.dumps({"data": [{"embedding": [0.1]}], "usage": {"total_tokens": 3}}).encode(), 1
    )
    assert count.output_tokens is None


@pytest.mark.parametrize(
    ("status", "fields", "kind"),
    [
        (200, b"Content-Type: text/event-stream; charset=utf-8\r\nX: y\r\n", SSE),
        (200, b"content-type: application/json\r\n", JSON),
        (200, b"Content-Type: text/plain\r\n", NONE),
        (200, b"Content-Type: text/event-stream\r\nContent-Encoding: gzip\r\n", NONE),
        (200, b"Content-Encoding: identity\r\nContent-Type: text/event-stream\r\n", SSE),
        (500, b"Content-Type: application/json\r\n", NONE),
        (200, b"", NONE),
    ],
)
def test_what_is_scanned_follows_the_head(status: int, fields: bytes, kind: int) -> None:
    assert kind_of(status, fields) == kind
