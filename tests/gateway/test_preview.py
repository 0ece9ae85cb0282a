"""Preview routes' rules (``proxy.preview``): who may ask for a revision, and how."""

from __future__ import annotations

import hashlib

import pytest

from gateway.config import PreviewConfig, parse_settings
from gateway.errors import BadRequest, OwnAnswer
from gateway.proxy.preview import asked, labelled

TOKEN = b"preview-secret"
DIGEST = hashlib.sha256(TOKEN).hexdigest()


def test_a_labelled_host() -> None:
    assert labelled(b"r3--hello.example.com") == (b"r", 3, b"hello.example.com")
    assert labelled(b"R12--Hello.example.com:8080") == (b"r", 12, b"hello.example.com:8080")
    assert labelled(b"3--hello") == (b"", 3, b"hello")
    assert labelled(b"hello.example.com") is None
    assert labelled(b"rx--hello") is None


@pytest.mark.parametrize(
    ("allow", "headers", "label", "expected"),
    [
        ("off", [(b"X-Gateway-Revision", b"3")], None, None),
        ("anyone", [(b"X-Gateway-Revision", b"3")], None, 3),
        ("anyone", [(b"x-gateway-revision", b" 4 ")], None, 4),
        ("anyone", [], None, None),
        ("anyone", [], (b"r", 5), 5),
        ("anyone", [], (b"v", 5), None),  # another prefix than the service's
        ("token", [(b"X-Gateway-Revision", b"3"), (b"X-Gateway-Preview-Token", TOKEN)], None, 3),
        ("token", [(b"X-Gateway-Preview-Token", TOKEN)], (b"r", 2), 2),
    ],
)
def test_who_may_ask_for_which_revision(
    allow: str, headers: list[tuple[bytes, bytes]], label: tuple[bytes, int] | None,
    expected: int | None,
) -> None:  # fmt: skip
    config = parse_settings(PreviewConfig, {"allow": allow, "tokens": [DIGEST]})
    got = asked(config, headers, label and label[0], label[1] if label else None)
    assert got == expected


@pytest.mark.parametrize(
    "headers",
    [
        [(b"X-Gateway-Revision", b"3")],
        [(b"X-Gateway-Revision", b"3"), (b"X-Gateway-Preview-Token", b"wrong")],
    ],
)
def test_without_the_token_a_preview_is_refused_with_403(
    headers: list[tuple[bytes, bytes]],
) -> None:
    config = PreviewConfig(allow="token", tokens=(DIGEST,))
    with pytest.raises(OwnAnswer) as refused:
        asked(config, headers, None, None)
    assert refused.value.status == 403
    assert b'"forbidden"' in refused.value.body


def test_a_revision_that_is_not_a_number_is_a_400() -> None:
    with pytest.raises(BadRequest, match="not a revision number"):
        asked(PreviewConfig(allow="anyone"), [(b"X-Gateway-Revision", b"latest")], None, None)
