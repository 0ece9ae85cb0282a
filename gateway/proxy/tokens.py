"""The tokens of an answer on a model path, counted as its body goes by. PURE.

An answer streamed as server-sent events (``text/event-stream``: OpenAI's ``data: {...}``
chunks, ``data: [DONE]`` last) is read line by line as it is relayed: a chunk whose choice
carries content (``delta.content``, ``delta.reasoning_content``, ``delta.refusal``,
``delta.tool_calls``, or a completion's ``text``) is a token's arrival; a role-only delta,
a comment or ``[DONE]`` is not. The first one's time less the request's arrival is the time
to first token; the times between the next ones are the inter-token latencies, counted per
latency bucket. The output tokens are the last ``usage.completion_tokens`` a chunk carried,
else one per content chunk. A JSON answer's are its ``usage.completion_tokens``, read in its
last ``JSON_TAIL`` bytes (OpenAI's and vLLM's put ``usage`` last), else unknown.

Invariants: the relay is never changed nor held: ``feed`` reads what was written and keeps
only the line under way, at most ``MAX_LINE`` bytes of it (a longer ``data:`` line is counted
as a content chunk, unread), or a JSON body's last ``JSON_TAIL`` bytes. An answer compressed
(``Content-Encoding``) or of another type is not scanned (``kind_of``).
"""

from __future__ import annotations

import json
import re
from typing import Final

from mypy_extensions import i64

from ..observability.tally import LATENCY_BUCKETS, Buckets, latency_bucket

NONE: Final = 0
"""Not scanned."""
SSE: Final = 1
"""Server-sent events: chunks counted as they go by."""
JSON: Final = 2
"""A JSON answer: its ``usage`` read at the end."""

MAX_LINE: Final = 65536
"""The longest line of an event stream kept to be read; a longer one is not parsed."""
JSON_TAIL: Final = 1024
"""The bytes of a JSON answer's end kept to find its ``usage.completion_tokens`` in."""

_COMPLETION_TOKENS: Final = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
"""Never inside a JSON string: its quotes are escaped there."""
_CONTENT_KEYS: Final = ("content", "reasoning_content", "refusal", "tool_calls")


def kind_of(status: int, fields: bytes) -> int:
    """What is scanned of an answer with ``status`` and header ``fields`` (a block of lines
    as they came): ``SSE``, ``JSON`` or ``NONE``."""
    if not 200 <= status < 300:
        return NONE
    kind = NONE
    for line in fields.split(b"\n"):
        name, colon, value = line.partition(b":")
        if not colon:
            continue
        name = name.strip().lower()
        if name == b"content-encoding":
            if value.strip().lower() != b"identity":
                return NONE
        elif name == b"content-type":
            media = value.partition(b";")[0].strip().lower()
            if media == b"text/event-stream":
                kind = SSE
            elif media == b"application/json":
                kind = JSON
    return kind


def _has_content(choice: dict[str, object]) -> bool:
    """Whether a chunk's choice carries output: content, reasoning, a refusal, tool calls
    (chat), or text (completions)."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        for key in _CONTENT_KEYS:
            if delta.get(key):
                return True
    text = choice.get("text")
    return isinstance(text, str) and bool(text)


class TokenCount:
    """One answer's tokens, counted from its body as it is relayed (``feed``)."""

    __slots__ = ("_line", "_over", "chunks", "first", "gaps", "kind", "last", "started", "usage")

    def __init__(self, kind: int, started: float) -> None:
        self.kind: i64 = kind
        self.started = started
        """When the request arrived (the loop's time)."""
        self.first = -1.0
        """When the first content chunk arrived; -1: none yet."""
        self.last = -1.0
        self.chunks = 0
        """Content chunks so far."""
        self.usage = -1
        """The last ``usage.completion_tokens`` seen; -1: none."""
        self.gaps = Buckets(LATENCY_BUCKETS)
        """The inter-token latencies."""
        self._line = b""
        """The line under way (SSE), or the body's last bytes (JSON)."""
        self._over = False
        """The line under way is longer than ``MAX_LINE``: only its start is kept."""

    @property
    def ttft(self) -> float | None:
        """The time to first token, None if no content chunk came."""
        return self.first - self.started if self.first >= 0 else None

    @property
    def output_tokens(self) -> int | None:
        """The output tokens: from ``usage`` when given, else the content chunks of an event
        stream; None if not known (a JSON answer without ``usage``)."""
        if self.kind == JSON and self.usage < 0:
            found = _COMPLETION_TOKENS.findall(self._line)
            if found:
                self.usage = int(found[-1])
        if self.usage >= 0:
            return self.usage
        return self.chunks if self.kind == SSE else None

    def feed(self, data: bytes | memoryview, now: float) -> None:
        """The next bytes of the body (as relayed: never changed), arrived at ``now``."""
        if self.kind == JSON:
            tail = self._line + bytes(data[-JSON_TAIL:])
            self._line = tail[-JSON_TAIL:]
            return
        chunk = bytes(data)
        start = 0
        n = len(chunk)
        while start < n:
            end = chunk.find(b"\n", start)
            if end < 0:
                self._keep(chunk[start:])
                return
            self._keep(chunk[start:end])
            line, over = self._line, self._over
            self._line, self._over = b"", False
            self._event(line, over, now)
            start = end + 1

    def _keep(self, part: bytes) -> None:
        """Add ``part`` to the line under way, as far as ``MAX_LINE`` (then only its start)."""
        if self._over:
            return
        if len(self._line) + len(part) > MAX_LINE:
            self._over = True
            self._line = (self._line + part[:16])[:16]
        else:
            self._line += part

    def _event(self, line: bytes, over: bool, now: float) -> None:
        """A whole line of the stream (``over``: cut short)."""
        if not line.startswith(b"data:"):
            return  # another field, a comment, an event's end
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            return
        if over:
            self._content(now)  # too long to read: output all the same
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            tokens = usage.get("completion_tokens")
            if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0:
                self.usage = tokens
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if isinstance(choice, dict) and _has_content(choice):
                    self._content(now)
                    return

    def _content(self, now: float) -> None:
        if self.first < 0:
            self.first = now
        else:
            gap = now - self.last
            self.gaps.count(latency_bucket(gap), gap)
        self.last = now
        self.chunks += 1

    def __repr__(self) -> str:
        return (
            f"<TokenCount kind={self.kind} chunks={self.chunks} usage={self.usage} "
            f"ttft={self.ttft}>"
        )
