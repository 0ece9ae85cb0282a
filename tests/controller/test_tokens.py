"""Bearer tokens on the control plane: the spec's auth, rate_limits and load_balancing and
their refusals; the tokens' sources (file, environment, store) and how they reach the pool;
the store keeps digests only, across a restart, and forgets them with the service."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from controller import tokens
from controller.errors import Conflict, NotFound
from controller.spec import AuthConfig, ServiceSpec
from controller.store import Store

from .conftest import Harness, spec


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# -- the spec -----------------------------------------------------------------------------------


def test_everything_is_off_unless_configured() -> None:
    routing = ServiceSpec.model_validate(spec()).routing()
    assert (routing.auth, routing.rate_limits, routing.affinity) == (None, (), None)
    assert routing.limits.max_in_flight_per_replica is None
    assert routing.load_balancing == "least_outstanding"


def test_the_routing_carries_digests_and_the_hash_key() -> None:
    s = ServiceSpec.model_validate(
        spec(
            auth={"type": "bearer", "header": "X-Api-Key", "pass_token": True},
            rate_limits=[{"path_prefix": "/v1", "key": "token", "rps": 5}],
            load_balancing={"policy": "hash", "key": "cookie:sid"},
            limits={"max_in_flight_per_replica": 4},
        )
    )
    routing = s.routing({sha("t"): "tok_1"})
    assert routing.auth is not None
    assert (routing.auth.header, routing.auth.pass_token) == ("x-api-key", True)
    assert routing.auth.tokens == {sha("t"): "tok_1"}
    assert (routing.load_balancing, routing.affinity) == ("hash", "cookie:sid")
    assert routing.rate_limits[0].key == "token"
    # The plain string form still works, and {policy} without hash too.
    s = ServiceSpec.model_validate(spec(load_balancing={"policy": "p2c"}))
    assert s.routing().load_balancing == "p2c"


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"load_balancing": "hash"}, "hash needs a key"),
        ({"load_balancing": {"policy": "hash"}}, "policy hash needs a key"),
        ({"load_balancing": {"policy": "p2c", "key": "ip"}}, "a key is for policy hash"),
        ({"load_balancing": {"policy": "hash", "key": "token"}}, "ip, header:NAME or cookie"),
        ({"load_balancing": {"policy": "hash", "key": "header:"}}, "not a key"),
        ({"rate_limits": [{"rps": 0}]}, "greater than 0"),
        ({"rate_limits": [{"rps": 1, "key": "cookie:x"}]}, "ip, header:NAME or token"),
        ({"rate_limits": [{"rps": 1, "key": "token"}]}, "token needs auth"),
        ({"rate_limits": [{"rps": 1, "path_prefix": "api"}]}, "must start with '/'"),
        ({"rate_limits": [{"rps": 1}] * 17}, "at most 16"),
        ({"auth": {"type": "basic"}}, "'bearer'"),
        ({"auth": {"tokens_file": "tokens.txt"}}, "absolute path"),
        ({"auth": {"tokens_env": "1X"}}, "pattern"),
        ({"auth": {"header": "X Key"}}, "not a header name"),
        ({"limits": {"max_in_flight_per_replica": 0}}, "greater than or equal to 1"),
    ],
)
def test_refusals_name_the_field(extra: dict[str, Any], reason: str) -> None:
    with pytest.raises(ValidationError, match=reason):
        ServiceSpec.model_validate(spec(**extra))


# -- sources ------------------------------------------------------------------------------------


def test_tokens_from_a_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# ci\nalpha-token-0001\n\n  beta-token-0002  \n" + "x" * 2000 + "\n")
    auth = AuthConfig(tokens_file=str(path), tokens_env="TOKENS")
    got = tokens.configured(auth, {"TOKENS": "gamma-token-0003, delta-token-0004"})
    assert got == {
        sha("alpha-token-0001"): f"file:{sha('alpha-token-0001')[:12]}",
        sha("beta-token-0002"): f"file:{sha('beta-token-0002')[:12]}",
        sha("gamma-token-0003"): f"env:{sha('gamma-token-0003')[:12]}",
        sha("delta-token-0004"): f"env:{sha('delta-token-0004')[:12]}",
    }


def test_an_unreadable_file_or_unset_variable_adds_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    auth = AuthConfig(tokens_file=str(tmp_path / "none"), tokens_env="NOPE")
    assert tokens.configured(auth, {}) == {}
    assert "cannot be read" in caplog.text
    assert "NOPE is not set" in caplog.text


def test_a_made_token_is_long_and_random() -> None:
    made = {tokens.new_token() for _ in range(100)}
    assert len(made) == 100
    assert all(len(t) == 43 and tokens.valid(t) for t in made)


# -- the store ----------------------------------------------------------------------------------


def test_the_store_keeps_digests_only_and_they_survive_a_reopen(tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    with Store(db) as store:
        store.put_service("web", "{}", 1)
        row = store.add_token("web", "tok_1", sha("secret-token-123456"), "ci")
        with pytest.raises(Conflict, match="has this token already"):
            store.add_token("web", "tok_2", sha("secret-token-123456"), "")
        with pytest.raises(NotFound):
            store.add_token("other", "tok_3", sha("x"), "")
    with Store(db) as store:
        assert store.tokens("web") == [row]
    raw = sqlite3.connect(db)
    dumped = "\n".join(raw.iterdump())
    raw.close()
    assert "secret-token-123456" not in dumped
    with Store(db) as store:
        assert store.revoke_token("web", "tok_1") == row
        with pytest.raises(NotFound, match="no token 'tok_1'"):
            store.revoke_token("web", "tok_1")
        store.add_token("web", "tok_4", sha("y"), "")
        store.delete_service("web")
        assert store.tokens("web") == []


# -- the controller -----------------------------------------------------------------------------


async def test_tokens_reach_the_pool_at_once_and_come_back_on_restore(
    h: Harness, tmp_path: Path
) -> None:
    c = h.controller
    await c.apply(spec())
    with pytest.raises(Conflict, match="no auth"):
        c.add_token("web", None, "")
    path = tmp_path / "tokens"
    path.write_text("file-token-000001\n")
    await c.apply(spec(auth={"tokens_file": str(path)}))
    auth = h.pool.service("web").routing.auth
    assert auth is not None
    assert set(auth.tokens) == {sha("file-token-000001")}
    info, made = c.add_token("web", None, "ops")
    given, _ = c.add_token("web", "given-token-00001", "")
    auth = h.pool.service("web").routing.auth
    assert auth is not None
    assert auth.tokens[sha(made)] == info.id
    assert auth.tokens[sha("given-token-00001")] == given.id
    listed = c.tokens("web")
    assert [(t.source, t.label) for t in listed] == [("file", ""), ("api", "ops"), ("api", "")]
    assert all(made not in repr(t) for t in listed)
    c.revoke_token("web", info.id)
    auth = h.pool.service("web").routing.auth
    assert auth is not None
    assert sha(made) not in auth.tokens
    with pytest.raises(Conflict, match="tokens_file"):
        c.revoke_token("web", listed[0].id)
    # A restart reads them from the store again.
    h.pool.remove_service("web")
    c.executor.set_routing(h.state("web").spec)
    auth = h.pool.service("web").routing.auth
    assert auth is not None
    assert set(auth.tokens) == {sha("file-token-000001"), sha("given-token-00001")}
