"""The ACME client: one order, by HTTP-01, for one host, through certbot's ``acme`` library.

The library is synchronous (requests): each of its calls runs in a thread
(``asyncio.to_thread``), one request at a time, and the waits between polls are the event
loop's, so an order never blocks the gateway and a cancelled order stops at its next call.
The library signs every request (JWS), keeps the nonces and retries a ``badNonce`` once;
nothing of the protocol is written here.

The account key is made at the first order and kept (``store``); the account's registration
is kept per directory, so a restart reuses both without a request. A directory that no longer
knows the account (``accountDoesNotExist``) gets it registered again with the same key.

``OrderFailed.reason`` is the one place where the library's errors become words.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

import josepy as jose
import requests
from acme import challenges, crypto_util, messages
from acme import client as acme_client
from acme import errors as acme_errors
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from josepy.jwa import ES256
from josepy.jwk import JWKEC

from ..config import AcmeConfig
from .errors import OrderFailed, StoreError
from .store import AcmeStore

log = logging.getLogger("gateway.acme")

T = TypeVar("T")

NETWORK_TIMEOUT = 10
"""Seconds one request to the CA may take."""
POLL_FIRST, POLL_MAX = 0.2, 2.0
"""Seconds between polls of a pending authorization: doubling from the first to the max."""
USER_AGENT = "gateway-acme (acme-python)"


@dataclass(frozen=True, slots=True)
class Issued:
    """An obtained certificate: its chain (leaf first) and its fresh private key, in PEM."""

    fullchain_pem: bytes
    key_pem: bytes


def new_key_pem() -> bytes:
    """A fresh P-256 private key (PKCS#8 PEM): every certificate gets its own."""
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def problem_text(error: messages.Error) -> str:
    """An ACME problem document in words: its detail, and its type's short code."""
    what = error.detail or error.title or error.description or "no detail given"
    code = error.code or str(error.typ)
    text = f"{what} ({code})"
    for sub in error.subproblems or ():
        text += f"; {problem_text(sub)}"
    return text


def reason(error: BaseException, directory: str, timeout: float) -> str:
    """What went wrong, in words, for the journal and the status."""
    if isinstance(error, acme_errors.ValidationError):
        parts = []
        for authzr in error.failed_authzrs:
            host = authzr.body.identifier.value
            problems = [problem_text(c.error) for c in authzr.body.challenges if c.error]
            parts.append(f"{host}: {'; '.join(problems) or 'no reason given'}")
        return "the CA could not validate the HTTP-01 challenge: " + "; ".join(parts)
    if isinstance(error, acme_errors.IssuanceError):
        return f"the CA refused to issue: {problem_text(error.error)}"
    if isinstance(error, messages.Error):
        return f"the CA refused: {problem_text(error)}"
    if isinstance(error, acme_errors.TimeoutError):
        return f"the order took longer than order_timeout ({timeout:g}s)"
    if isinstance(error, requests.exceptions.SSLError):
        return (
            f"TLS to the ACME directory {directory} failed (a private CA needs"
            f" tls.acme.ca_bundle): {error}"
        )
    if isinstance(error, requests.exceptions.Timeout):
        return f"the ACME directory {directory} did not answer within {NETWORK_TIMEOUT}s"
    if isinstance(error, requests.exceptions.ConnectionError):
        return f"the ACME directory {directory} is unreachable: {error}"
    if isinstance(error, requests.exceptions.RequestException):
        return f"request to the ACME directory {directory} failed: {error}"
    if isinstance(error, StoreError):
        return error.reason
    if isinstance(error, OSError):
        return f"a file under the ACME state could not be written: {error}"
    if isinstance(error, jose.errors.Error):
        return f"the CA's answer could not be read: {error}"
    if isinstance(error, acme_errors.Error):
        return f"ACME error: {error}"
    return f"unexpected error: {type(error).__name__}: {error}"


class AcmeClient:
    """Orders certificates from ``config.directory``, writing challenge answers to ``store``."""

    def __init__(self, config: AcmeConfig, store: AcmeStore) -> None:
        self._config = config
        self._store = store
        self._client: acme_client.ClientV2 | None = None
        self.orders = 0
        """Orders created at the CA (``newOrder`` answered), since start."""

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        """One blocking call, in a thread; its errors become ``OrderFailed``."""
        try:
            return await asyncio.to_thread(fn, *args)
        except OrderFailed:
            raise
        except Exception as e:
            raise OrderFailed(reason(e, self._config.directory, self._config.order_timeout)) from e

    # -- the account ----------------------------------------------------------------------------

    def _connect(self) -> acme_client.ClientV2:
        """The directory and the account (blocking): the stored ones, else new ones."""
        key_pem = self._store.account_key()
        if key_pem is None:
            key_pem = new_key_pem()
            self._store.save_account_key(key_pem)
        private = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(private, ec.EllipticCurvePrivateKey):
            raise StoreError("account/key.pem is not an EC key")
        verify: bool | str = self._config.ca_bundle or True
        net = acme_client.ClientNetwork(
            JWKEC(key=private),
            alg=ES256,
            # requests takes a CA file where the library's annotation says bool.
            verify_ssl=cast(bool, verify),
            user_agent=USER_AGENT,
            timeout=NETWORK_TIMEOUT,
        )
        directory = acme_client.ClientV2.get_directory(self._config.directory, net)
        client = acme_client.ClientV2(directory, net)
        stored = self._store.registration(self._config.directory)
        if stored is not None:
            net.account = messages.RegistrationResource.json_loads(stored)
        else:
            self._register(client)
        return client

    def _register(self, client: acme_client.ClientV2) -> None:
        email = self._config.email
        registration = messages.NewRegistration.from_data(email=email, terms_of_service_agreed=True)
        try:
            regr = client.new_account(registration)
        except acme_errors.ConflictError as e:  # the key has an account there already
            known = messages.RegistrationResource(uri=e.location, body=messages.Registration())
            regr = client.query_registration(known)
        self._store.save_registration(self._config.directory, regr.json_dumps())
        log.info("ACME account %s at %s", regr.uri, self._config.directory)

    def _new_order(self, csr_pem: bytes) -> messages.OrderResource:
        assert self._client is not None
        try:
            order = self._client.new_order(csr_pem)
        except messages.Error as e:
            if e.code != "accountDoesNotExist":
                raise
            log.warning("the ACME directory forgot the account: registering it again")
            self._store.forget_registration()
            self._client.net.account = None
            self._register(self._client)
            order = self._client.new_order(csr_pem)
        self.orders += 1
        return order

    # -- one order ------------------------------------------------------------------------------

    async def obtain(self, host: str) -> Issued:
        """A certificate for ``host``, proved by HTTP-01; ``OrderFailed`` says why not."""
        deadline = time.monotonic() + self._config.order_timeout
        if self._client is None:
            self._client = await self._call(self._connect)
        client = self._client
        key_pem = new_key_pem()
        csr_pem = crypto_util.make_csr(key_pem, [host])
        order = await self._call(self._new_order, csr_pem)
        tokens: list[str] = []
        try:
            pending = []
            for authzr in order.authorizations:
                if authzr.body.status == messages.STATUS_VALID:
                    continue  # the CA reused a valid authorization
                pending.append(authzr)
                challb = next(
                    (c for c in authzr.body.challenges if isinstance(c.chall, challenges.HTTP01)),
                    None,
                )
                if challb is None:
                    name = authzr.body.identifier.value
                    raise OrderFailed(f"the CA offers no HTTP-01 challenge for {name}")
                assert client.net.key is not None
                response, validation = challb.response_and_validation(client.net.key)
                token = challb.chall.encode("token")
                await self._call(self._store.put_challenge, token, validation)
                tokens.append(token)
                await self._call(client.answer_challenge, challb, response)
            done = [await self._until_decided(a, deadline) for a in pending]
            invalid = [a for a in done if a.body.status != messages.STATUS_VALID]
            if invalid:
                raise OrderFailed(reason(acme_errors.ValidationError(invalid), "", 0))
            remaining = max(1.0, deadline - time.monotonic())
            until = datetime.datetime.now() + datetime.timedelta(seconds=remaining)
            finished = await self._call(client.finalize_order, order, until)
        finally:
            for token in tokens:
                try:
                    await asyncio.to_thread(self._store.remove_challenge, token)
                except OSError as e:
                    log.warning("challenge answer %s not removed: %s", token, e)
        if not finished.fullchain_pem:
            raise OrderFailed("the CA's order ended without a certificate")
        return Issued(finished.fullchain_pem.encode("ascii"), key_pem)

    async def _until_decided(
        self, authzr: messages.AuthorizationResource, deadline: float
    ) -> messages.AuthorizationResource:
        """Poll an authorization until it is no longer pending (the CA has validated, or
        failed to), or until ``deadline`` (monotonic)."""
        assert self._client is not None
        delay = POLL_FIRST
        while True:
            authzr, _ = await self._call(self._client.poll, authzr)
            if authzr.body.status not in (messages.STATUS_PENDING, messages.STATUS_PROCESSING):
                return authzr
            if time.monotonic() + delay > deadline:
                timeout = self._config.order_timeout
                raise OrderFailed(
                    f"the CA did not validate {authzr.body.identifier.value} within"
                    f" order_timeout ({timeout:g}s)"
                )
            await asyncio.sleep(delay)
            delay = min(POLL_MAX, delay * 2)

    def __repr__(self) -> str:
        return f"<AcmeClient {self._config.directory} orders={self.orders}>"
