"""Errors of automatic certificates.

AcmeError
├── OrderFailed       an order did not end in a certificate: ``reason`` says why, in words
└── StoreError        a file under ``<state_dir>/acme`` could not be read or written
"""

from __future__ import annotations


class AcmeError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OrderFailed(AcmeError):
    """The CA refused, a challenge failed, the directory was unreachable, or the order took
    too long. The manager retries it with backoff."""


class StoreError(AcmeError):
    """A stored file is unreadable or could not be written."""
