"""Real etcd members on loopback, for the tests of the etcd store and of the cluster.

``EtcdCluster(base, members=3)`` starts ``members`` etcd processes (Debian's ``etcd-server``,
etcd 3.4) on free loopback ports, each with its own data directory under ``base``, as one
cluster; ``start`` waits until every member answers ``/health``. Members can be killed
(SIGKILL), stopped and continued (SIGSTOP/SIGCONT) and started again on the same ports and data,
which is what the fault tests need. ``close`` stops every member this object started, by pid.

Under CI (``CI`` set) a missing ``etcd`` binary is an error; elsewhere the tests that need etcd
are skipped (see ``require_etcd``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from tests.needs import missing
from tests.support.eventually import GiveUp, eventually_blocking
from tests.support.ports import free_port


def etcd_binary() -> str | None:
    return shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)


def require_etcd() -> str:
    """The etcd binary's path; the test is skipped without one, but fails under CI."""
    binary = etcd_binary()
    if binary is None:
        missing("etcd is not installed (apt-get install etcd-server; .ci/etcd.sh installs it)")
    return binary


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class EtcdCluster:
    base: Path
    members_count: int = 3
    token: str = "gateway-test"
    members: list[Member] = field(default_factory=list)
    binary: str = ""

    def __post_init__(self) -> None:
        self.binary = self.binary or require_etcd()
        self.base.mkdir(parents=True, exist_ok=True)
        for i in range(self.members_count):
            name = f"m{i}"
            self.members.append(
                Member(
                    name=name,
                    client_port=free_port(),
                    peer_port=free_port(),
                    data_dir=self.base / f"{name}.etcd",
                    log_path=self.base / f"{name}.log",
                )
            )

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def _argv(self, member: Member, state: str) -> list[str]:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        return [
            self.binary,
            "--name",
            member.name,
            "--data-dir",
            str(member.data_dir),
            "--listen-client-urls",
            member.endpoint,
            "--advertise-client-urls",
            member.endpoint,
            "--listen-peer-urls",
            member.peer_url,
            "--initial-advertise-peer-urls",
            member.peer_url,
            "--initial-cluster",
            initial,
            "--initial-cluster-token",
            self.token,
            "--initial-cluster-state",
            state,
            # Short timings, so elections among the members take well under a second.
            "--heartbeat-interval",
            "50",
            "--election-timeout",
            "500",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
        ]

    def start_member(self, index: int) -> None:
        member = self.members[index]
        if member.alive:
            return
        state = "existing" if member.data_dir.exists() else "new"
        log = member.log_path.open("ab")
        member.process = subprocess.Popen(
            self._argv(member, state),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()

    def start(self, timeout: float = 20.0) -> EtcdCluster:
        """Start every member; wait until each answers. A port taken between ``free_port``
        and etcd's bind (another test's member) makes a fresh try on other ports."""
        for attempt in range(3):
            for i in range(len(self.members)):
                self.start_member(i)
            try:
                self.wait_healthy(timeout)
                return self
            except GiveUp as e:
                if "address already in use" not in str(e) or attempt == 2:
                    raise
                self.close()
                for member in self.members:
                    shutil.rmtree(member.data_dir, ignore_errors=True)
                    member.process = None
                    member.client_port, member.peer_port = free_port(), free_port()
        return self

    def healthy(self, index: int) -> bool:
        member = self.members[index]
        try:
            with urllib.request.urlopen(member.endpoint + "/health", timeout=1) as answer:
                return bool(json.loads(answer.read()).get("health") == "true")
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 20.0, indexes: list[int] | None = None) -> None:
        """Until each member (of ``indexes``) answers ``/health``; one that exited fails the
        wait at once (``GiveUp``, with the end of its log)."""
        wanted = list(range(len(self.members))) if indexes is None else indexes

        def healthy() -> bool:
            missing = [i for i in wanted if not self.healthy(i)]
            for i in missing:
                process = self.members[i].process
                if process is not None and process.poll() is not None:
                    log = self.members[i].log_path.read_text(errors="replace")[-2000:]
                    raise GiveUp(f"etcd member {i} exited: {log}")
            assert not missing, f"etcd members {missing} not healthy"
            return True

        eventually_blocking(healthy, timeout=timeout, what="the etcd members healthy")

    def kill_member(self, index: int) -> None:
        """SIGKILL one member; its data stays, so ``start_member`` brings it back."""
        member = self.members[index]
        if member.process is not None and member.process.poll() is None:
            member.process.kill()
            member.process.wait(10)

    def stop_all(self) -> None:
        for i in range(len(self.members)):
            self.kill_member(i)

    def pause_member(self, index: int) -> None:
        """SIGSTOP one member, returning once every thread of it is stopped: the signal is
        delivered on its own time, and a thread running meanwhile can still answer."""
        process = self.members[index].process
        if process is not None:
            os.kill(process.pid, signal.SIGSTOP)
            eventually_blocking(
                lambda: _stopped(process.pid),
                what=f"member {index}'s threads stopped",
                every=0.005,
            )

    def continue_member(self, index: int) -> None:
        process = self.members[index].process
        if process is not None:
            os.kill(process.pid, signal.SIGCONT)

    def close(self) -> None:
        for member in self.members:
            if member.process is not None and member.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(member.process.pid, signal.SIGCONT)
                member.process.terminate()
                try:
                    member.process.wait(5)
                except subprocess.TimeoutExpired:
                    member.process.kill()
                    member.process.wait(5)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (state T in /proc)."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    return bool(states) and all(state in "Tt" for state in states)
