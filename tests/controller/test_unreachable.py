"""A request with no answer is said in a user's words wherever the controller reports one: the
Docker Engine client's errors here (the command line's and a follower's forward are tested
with them, in test_cli.py and test_admin_server.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.backends.docker import EngineClient, EngineUnreachable
from tests.support.ports import free_port


async def test_an_engine_socket_that_is_not_there(tmp_path: Path) -> None:
    engine = f"unix://{tmp_path}/docker.sock"
    client = EngineClient(engine)
    try:
        with pytest.raises(EngineUnreachable) as refused:
            await client.ping()
    finally:
        await client.close()
    # Before: "engine unix://...: Cannot connect to unix socket ... ssl:default [...]".
    assert str(refused.value) == f"engine {engine}: no such file or directory"


async def test_an_engine_port_nobody_listens_on() -> None:
    engine = f"tcp://127.0.0.1:{free_port()}"
    client = EngineClient(engine)
    try:
        with pytest.raises(EngineUnreachable) as refused:
            await client.ping()
    finally:
        await client.close()
    assert str(refused.value) == f"engine {engine}: connection refused"
