"""``python3 dev.py serve``, the README's run command: it stops everything on SIGTERM (issue
22), and it serves at once, compiling the data plane in the background for the next start
(issue 58).

The command runs as a process of its own on a config with free loopback ports and one
process replica; SIGTERM goes to its pid, as a supervisor (systemd, a container runtime, a
terminal's job control) sends it. ``GATEWAY_NATIVE=0``: no build, the pure modules run. The
background build runs in a copy of the sources (``dev_copy``), whose .venv reaches this
interpreter's packages, so that it builds nothing here; the test ends it once it has seen
it run (the whole build takes minutes: the README's Quickstart gives the measured times).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from controller.store import Store
from gateway import native
from tests.support.eventually import eventually
from tests.support.ports import free_port, port_block

from .conftest import SERVER, Gateways, alive, spec

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


def serve_config(tmp_path: Path, working_dir: str, log_level: str = "warning") -> tuple[Path, int]:
    """A gateway config on free loopback ports with one replica of ``web``; and its traffic
    port."""
    traffic = free_port()
    base = port_block(25)
    config: dict[str, Any] = {
        "listen": f"127.0.0.1:{traffic}",
        "admin": {"listen": f"127.0.0.1:{free_port()}", "token_env": None},
        "state_dir": str(tmp_path / "state"),
        "backends": {"process": {"port_range": f"{base}-{base + 24}"}},
        "access_log": {"enabled": False},
        "log_level": log_level,
        "replicas_on_exit": "stop",
        "services": [
            {
                "name": "web",
                "route": {"path_prefix": "/"},
                "replica": {"commands": [SERVER], "working_dir": working_dir},
                "probes": [{"type": "tcp", "interval": 0.1, "healthy_threshold": 1}],
                "rollout": {"stop_grace": 1},
            }
        ],
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    return path, traffic


async def test_sigterm_to_dev_py_serve_stops_the_gateway_and_its_replicas(
    tmp_path: Path, site
) -> None:
    path, traffic = serve_config(tmp_path, site("v1"))
    state = tmp_path / "state"
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
        replicas = await eventually(
            lambda: replica_pids(state / "gateway.db"), timeout=20, what="a replica"
        )
        await eventually(lambda: accepts(traffic), timeout=10, what="the traffic listener")
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10)
        except TimeoutError:
            raise AssertionError("dev.py serve did not end within 10 s of SIGTERM") from None
        await eventually(
            lambda: not in_session(process.pid) and not any(alive(p) for p in replicas),
            timeout=5,
            what="the gateway and its replicas to end",
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


# -- the background build (issue 58) ----------------------------------------------------------


def dev_copy(tmp_path: Path) -> Path:
    """A copy of what ``dev.py serve`` runs, with a .venv of its own that holds nothing but a
    path to this interpreter's packages, a ``gateway`` script and dev.py's stamp of a done
    install: ``dev.py`` installs nothing, and builds (and writes) in the copy only."""
    repo = tmp_path / "repo"
    for name in ("dev.py", "pyproject.toml"):
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    for name in ("gateway", "controller", "configs"):
        ignore = shutil.ignore_patterns("__pycache__", "_native")
        shutil.copytree(ROOT / name, repo / name, ignore=ignore)
    env = repo / ".venv"
    venv.EnvBuilder(symlinks=True).create(env)
    scheme = {"base": str(env), "platbase": str(env)}
    purelib = Path(sysconfig.get_path("purelib", vars=scheme))
    (purelib / "packages.pth").write_text(sysconfig.get_path("purelib") + "\n")
    gateway = env / "bin" / "gateway"
    gateway.write_text(
        f"#!{env / 'bin' / 'python'}\n"
        "import sys\nfrom controller.main import cli_main\nsys.exit(cli_main())\n"
    )
    gateway.chmod(0o755)
    digest = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()
    (env / ".installed").write_text(f"{digest} native")
    return repo


def copy_env(repo: Path) -> dict[str, str]:
    """The environment ``dev.py`` runs in for the copy: its modules, no GATEWAY_NATIVE."""
    env = {k: v for k, v in os.environ.items() if k != native.ENV}
    return {**env, "PYTHONPATH": str(repo)}


def nice(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_bytes()
    return int(stat[stat.rindex(b")") + 2 :].split()[16])


async def test_dev_py_serve_serves_at_once_and_compiles_in_the_background(
    tmp_path: Path, site
) -> None:
    """Not built: the gateway starts on the pure modules, saying so in one line, while a
    build runs niced in a session of its own, which the gateway's SIGTERM does not end;
    ``gateway native status`` says it is under way."""
    repo = dev_copy(tmp_path)
    path, traffic = serve_config(tmp_path, site("v1"), log_level="info")
    output = tmp_path / "dev-serve.log"
    with open(output, "wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "dev.py", "serve", "-c", str(path),
            cwd=repo, env=copy_env(repo), stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    build = 0
    try:
        await eventually(lambda: accepts(traffic), timeout=30, what="the traffic listener")
        header = (repo / "state" / "native-build.log").read_text().splitlines()[0]
        found = re.fullmatch(r"dev\.py, .* UTC: pid (\d+): (.*)", header)
        assert found, header
        build = int(found[1])
        assert found[2].endswith("gateway native build --no-profile")
        assert alive(build)
        assert nice(build) == 19
        assert os.getsid(build) != process.pid, "the build is in the gateway's session"
        await eventually(
            lambda: b"data plane: pure Python: not built" in output.read_bytes(),
            what="the gateway's line on the data plane it runs",
        )
        said = [line for line in output.read_text().splitlines() if "background" in line]
        assert said == [
            "dev.py: the pure Python data plane runs; the compiled one is being built in the"
            " background for the next start (a few minutes, lowest CPU priority,"
            " state/native-build.log)"
        ]
        status = subprocess.run(
            [str(repo / ".venv" / "bin" / "gateway"), "native", "status"],
            capture_output=True, text=True, env=copy_env(repo), check=True,
        )  # fmt: skip
        assert status.stdout.strip() == (
            f"pure Python: not built (gateway native build); a build is under way (pid {build})"
        )
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 10)
        assert process.returncode == 0
        assert alive(build), "the gateway's SIGTERM ended the build"
    finally:
        for pid in in_session(process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if build:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(build), signal.SIGKILL)  # the build and its compilers
        if process.returncode is None:
            await process.wait()


def built_here() -> None:
    """Skip unless this checkout's data plane is built from its sources (``dev.py test``
    builds it before the suite)."""
    try:
        manifest = json.loads(native.MANIFEST.read_text())
    except (OSError, ValueError):
        manifest = {}
    if manifest.get("digest") != native.digest():
        pytest.skip("the compiled data plane is not built from these sources (dev.py test is)")


async def test_dev_py_serve_runs_a_build_of_its_sources_and_builds_nothing(
    tmp_path: Path, site
) -> None:
    """What the next start after a background build does: the compiled modules run."""
    built_here()
    repo = dev_copy(tmp_path)
    shutil.copytree(native.NATIVE, repo / "gateway" / "_native" / native.TAG)
    path, _ = serve_config(tmp_path, site("v1"), log_level="info")
    output = tmp_path / "dev-serve.log"
    with open(output, "wb") as out:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "dev.py", "serve", "-c", str(path),
            cwd=repo, env=copy_env(repo), stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        await eventually(
            lambda: b"data plane: " in output.read_bytes(),
            timeout=30,
            what="the line on the data plane",
        )
        assert b"data plane: compiled (mypyc): " in output.read_bytes(), output.read_text()
        assert b"background" not in output.read_bytes()
        assert not (repo / "state" / "native-build.log").exists()
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 10)
    finally:
        for pid in in_session(process.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if process.returncode is None:
            await process.wait()


def dev_module() -> ModuleType:
    found = importlib.util.spec_from_file_location("dev", ROOT / "dev.py")
    assert found is not None
    assert found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    return module


async def test_the_demo_says_what_to_try_once_its_service_answers(
    gateways: Gateways, site, capsys
) -> None:
    """``dev.py serve`` on the demo config prints ``curl localhost:8080/hello/`` once
    ``hello`` has a ready replica and the route answers 200 (here, ``web`` on its ports)."""
    dev = dev_module()
    handle = await gateways.start(services=[spec(site("v1"))])
    admin = f"http://127.0.0.1:{handle.gateway.admin.port}/api/services/web"
    url = f"127.0.0.1:{handle.gateway.traffic.port}/"
    said = await asyncio.to_thread(dev.wait_and_say, os.getpid(), admin, url, 20)
    assert said
    assert handle.ready() >= 1
    assert capsys.readouterr().err == f"dev.py: web is serving, try: curl {url}\n"


async def test_the_demo_waiter_gives_up_with_the_gateway(capsys) -> None:
    dev = dev_module()
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    nowhere = f"http://127.0.0.1:{free_port()}/api/services/web"
    said = await asyncio.to_thread(dev.wait_and_say, ended.pid, nowhere, "127.0.0.1:1/", 20)
    assert not said
    assert capsys.readouterr().err == ""
