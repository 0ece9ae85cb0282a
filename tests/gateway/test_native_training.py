"""The training load of a profile-guided build (gateway/native_training.py): it must go
through the data plane's everyday paths and get every answer, or the profile says nothing."""

from __future__ import annotations

import os

import pytest

from gateway import native_training
from gateway.observability.accesslog import QUEUE_SIZE, AccessLog


async def test_the_load_gets_every_answer_and_logs_every_request(tmp_path):
    # A writer thread starved of CPU drops lines past its queue, and counts them: every
    # request is written or counted.
    access_log = AccessLog(path=str(tmp_path / "access.log"))
    assert await native_training.train(tmp_path, access_log) == 0
    keep_alive = native_training.KEEP_ALIVE_CLIENTS * native_training.REQUESTS_EACH
    close = native_training.CLOSE_CLIENTS * native_training.CONNECTIONS_EACH
    lines = (tmp_path / "access.log").read_text().splitlines()
    assert len(lines) + access_log.dropped == keep_alive + close
    assert len(lines) >= QUEUE_SIZE
    for request in ('"GET /"', '"GET /chunked"', '"GET /big"', '"POST /echo"'):
        assert any(request in line for line in lines), request  # each kind went through
    assert all(" 200 " in line for line in lines)


def test_it_refuses_to_train_the_pure_modules(capsys):
    if os.environ.get("GATEWAY_NATIVE") != "0":
        pytest.skip("runs on the pure Python modules (GATEWAY_NATIVE=0)")
    assert native_training.main() == 2
    assert "the modules are not compiled: nothing to train" in capsys.readouterr().err
