"""What the gateway reads and writes of OpenAI's API on its model paths. PURE.

A request body is read only as far as ``models.max_body_read``: ``scan`` walks the top level
of the JSON object in what was read, decoding each member in turn, and stops where the text
ends, so a ``model`` that comes first is found in a body of any size. The prompt (``messages``
or ``prompt``) is kept as the raw JSON text of its value, from its first character: the same
prompt gives the same text whether the body was read whole or not, which is what prefix
affinity hashes. Errors on these paths are answered in OpenAI's shape (``error_answer``), and
so are heads the HTTP/1.1 codec refuses on them (``refusal``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Final

from ..errors import BadRequest, GatewayError, OwnAnswer, RequestTimeout
from ..pool import router

_DECODER: Final = json.JSONDecoder()
_SPACE: Final = " \t\n\r"
PROMPT_FIELDS: Final = ("messages", "prompt", "input")
"""Members whose value is the prompt, the first found: chat, completions, embeddings."""


@dataclass(frozen=True, slots=True)
class Asked:
    """What a request body asks for, as far as it was read."""

    model: str | None = None
    """The ``model`` member's value, if it is a string and was read whole."""
    prompt: str = ""
    """The raw JSON text of the prompt's value (``PROMPT_FIELDS``), as far as it was read."""


def _skip_space(text: str, at: int) -> int:
    n = len(text)
    while at < n and text[at] in _SPACE:
        at += 1
    return at


def scan(data: bytes) -> Asked:
    """The ``model`` and the prompt of a JSON object's text, or what of them ``data`` (its
    beginning, possibly cut anywhere) holds."""
    text = data.decode("utf-8", "replace")
    model: str | None = None
    prompt = ""
    at = _skip_space(text, 0)
    if not text.startswith("{", at):
        return Asked()
    at = _skip_space(text, at + 1)
    while at < len(text) and text[at] == '"':
        try:
            key, at = _DECODER.raw_decode(text, at)
        except ValueError:
            break
        at = _skip_space(text, at)
        if not text.startswith(":", at):
            break
        at = _skip_space(text, at + 1)
        start = at
        try:
            value, at = _DECODER.raw_decode(text, at)
        except ValueError:
            if key in PROMPT_FIELDS and not prompt:
                prompt = text[start:]  # cut short: as far as it goes
            break
        if key == "model" and isinstance(value, str) and model is None:
            model = value
        elif key in PROMPT_FIELDS and not prompt:
            prompt = text[start:at]
        at = _skip_space(text, at)
        if not text.startswith(",", at):
            break
        at = _skip_space(text, at + 1)
    return Asked(model, prompt)


def model_path(prefix: str, target: bytes) -> str | None:
    """The path of ``target`` if it is under ``prefix`` (``models.path_prefix``), else None."""
    path = router.split_target(target.decode("latin-1"))[0]
    if prefix == "/" or path == prefix or path.startswith(prefix + "/"):
        return path
    return None


def model_missing(read: int, whole: bool) -> BadRequest:
    """The 400 of a body without a ``model`` (in the ``read`` bytes looked at)."""
    if whole:
        return BadRequest("the request body is not a JSON object with a string 'model'")
    return BadRequest(f"no 'model' in the first {read} bytes of the request body")


def error_type(status: int) -> str:
    """OpenAI's ``type`` of an error with ``status``."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_answer(exc: GatewayError) -> OwnAnswer:
    """The gateway's error ``exc`` in OpenAI's shape: ``{"error": {"message", "type",
    "param", "code"}}``, with the status, ``Retry-After`` and fields it had."""
    body = {
        "error": {
            "message": exc.message,
            "type": error_type(exc.status),
            "param": "model" if exc.code == "model_not_found" else None,
            "code": exc.code,
        }
    }
    headers = {"Content-Type": "application/json"}
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    for name, value in exc.fields:
        headers[name] = value
    return OwnAnswer(
        exc.status,
        exc.message,
        headers,
        json.dumps(body, separators=(",", ":")).encode(),
        close=isinstance(exc, RequestTimeout | BadRequest),
    )


def refusal(status: int, code: str, message: str) -> OwnAnswer:
    """A request head the HTTP codec refused (before any routing), in OpenAI's shape."""
    refused = GatewayError(message)
    refused.status = status
    refused.code = code
    return error_answer(refused)


def refused_head(
    prefix: str | None, target: bytes, status: int, code: str, message: str
) -> OwnAnswer | None:
    """The answer to a request head a codec refused (before any routing) whose ``target`` is
    under ``prefix`` (``models.path_prefix``), in OpenAI's shape; None elsewhere (the
    gateway's own shape)."""
    if prefix is None or model_path(prefix, target) is None:
        return None
    return refusal(status, code, message)
