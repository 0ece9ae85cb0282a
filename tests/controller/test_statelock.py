"""controller/statelock.py: one gateway process a state directory (issue 53)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controller.errors import StartRefused, StateDirInUse
from controller.statelock import LOCK_FILE, StateLock


def test_a_second_take_is_refused_with_the_holders_pid_until_the_first_is_released(
    tmp_path: Path,
) -> None:
    first = StateLock.take(tmp_path)
    lock = tmp_path / LOCK_FILE
    assert first.path == lock
    assert lock.read_text() == f"{os.getpid()}\n"
    # Another open of the file: a separate open file description, so flock conflicts even
    # within one process (as it does between two gateway processes).
    with pytest.raises(StateDirInUse) as refused:
        StateLock.take(tmp_path)
    error = refused.value
    assert isinstance(error, StartRefused)
    assert (error.pid, error.lock, error.state_dir) == (os.getpid(), lock, tmp_path)
    assert error.message == (
        f"state directory {tmp_path} is in use by another gateway (pid {os.getpid()}, lock {lock})"
    )
    assert first.held
    assert lock.read_text() == f"{os.getpid()}\n"  # the refused take wrote nothing
    first.release()
    assert not first.held
    first.release()  # once is enough
    with StateLock.take(tmp_path) as second:
        assert second.held
    assert not second.held
    assert repr(second) == f"<StateLock {lock} held=False>"


def test_a_lock_with_no_pid_written_yet_says_so(tmp_path: Path) -> None:
    with StateLock.take(tmp_path):
        (tmp_path / LOCK_FILE).write_text("")  # as between the holder's flock and its write
        with pytest.raises(StateDirInUse) as refused:
            StateLock.take(tmp_path)
    assert refused.value.pid is None
    assert "(pid not written yet, lock " in refused.value.message


HOLD = """
import sys
from pathlib import Path
from controller.statelock import StateLock
lock = StateLock.take(Path(sys.argv[1]))
print("held", flush=True)
sys.stdin.read()
"""


def test_the_lock_of_another_process_names_it_and_ends_with_it(tmp_path: Path) -> None:
    """Held by another process: refused with its pid. Killed (no clean-up of any kind), it
    holds nothing: a stale file locks no one out."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline() == b"held\n"
            with pytest.raises(StateDirInUse) as refused:
                StateLock.take(tmp_path)
            assert refused.value.pid == holder.pid
        finally:
            holder.kill()
    assert (tmp_path / LOCK_FILE).read_text() == f"{holder.pid}\n"
    with StateLock.take(tmp_path):
        assert (tmp_path / LOCK_FILE).read_text() == f"{os.getpid()}\n"
