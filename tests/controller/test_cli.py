"""The ``gateway`` CLI against a real gateway run in-process, with real replica processes.

The gateway runs ``python -m http.server`` replicas on loopback, probed every 50 ms, so a
rollout takes a fraction of a second; the CLI's commands are awaited on the same loop (the
console script wraps the same coroutine in ``asyncio.run``). One test runs the console
script itself as a process, to see its exit code and its one-line errors.
"""

from __future__ import annotations

import asyncio
import errno
import io
import json
import os
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from controller import cli
from controller.config import load_config
from controller.main import build_parser, cli_main
from controller.planning.model import ReplicaState
from controller.serving import Gateway, run_gateway
from tests.support.ports import free_port

TOKEN = "cli-test-token"
SERVER = f"exec {sys.executable} -m http.server $PORT --bind 127.0.0.1"


@dataclass
class Running:
    gateway: Gateway
    url: str
    tmp: Path

    @property
    def controller(self) -> Any:
        return self.gateway.controller

    async def gw(self, *argv: str, token: str | None = TOKEN) -> tuple[int, str, str]:
        """Run one CLI command; returns (exit code, stdout, stderr)."""
        extra = ["--admin", self.url] + (["--token", token] if token is not None else [])
        args = build_parser().parse_args([*argv, *extra])
        out, err = io.StringIO(), io.StringIO()
        code = await cli.run_command(args, out, err)
        return code, out.getvalue(), err.getvalue()

    def spec_file(self, version: str, replicas: int = 2, **changes: Any) -> str:
        site = self.tmp / "sites" / version
        site.mkdir(parents=True, exist_ok=True)
        (site / "index.html").write_text(version)
        data: dict[str, Any] = {
            "name": "web",
            "route": {"path_prefix": "/web"},
            "replicas": replicas,
            "replica": {"commands": [SERVER], "working_dir": str(site), "env": {"V": version}},
            "probes": [
                {"type": "http", "path": "/", "interval": "50ms", "timeout": "500ms",
                 "healthy_threshold": 1, "unhealthy_threshold": 2}
            ],
            "rollout": {"retries": 0, "retry_backoff": "100ms", "max_retry_backoff": "200ms",
                        "start_timeout": 10, "drain_timeout": 1, "stop_grace": 1},
        }  # fmt: skip
        for key, value in changes.items():
            data[key] = value
        path = self.tmp / f"web-{version}-{replicas}.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path)


@pytest.fixture
def capacity() -> int:
    """The process backend's slots (a test parametrizes it to run out of them)."""
    return 8


@pytest.fixture
async def running(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capacity: int
) -> AsyncIterator[Running]:
    monkeypatch.delenv(cli.URL_ENV, raising=False)
    monkeypatch.delenv(cli.TOKEN_ENV, raising=False)
    (tmp_path / "token").write_text(TOKEN + "\n")
    base = 24000 + random.randrange(40) * 25
    config = {
        "listen": "127.0.0.1:0",
        "admin": {
            "listen": "127.0.0.1:0",
            "token_env": None,
            "token_file": str(tmp_path / "token"),
        },
        "state_dir": "state",
        "backends": {"process": {"capacity": capacity, "port_range": f"{base}-{base + 24}"}},
        "proxy": {"shutdown_timeout": 2},
        "access_log": {"enabled": False},
        "replicas_on_exit": "stop",
    }
    path = tmp_path / "gateway.json"
    path.write_text(json.dumps(config))
    loaded = load_config(path)
    stop = asyncio.Event()
    started: asyncio.Future[Gateway] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(run_gateway(loaded, stop, started=started.set_result))
    waiting: set[asyncio.Future[Any]] = {task, started}
    done, _ = await asyncio.wait(waiting, timeout=10, return_when="FIRST_COMPLETED")
    if started not in done:
        stop.set()
        await task
        raise AssertionError("the gateway did not start")
    gateway = started.result()
    try:
        yield Running(gateway, f"http://127.0.0.1:{gateway.admin.port}", tmp_path)
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)


# -- finding the admin API --------------------------------------------------------------------


def args_of(*argv: str) -> Any:
    return build_parser().parse_args(["status", *argv])


def test_flags_then_environment_then_config_then_default(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("from-file\n")
    config = tmp_path / "gateway.yaml"
    config.write_text(
        f"admin: {{listen: '0.0.0.0:18081', token_env: null, token_file: {tmp_path / 'token'}}}\n"
    )
    env = {"GATEWAY_ADMIN_URL": "http://env:1", "GATEWAY_ADMIN_TOKEN": "from-env"}
    assert cli.resolve_target(args_of(), {}) == cli.Target("http://127.0.0.1:8081", None)
    assert cli.resolve_target(args_of(), env) == cli.Target("http://env:1", "from-env")
    flags = args_of("--admin", "http://flag:2/", "--token", "from-flag", "-c", str(config))
    assert cli.resolve_target(flags, env) == cli.Target("http://flag:2", "from-flag")
    from_config = cli.resolve_target(args_of("-c", str(config)), {})
    assert from_config == cli.Target("http://127.0.0.1:18081", "from-file")
    mixed = cli.resolve_target(args_of("-c", str(config)), {"GATEWAY_ADMIN_URL": "http://env:1"})
    assert mixed == cli.Target("http://env:1", "from-file")


@pytest.mark.parametrize("url", ["notaurl", "http://", "ftp://host:1"])
def test_an_admin_url_that_is_not_one_is_refused(url: str) -> None:
    with pytest.raises(cli.CliError, match="not an admin API URL") as caught:
        cli.resolve_target(args_of("--admin", url), {})
    assert caught.value.code == 2


def test_serve_refuses_a_non_loopback_admin_listener_without_a_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("admin: {listen: '0.0.0.0:0', token_env: null}\nstate_dir: state\n")
    assert cli_main(["serve", "-c", str(config)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gateway: admin.listen 0.0.0.0:0 is not a loopback address")
    assert err.count("\n") == 1
    assert not (tmp_path / "state").exists()  # refused before anything started


def test_workers_from_the_command_line_win_and_bad_counts_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("workers: 3\nstate_dir: state\n")
    assert load_config(config).config.workers == 3
    assert load_config(config, workers=2).config.workers == 2
    assert load_config(config, workers="auto").config.worker_count == len(os.sched_getaffinity(0))
    assert cli_main(["serve", "-c", str(config), "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert "workers" in err
    assert "from 1 to 64, or 'auto'" in err
    assert not (tmp_path / "state").exists()


def test_admin_urls_from_listen_addresses() -> None:
    assert cli.admin_url("127.0.0.1:8081") == "http://127.0.0.1:8081"
    assert cli.admin_url("0.0.0.0:9") == "http://127.0.0.1:9"
    assert cli.admin_url("[::]:9") == "http://[::1]:9"
    assert cli.admin_url("[::1]:9") == "http://[::1]:9"
    with pytest.raises(cli.CliError, match="no fixed port"):
        cli.admin_url("127.0.0.1:0")


async def test_a_bad_config_is_one_line_and_exit_2(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("admin: {listen: nowhere}\n")
    args = build_parser().parse_args(["status", "-c", str(config)])
    out, err = io.StringIO(), io.StringIO()
    assert await cli.run_command(args, out, err) == 2
    assert err.getvalue().count("\n") == 1
    assert "admin.listen" in err.getvalue()


async def run_script(*argv: str) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "controller.main", *argv,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_console_script_gives_one_line_errors(running: Running) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = await run_script("status", "--admin", url, "--token", TOKEN)
    assert code == 2
    assert out == ""
    assert err == f"gateway: cannot connect to the gateway at {url}: connection refused\n"
    assert "Traceback" not in err

    code, out, err = await run_script("status", "--admin", running.url, "--token", "wrong")
    assert (code, out) == (2, "")
    assert err == f"gateway: the gateway at {running.url} refused the token\n"


async def test_an_unreachable_gateway_is_said_in_words() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    async with aiohttp.ClientSession() as session:
        client = cli.Client(session, cli.Target(url, None))
        with pytest.raises(cli.CliError) as refused:
            await client.call("GET", "/api/services")
    # Before: "Cannot connect to host 127.0.0.1:N ssl:default [Connect call failed (...)]".
    assert refused.value.message == f"cannot connect to the gateway at {url}: connection refused"
    assert refused.value.code == cli.EXIT_UNUSABLE
    from controller.unreachable import unreachable_reason

    assert unreachable_reason(TimeoutError()) == "no answer in time"
    assert unreachable_reason(OSError(errno.EHOSTUNREACH, "x")) == "no route to host"


async def run_script_into_closed_pipe(*argv: str) -> tuple[int, str]:
    """Run the console script with its standard output a pipe nobody reads any more (as
    after ``| head -3`` exits), buffered as in a shell; returns (exit code, stderr)."""
    read, write = os.pipe()
    os.close(read)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    try:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "controller.main", *argv,
            stdout=write, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
    finally:
        os.close(write)
    _, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode is not None
    return process.returncode, err.decode()


@pytest.mark.parametrize("argv", [["--help"], ["logs", "--help"], ["native", "status"]])
async def test_a_closed_pipe_ends_help_and_local_commands_quietly(argv: list[str]) -> None:
    # Before: "Exception ignored ... BrokenPipeError" at exit, and 120.
    assert await run_script_into_closed_pipe(*argv) == (cli.EXIT_PIPE, "")


async def test_a_closed_pipe_ends_the_command_quietly(running: Running) -> None:
    extra = ("--admin", running.url, "--token", TOKEN)
    # Written at exit (the buffer is flushed then), and while the command runs (apply
    # flushes each line as it follows).
    assert await run_script_into_closed_pipe("status", *extra) == (cli.EXIT_PIPE, "")
    spec = running.spec_file("v1")
    assert await run_script_into_closed_pipe("apply", "-f", spec, *extra) == (cli.EXIT_PIPE, "")


# -- output -----------------------------------------------------------------------------------


def test_a_first_rollout_reads_new_service_not_none() -> None:
    rollout = {
        "kind": "rollout", "id": 1, "status": "progressing", "from_revision": None,
        "to_revision": 1, "failures": 0, "retries": 0, "reason": "",
        "progress": [{"revision": 1, "ready": 1, "live": 2, "desired": 2}],
    }  # fmt: skip
    assert cli.progress_text(rollout) == (
        "rollout 1: new service, revision 1, progressing: r1 1/2 ready"
    )
    assert cli.progress_text(rollout | {"from_revision": 3, "to_revision": 4}) == (
        "rollout 1: revision 3 -> 4, progressing: r1 1 ready"
    )


def test_a_backoff_reads_its_failures_and_its_next_start() -> None:
    from controller.cli.render import backoff_text

    now = time.time()
    backoff = {"failures": 1, "reason": "no capacity", "last_failure_at": now, "retry_at": now}
    assert backoff_text(backoff | {"retry_at": now + 30.5}) == (
        "1 failure in a row, next start in 30s"
    )
    assert backoff_text(backoff | {"failures": 3}) == "3 failures in a row, next start now"


async def test_a_scales_progress_gives_one_count() -> None:
    from controller.cli.following import Follow, _step_scale

    view = {
        "name": "web", "status": "degraded", "desired": 12, "ready": 7, "rollout": None,
        "replicas": [{"id": f"r{i}", "state": "ready"} for i in range(7)]
        + [{"id": "r7", "state": "starting"}],
        # Set when 6 were ready: the condition's count lags the view's.
        "conditions": {"degraded": True, "reason": "6 of 12 replicas ready"},
        "backoff": None,
    }  # fmt: skip

    class Views:
        async def service(self, name: str) -> dict[str, Any]:
            return view

    said: list[str] = []
    follow = Follow()
    await _step_scale(Views(), "web", frozenset(), follow, said.append)  # type: ignore[arg-type]
    view["backoff"] = {"failures": 2, "reason": "no capacity: 7 of 7 slots in use",
                       "last_failure_at": 0.0, "retry_at": 0.0}  # fmt: skip
    await _step_scale(Views(), "web", frozenset(), follow, said.append)  # type: ignore[arg-type]
    assert said == ["web: 7/12 ready", "web: 7/12 ready (no capacity: 7 of 7 slots in use)"]
    assert follow.code is None


def view_of(status: str, desired: int, *states: str, rollout: bool = False) -> dict[str, Any]:
    """A service view with replicas ``a``, ``b``, ... in ``states``."""
    replicas = [{"id": chr(ord("a") + i), "state": s} for i, s in enumerate(states)]
    return {
        "status": status, "desired": desired, "replicas": replicas,
        "ready": sum(1 for s in states if s == "ready"),
        "rollout": {"id": 1} if rollout else None,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("view", "outcome"),
    [
        (view_of("ready", 2, "ready", "ready", "stopped"), "done"),
        (view_of("ready", 2, "ready", "ready", "draining"), None),  # a scale-down drains
        (view_of("degraded", 3, "ready", "ready", "starting"), None),
        (view_of("degraded", 3, "ready", "ready", "requested", "failed"), None),
        (view_of("degraded", 3, "ready", "ready", "failed"), "degraded"),
        (view_of("degraded", 3, "ready", "ready", "failed", "failed"), "degraded"),
        (view_of("degraded", 3, "ready", "ready", "failed", rollout=True), None),
        # Held back by draining replicas (their slots), not by a failure: it goes on.
        (view_of("degraded", 3, "ready", "ready", "draining"), None),
        (view_of("degraded", 3, "ready", "ready", "stopped"), None),
    ],
)
def test_when_a_scale_has_settled(view: dict[str, Any], outcome: str | None) -> None:
    known = frozenset({"a", "b", "d"})  # "c" was started by the command, "d" failed before
    assert cli.scale_outcome(view, known) == outcome
    assert cli.scale_outcome(view, known | {"c"}) == (outcome if outcome == "done" else None)


# -- against a running gateway ----------------------------------------------------------------


async def test_apply_follows_rollouts_and_status_shows_them(running: Running) -> None:
    code, out, err = await running.gw("status")
    assert (code, out, err) == (0, "no services\n", "")

    code, out, err = await running.gw("apply", "-f", running.spec_file("v1"))
    assert (code, err) == (0, ""), out
    lines = out.splitlines()
    assert lines[0] == "web: created at revision 1; rollout 1 started"
    assert lines[-1] == "rollout 1 complete: revision 1 serving"
    assert lines[1].startswith("rollout 1: new service, revision 1, progressing: r1 ")
    assert any("r1 1/2 ready" in line or "r1 0/2 ready" in line for line in lines[1:-1])

    code, out, _ = await running.gw("status")
    assert code == 0
    header, row = out.splitlines()
    assert header.split() == ["NAME", "REVISION", "READY", "STATUS", "ROLLOUT"]
    assert row.split() == ["web", "1", "2/2", "ready", "-"]

    code, out, _ = await running.gw("status", "--json")
    assert json.loads(out)["hosts"] == [
        {
            "backend": "process",
            "name": "local",
            "engine": "local",
            "reachable": True,
            "error": "",
            "replicas": 2,
            "capacity": 8,
        }
    ]

    code, out, _ = await running.gw("status", "web")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "web: ready, revision 1, 2/2 ready"
    assert lines[1].split()[:5] == ["REPLICA", "REVISION", "STATE", "HEALTH", "IN-FLIGHT"]
    assert [line.split()[1:5] for line in lines[2:]] == [["1", "ready", "healthy", "0"]] * 2

    spec_v2 = running.spec_file("v2")
    code, out, _ = await running.gw("apply", "-f", spec_v2, "--dry-run")
    assert code == 0
    assert out == "(dry run) web: revision 1 -> 2: replica.env, replica.working_dir\n"
    assert running.controller.state("web").desired.revision == 1

    code, out, _ = await running.gw("apply", "-f", spec_v2)
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "web: revision 1 -> 2: replica.env, replica.working_dir; rollout 2 started"
    assert lines[1].startswith("rollout 2: revision 1 -> 2, progressing: r2 0/2 ready, r1 2 ready")
    assert lines[-1] == "rollout 2 complete: revision 2 serving"

    code, out, _ = await running.gw("apply", "-f", spec_v2)
    assert (code, out) == (0, "web: unchanged (revision 2)\n")

    code, out, _ = await running.gw("rollout", "status", "web")
    assert out == "web: no rollout in progress; last: rollout 2 to revision 2 complete\n"
    code, out, _ = await running.gw("rollout", "history", "web")
    rows = [line.split()[:5] for line in out.splitlines()]
    assert rows == [
        ["ID", "KIND", "FROM", "TO", "STATUS"],
        ["2", "rollout", "1", "2", "complete"],
        ["1", "rollout", "-", "1", "complete"],
    ]

    code, out, _ = await running.gw("status", "web", "--json")
    view = json.loads(out)
    assert (view["name"], view["serving_revision"], view["ready"]) == ("web", 2, 2)
    code, out, _ = await running.gw("rollout", "history", "web", "--json")
    assert [r["status"] for r in json.loads(out)["rollouts"]] == ["complete", "complete"]


async def test_rollout_control(running: Running) -> None:
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1"))
    assert code == 0, out
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v2"))
    assert code == 0, out
    # Revision 3 never passes its probe (http.server answers 404): its rollout stays open.
    probe = {"type": "http", "path": "/missing", "interval": "50ms", "healthy_threshold": 1}
    stuck = running.spec_file("v3", probes=[probe])
    code, out, _ = await running.gw("apply", "-f", stuck, "--no-wait")
    assert (code, out) == (0, "web: revision 2 -> 3: replica.env, replica.working_dir, probes; "
                              "rollout 3 started\n")  # fmt: skip

    code, out, _ = await running.gw("rollout", "pause", "web")
    assert (code, out.splitlines()[0].split(", ")[1]) == (0, "paused: r3 0/2 ready")
    code, out, _ = await running.gw("rollout", "status", "web")
    assert out.startswith("rollout 3: revision 2 -> 3, paused: r3 0/2 ready, r2 2 ready")
    assert out.endswith("(paused by request)\n")
    code, out, _ = await running.gw("status")
    assert out.splitlines()[1].split() == ["web", "2", "->", "3", "2/2", "paused", "3", "paused"]
    code, out, err = await running.gw("rollout", "pause", "web")
    assert (code, out, err) == (1, "", "gateway: rollout 3 is paused\n")
    # A scale during a rollout follows the rollout: paused, it goes on past --timeout.
    code, out, err = await running.gw("scale", "web", "3", "--timeout", "0.2")
    assert (code, err) == (1, "gateway: web: not done after 0.2s (it goes on)\n")
    assert out.splitlines() == [
        "web: scale 2 -> 3 replicas (revision 3)",
        "rollout 3: revision 2 -> 3, paused: r3 0/3 ready, r2 2 ready (paused by request)",
    ]
    # Followed, rollout 3 would fail once its replicas are not ready within start_timeout.
    code, out, _ = await running.gw("rollout", "resume", "web", "--no-wait")
    assert code == 0
    assert out.startswith("web: rollout 3: revision 2 -> 3, progressing")
    assert out.count("\n") == 1

    # Every command that starts a rollout follows it as apply does (before: one line).
    code, out, _ = await running.gw("rollout", "abort", "web", "--timeout", "10")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("web: aborted; rollback 4: revision 3 -> 2")
    assert lines[-1] == "rollback 4 complete: revision 2 serving"
    code, out, _ = await running.gw("rollout", "undo", "web", "--to-revision", "1")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith("web: undo 5: revision 2 -> 1, progressing")
    assert lines[-1] == "undo 5 complete: revision 1 serving"
    assert running.controller.state("web").observed.serving_revision == 1
    code, out, _ = await running.gw("rollout", "undo", "web", "--to-revision", "2", "--no-wait")
    assert code == 0
    assert out.startswith("web: undo 6: revision 1 -> 2, progressing")
    assert out.count("\n") == 1
    code, out, _ = await running.gw("rollout", "history", "web")
    rows = [line.split()[:5] for line in out.splitlines()[1:]]
    assert [r[0] for r in rows] == ["6", "5", "4", "3", "2", "1"]
    assert rows[3] == ["3", "rollout", "2", "3", "aborted"]
    assert rows[2] == ["4", "rollback", "3", "2", "complete"]
    assert rows[1] == ["5", "undo", "2", "1", "complete"]


async def test_a_crash_reason_carries_its_last_output_and_logs_show_the_failed(
    running: Running,
) -> None:
    """Issue 22.12: the rollout's reason says what the replica said before it exited, and
    ``logs --failed`` shows the failed replica's output."""
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1"))
    assert code == 0, out
    crash = ["echo loading; echo 'fatal: model file missing' >&2; exit 3"]
    broken = running.spec_file("v2", replica={"commands": crash, "env": {"V": "broken"}})
    code, out, _ = await running.gw("apply", "-f", broken)
    assert code == 1, out
    assert (
        "rollout 2 failed: replica exited with code 3: fatal: model file missing (after 1 failure)"
    ) in out.splitlines()
    code, out, _ = await running.gw("logs", "web", "--failed", "--tail", "5")
    assert code == 0, out
    assert "fatal: model file missing" in out
    assert "loading" in out


async def test_logs_say_a_replica_wrote_nothing() -> None:
    from controller.cli.commands import cmd_logs

    replicas = [
        {"id": "k-1-9f95d3", "state": "failed", "since": 3.0},
        {"id": "k-1-a0b1c2", "state": "failed", "since": 5.0},
    ]
    written = {"k-1-9f95d3": [], "k-1-a0b1c2": ["fatal: no model"]}

    class Api:
        async def call(self, method: str, path: str) -> dict[str, Any]:
            if path.endswith("/logs?tail=5"):
                rid = path.split("/")[-2]
                return {"service": "k", "replica": rid, "lines": written[rid]}
            return {"replicas": replicas}

    async def logs(*argv: str) -> str:
        out = io.StringIO()
        args = build_parser().parse_args(["logs", "k", "--tail", "5", *argv])
        assert await cmd_logs(Api(), args, out) == 0  # type: ignore[arg-type]
        return out.getvalue()

    assert await logs("--failed") == "k-1-9f95d3: no output\n[k-1-a0b1c2] fatal: no model\n"
    assert await logs("--replica", "k-1-9f95d3") == "k-1-9f95d3: no output\n"
    replicas.clear()
    assert await logs("--failed") == "k: no failed replicas\n"
    assert await logs() == "k: no replicas\n"


def test_logs_pick_the_live_replicas_else_the_last_failed() -> None:
    replicas = [
        {"id": "a", "state": "failed", "since": 3.0},
        {"id": "b", "state": "stopped", "since": 9.0},
        {"id": "c", "state": "failed", "since": 5.0},
    ]
    assert cli.pick_log_replicas(replicas, failed=False) == ["c"]
    assert cli.pick_log_replicas(replicas, failed=True) == ["a", "c"]
    live = [*replicas, {"id": "d", "state": "ready", "since": 1.0}]
    assert cli.pick_log_replicas(live, failed=False) == ["d"]
    assert cli.pick_log_replicas(live, failed=True) == ["a", "c"]


async def test_a_failed_rollout_exits_non_zero_with_the_reason(running: Running) -> None:
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1"))
    assert code == 0, out
    broken = running.spec_file("v2", replica={"commands": ["exit 3"], "env": {"V": "broken"}})
    code, out, err = await running.gw("apply", "-f", broken)
    assert code == 1, out
    assert err == ""
    lines = out.splitlines()
    changes = "replica.commands, replica.env, replica.working_dir"
    assert lines[0] == f"web: revision 1 -> 2: {changes}; rollout 2 started"
    assert "rollout 2 failed: replica exited with code 3 (after 1 failure)" in lines
    assert lines[-1] in ("revision 1 serving", "rolling back to revision 1 (rollback 3)")
    state = running.controller.state("web")
    assert state.observed.serving_revision == 1
    assert sum(1 for r in state.observed.replicas if r.state is ReplicaState.READY) == 2

    code, out, _ = await running.gw("apply", "-f", broken, "--json", "--no-wait")
    assert code == 0
    result = json.loads(out)
    assert (result["result"]["action"], result["rollout"]) == ("rollout", None)


async def test_scale_logs_drain_and_undrain(running: Running) -> None:
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1", replicas=1))
    assert code == 0, out
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1", replicas=2))
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "web: scale 1 -> 2 replicas (revision 1)"
    assert lines[-1] == "web: 2/2 ready"

    code, out, _ = await running.gw("scale", "web", "3")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == "web: scale 2 -> 3 replicas (revision 1)"
    assert lines[-1] == "web: 3/3 ready"

    replica = next(
        r.id for r in running.controller.state("web").observed.replicas
        if r.state is ReplicaState.READY
    )  # fmt: skip
    code, out, _ = await running.gw("logs", "web", "--replica", replica, "--tail", "2")
    assert code == 0
    assert 1 <= len(out.splitlines()) <= 2
    assert "GET / HTTP/1.1" in out  # http.server logs each probe
    code, out, _ = await running.gw("logs", "web", "--tail", "1")
    assert code == 0
    assert all(line.startswith("[web-1-") for line in out.splitlines())

    code, out, _ = await running.gw("drain", "web", replica)
    assert code == 0
    assert out.startswith(f"web: upstream {replica} (127.0.0.1:")
    assert "draining" in out
    code, out, _ = await running.gw("undrain", "web", replica, "--json")
    assert json.loads(out)["admin"] == "active"


@pytest.mark.parametrize("capacity", [3])
async def test_a_scale_up_that_cannot_be_placed_ends_degraded(running: Running) -> None:
    code, out, _ = await running.gw("apply", "-f", running.spec_file("v1", replicas=2))
    assert code == 0, out
    degraded = "3 of 4 replicas ready: no capacity: 3 of 3 slots in use"
    # Before: followed for ever (here until --timeout, exit 1).
    code, out, err = await running.gw(
        "apply", "-f", running.spec_file("v1", replicas=4), "--timeout", "10"
    )
    assert (code, err) == (cli.EXIT_DEGRADED, ""), out
    lines = out.splitlines()
    assert lines[0] == "web: scale 2 -> 4 replicas (revision 1)"
    assert lines[-1] == f"web: degraded: {degraded} (retried with backoff)"
    assert running.controller.state("web").observed.degraded == degraded

    code, out, err = await running.gw("scale", "web", "5", "--timeout", "10")
    assert (code, err) == (cli.EXIT_DEGRADED, ""), out
    lines = out.splitlines()
    assert lines[0] == "web: scale 4 -> 5 replicas (revision 1)"
    assert (
        lines[-1] == "web: degraded: 3 of 5 replicas ready: no capacity: 3 of 3 slots in use"
        " (retried with backoff)"
    )
    code, out, _ = await running.gw("scale", "web", "6", "--no-wait")
    assert (code, out) == (0, "web: scale 5 -> 6 replicas (revision 1)\n")
    code, out, _ = await running.gw("scale", "web", "3")
    assert (code, out.splitlines()[-1]) == (0, "web: 3/3 ready")


async def test_refusals_are_one_line_errors(running: Running) -> None:
    code, out, err = await running.gw("status", "nope")
    assert (code, out, err) == (1, "", "gateway: no service 'nope'\n")
    code, out, err = await running.gw("status", token=None)
    assert (code, out) == (2, "")
    assert err == (
        f"gateway: the gateway at {running.url} refused the token "
        "(no token given: --token or $GATEWAY_ADMIN_TOKEN)\n"
    )
    bad = running.tmp / "bad.yaml"
    bad.write_text("name: web\nroute: {path_prefix: 5}\nreplicas: -1\nreplica: {commands: [x]}\n")
    code, out, err = await running.gw("apply", "-f", str(bad))
    assert (code, out) == (1, "")
    assert err.startswith("gateway: invalid spec: ")
    assert "replicas:" in err
    assert "route.path_prefix:" in err
    assert err.count("\n") == 1
    assert running.controller.service_names() == []
    missing = running.tmp / "missing.yaml"
    code, _, err = await running.gw("apply", "-f", str(missing))
    assert code == 2
    assert err.startswith("gateway: ")
    assert err.count("\n") == 1


async def test_tokens_and_the_guards_in_status(
    running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gateway token add|list|revoke`` and the guards under ``gateway status web``."""
    spec = running.spec_file(
        "v1",
        replicas=1,
        auth={"type": "bearer"},
        rate_limits=[{"path_prefix": "/web", "key": "token", "rps": 5, "burst": 10}],
        load_balancing={"policy": "hash", "key": "cookie:sid"},
        limits={"max_in_flight_per_replica": 4},
    )
    code, out, err = await running.gw("apply", "-f", spec)
    assert code == 0, out + err
    code, out, _ = await running.gw("token", "add", "web", "--label", "ci")
    assert code == 0
    added, shown = out.splitlines()
    token_id = added.split()[2]
    assert added == f"web: token {token_id} added"
    secret = shown.rsplit(" ", 1)[1]
    assert len(secret) == 43
    monkeypatch.setattr(sys, "stdin", io.StringIO("given-token-from-stdin\n"))
    code, out, _ = await running.gw("token", "add", "web", "--stdin")
    assert code == 0
    assert len(out.splitlines()) == 1  # a given token is never printed back
    code, out, _ = await running.gw("token", "list", "web")
    assert code == 0
    assert out.splitlines()[0].split() == ["ID", "SOURCE", "LABEL", "ADDED"]
    assert token_id in out
    assert secret not in out
    assert "given-token-from-stdin" not in out
    code, out, _ = await running.gw("token", "revoke", "web", token_id)
    assert (code, out) == (0, f"web: token {token_id} revoked\n")
    code, _, err = await running.gw("token", "revoke", "web", token_id)
    assert code != 0
    assert "no token" in err
    code, out, _ = await running.gw("status", "web")
    assert code == 0
    assert "auth: bearer in authorization, 1 tokens; requests 0 ok, 0 missing, 0 wrong" in out
    assert "rate limit: /web by token, 5/s burst 10" in out
    assert "affinity: hash of cookie:sid" in out
    assert "in flight per replica: at most 4; 0 queued now, 0 rejected (503)" in out


def _every_command(parser: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    import argparse

    out = [path]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.extend(_every_command(sub, (*path, name)))
    return out


def test_every_command_prints_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    # argparse formats help strings with %: a bare "100%" in one made `rollout --help` a
    # traceback.
    commands = _every_command(build_parser())
    assert ("rollout", "promote") in commands
    assert len(commands) > 20
    for command in commands:
        with pytest.raises(SystemExit) as done:
            build_parser().parse_args([*command, "--help"])
        assert done.value.code == 0, command
        assert "usage: gateway" in capsys.readouterr().out
