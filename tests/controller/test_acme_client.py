"""controller/acme/client.py: the one place where the acme library's errors become reasons
(the client's orders against real pebble: tests/e2e/test_acme.py)."""

from __future__ import annotations

import pytest
import requests
from acme import challenges, messages
from acme import errors as acme_errors
from josepy.errors import DeserializationError

from controller.acme.client import new_key_pem, problem_text, reason
from controller.acme.errors import StoreError

DIRECTORY = "https://ca.example/dir"


def authorization(host: str, error: messages.Error | None) -> messages.AuthorizationResource:
    challenge = messages.ChallengeBody(
        chall=challenges.HTTP01(token=b"t" * 32), status=messages.STATUS_INVALID, error=error
    )
    body = messages.Authorization(
        identifier=messages.Identifier(typ=messages.IDENTIFIER_FQDN, value=host),
        challenges=[challenge],
        status=messages.STATUS_INVALID,
    )
    return messages.AuthorizationResource(body=body, uri=f"https://ca.example/authz/{host}")


REFUSED = messages.Error.with_code("connection", detail="dial tcp 127.0.0.1:5002: refused")


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (
            acme_errors.ValidationError([authorization("a.example.com", REFUSED)]),
            "the CA could not validate the HTTP-01 challenge: a.example.com:"
            " dial tcp 127.0.0.1:5002: refused (connection)",
        ),
        (
            acme_errors.ValidationError([authorization("a.example.com", None)]),
            "the CA could not validate the HTTP-01 challenge: a.example.com: no reason given",
        ),
        (
            messages.Error.with_code("rateLimited", detail="too many certificates"),
            "the CA refused: too many certificates (rateLimited)",
        ),
        (
            messages.Error.with_code(
                "rejectedIdentifier",
                detail="policy forbids",
                subproblems=(messages.Error.with_code("caa", detail="CAA forbids"),),
            ),
            "the CA refused: policy forbids (rejectedIdentifier); CAA forbids (caa)",
        ),
        (
            messages.Error(typ="urn:example:custom"),  # type: ignore[call-arg]
            "the CA refused: no detail given (urn:example:custom)",
        ),
        (
            acme_errors.IssuanceError(messages.Error.with_code("badCSR", detail="bad key")),
            "the CA refused to issue: bad key (badCSR)",
        ),
        (acme_errors.TimeoutError(), "the order took longer than order_timeout (90s)"),
        (
            requests.exceptions.SSLError("certificate verify failed"),
            f"TLS to the ACME directory {DIRECTORY} failed (a private CA needs"
            " tls.acme.ca_bundle): certificate verify failed",
        ),
        (
            requests.exceptions.ConnectTimeout("slow"),
            f"the ACME directory {DIRECTORY} did not answer within 10s",
        ),
        (
            requests.exceptions.ConnectionError("refused"),
            f"the ACME directory {DIRECTORY} is unreachable: refused",
        ),
        (StoreError("account/key.pem is not an EC key"), "account/key.pem is not an EC key"),
        (PermissionError(13, "Permission denied"), "a file under the ACME state could not be"),
        (DeserializationError("bad"), "the CA's answer could not be read"),
        (acme_errors.ClientError("up link missing"), "ACME error: up link missing"),
        (KeyError("x"), "unexpected error: KeyError: 'x'"),
    ],
)
def test_library_errors_become_reasons(error: BaseException, expected: str) -> None:
    assert reason(error, DIRECTORY, 90).startswith(expected)


def test_problem_text_falls_back_to_the_type_description() -> None:
    assert problem_text(messages.Error.with_code("unauthorized")).endswith("(unauthorized)")


def test_every_certificate_gets_a_fresh_key() -> None:
    assert new_key_pem() != new_key_pem()
    assert new_key_pem().startswith(b"-----BEGIN PRIVATE KEY-----")
