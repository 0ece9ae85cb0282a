"""``python3 dev.py serve``, the README's run command, stops everything on SIGTERM (issue 22).

The command runs as a process of its own on a config with free loopback ports and one
process replica; SIGTERM goes to its pid, as a supervisor (systemd, a container runtime, a
terminal's job control) sends it. ``GATEWAY_NATIVE=0``: no build, the pure modules run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from controller.store import Store
from tests.ports import free_port

from .conftest import SERVER, alive, until

ROOT = Path(__file__).resolve().parents[2]


def accepts(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def replica_pids(db: Path) -> list[int]:
    """Pids of the replicas the gateway recorded, empty until it has."""
    if not db.exists():
        return []
    try:
        store = Store(db, readonly=True)
    except Exception:  # not created (or migrated) yet
        return []
    try:
        return [json.loads(r.handle_json)["pid"] for r in store.replicas("web")]
    finally:
        store.close()


def in_session(sid: int) -> list[int]:
    """Pids of the live processes of session ``sid`` (the command and any child it left)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in (b"Z", b"X"):
            out.append(int(entry.name))
    return out


async def test_sigterm_to_dev_py_serve_stops_the_gateway_and_its_replicas(
    tmp_path: Path, site
) -> None:
    traffic = free_port()
    state = tmp_path / "state"
    base = 23000 + os.getpid() % 40 * 25
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{traffic}",
        "admin": {"listen": f"127.0.0.1:{free_port()}", "token_env": None},
        "state_dir": str(state),
        "backends": {"process": {"port_range": f"{base}-{base + 24}"}},
        "access_log": {"enabled": False},
        "log_level": "warning",
        "replicas_on_exit": "stop",
        "services": [
            {
                "name": "web",
                "route": {"path_prefix": "/"},
                "replica": {"commands": [SERVER], "working_dir": site("v1")},
                "probes": [{"type": "tcp", "interval": 0.1, "healthy_threshold": 1}],
                "rollout": {"stop_grace": 1},
            }
        ],
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    with open(tmp_path / "dev-serve.log", "wb") as output:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "dev.py",
            "serve",
            "-c",
            str(path),
            cwd=ROOT,
            env={**os.environ, "GATEWAY_NATIVE": "0"},
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,  # its session holds whatever it starts but the replicas
        )
    replicas: list[int] = []
    try:
        replicas = await until(lambda: replica_pids(state / "gateway.db"), 20, "a replica")
        await until(lambda: accepts(traffic), 10, "the traffic listener")
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            raise AssertionError("dev.py serve did not end within 10 s of SIGTERM") from None
        await until(
            lambda: not in_session(process.pid) and not any(alive(p) for p in replicas),
            5,
            "the gateway and its replicas to end",
        )
        assert not accepts(traffic), "the traffic port still accepts connections"
        assert process.returncode == 0, "the gateway did not stop as on its own SIGTERM"
    finally:
        # Whatever failed, leave nothing running: the session's processes, then the replicas
        # (each leads a process group of its own).
        for pid in in_session(process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        for pid in replicas:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        if process.returncode is None:
            await process.wait()
