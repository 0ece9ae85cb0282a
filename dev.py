#!/usr/bin/env python3
"""Bootstrap for a fresh clone: make .venv, install the project, then run a task.

    python3 dev.py serve [gateway args...]   run the gateway on configs/gateway.yaml
    python3 dev.py test  [pytest args...]    lint, type-check, check the import layering and run
                                             the test suite but its slow tier (``--slow``: that
                                             tier alone, as .ci/run runs it after; ``--all``: both)
                                             (compiled; then tests/gateway on pure Python)
    python3 dev.py cluster                   a three-node cluster on this machine: three etcd
                                             members and three gateways (configs/cluster/)

Only the standard library is used here, so this works where nothing but Python 3.11+ exists.
``serve`` installs the project alone (what serving needs), ``cluster`` with its ``native``
extra (what compiling the data plane needs), ``test`` with its ``test`` extra (the test tools
too); an install is skipped while pyproject.toml is unchanged since one with that extra.

The data plane's hot modules are compiled (gateway/native.py) when their sources changed
since the last build. ``test`` and ``cluster`` build before they run; where that cannot be
done (no C compiler), the pure Python modules run. ``serve`` does not wait: it starts on the
pure modules and, in the background (``BUILD_LOG``), installs the native extra if missing and
builds, for the next start.
``GATEWAY_NATIVE=0 python3 dev.py serve`` runs the pure modules and builds nothing.

``serve`` then becomes the gateway (exec): its pid is the gateway's, so SIGTERM or Ctrl-C
to it stops the gateway and the replicas it runs, as ``gateway serve`` does (neither stops
a background build). On the demo config it says what to try once ``hello`` serves.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import venv
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
STAMP = VENV / ".installed"
"""pyproject.toml's digest, then the extras installed with it (one a word)."""
BUILD_LOG = ROOT / "state" / "native-build.log"
"""Where ``serve``'s background builds write (appended, one header line each)."""
DEMO_URL = "localhost:8080/hello/"
DEMO_SERVICE = "http://127.0.0.1:8081/api/services/hello"
"""configs/gateway.yaml's route to ``hello`` and its admin API's view of it."""
DEMO_WAIT = 300.0
"""Seconds the demo's waiter waits for ``hello`` to serve before it gives up, silently."""

PARALLEL = ("-n", "auto", "--maxprocesses", "4", "--dist", "loadscope")
"""pytest-xdist's options for ``test``: a process a CPU (at most four), a module to each."""

INSTALLING = {
    None: "the project (what serving needs; dev.py test installs the test tools)",
    "native": "the project and what compiling its data plane needs (mypy, setuptools)",
    "test": "the project and its test tools",
}


def ensure_venv(extra: str | None) -> None:
    """Install the project (with ``extra``) into .venv unless it is, from this pyproject."""
    if sys.version_info < (3, 11):  # noqa: UP036 - this script must run, and say so, anywhere
        sys.exit(f"dev.py: Python 3.11+ is needed, this is {sys.version.split()[0]}")
    if installed(extra):
        return
    if not (BIN / "python").exists():
        print("dev.py: creating .venv", file=sys.stderr)
        venv.EnvBuilder(with_pip=True).create(VENV)
    print(f"dev.py: installing {INSTALLING[extra]} into .venv", file=sys.stderr)
    pip = [str(BIN / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-e", f"{ROOT}[{extra}]" if extra else str(ROOT)], check=True)
    digest, *extras = STAMP.read_text().split() if installed(None) else [pyproject_digest()]
    STAMP.write_text(" ".join([digest, *extras, *([extra] if extra else [])]))


def installed(extra: str | None) -> bool:
    """Whether .venv holds the project as this pyproject.toml makes it (with ``extra``)."""
    stamp = STAMP.read_text().split() if STAMP.exists() else []
    return stamp[:1] == [pyproject_digest()] and (extra is None or extra in stamp[1:])


def pyproject_digest() -> str:
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()


def extra_requirements(extra: str) -> list[str]:
    """The requirements pyproject.toml lists for ``extra``."""
    import tomllib  # 3.11's: not at the top, so that an older Python gets ensure_venv's word

    with open(ROOT / "pyproject.toml", "rb") as f:
        listed: list[str] = tomllib.load(f)["project"]["optional-dependencies"][extra]
    return listed


def ensure_native() -> bool:
    """Build the compiled data plane unless it is built from the sources as they are.

    True if it is (then the gateway runs it); False if the build failed, with the reason.
    """
    if native_status().startswith("compiled"):
        return True
    print("dev.py: compiling the data plane with mypyc (a few minutes)", file=sys.stderr)
    # Without the profile-guided second compilation (a few % of CPU a request, twice the
    # build's time): the edit-and-test loop rebuilds often. Images and installs train it.
    build = [str(BIN / "gateway"), "native", "build", "--no-profile"]
    if subprocess.call(build, cwd=ROOT, env=native_env("")) == 0:
        return True
    print("dev.py: the pure Python data plane runs instead", file=sys.stderr)
    return False


def native_status() -> str:
    """``gateway native status``: which modules a gateway starting now would run."""
    status = [str(BIN / "gateway"), "native", "status"]
    done = subprocess.run(status, capture_output=True, text=True, env=native_env(""))
    return done.stdout.strip() or done.stderr.strip()


def build_in_background() -> None:
    """Compile the data plane in a process of its own, at the lowest CPU priority, for the
    next start: it outlives this one (and the gateway it becomes). It installs the native
    extra first if .venv lacks it (``serve`` does not wait for that either)."""
    BUILD_LOG.parent.mkdir(parents=True, exist_ok=True)
    steps = [[str(BIN / "gateway"), "native", "build", "--no-profile"]]
    if not installed("native"):
        pip = [str(BIN / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        steps.insert(0, [*pip, *extra_requirements("native")])
    detach(steps, BUILD_LOG)
    log = BUILD_LOG.relative_to(ROOT)
    print(
        f"dev.py: the pure Python data plane runs; the compiled one is being built in the"
        f" background for the next start (a few minutes, lowest CPU priority, {log})",
        file=sys.stderr,
    )


def detach(steps: list[list[str]], log: Path) -> None:
    """Run ``steps`` one after the other (until one fails) in ROOT, niced to 19, in a
    session of its own (no terminal's Ctrl-C or hangup reaches them), their output appended
    to ``log`` after a header line with the pid of the process that runs them (and execs
    the last one).

    Through a child that exits at once: that process is then init's, not this pid's, so
    the gateway this pid becomes never has it as a child to reap or to stop."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    code = 1
    try:
        os.setsid()
        os.nice(19)
        if os.fork() == 0:
            _run_steps(steps, log)
        code = 0
    finally:
        os._exit(code)


def _run_steps(steps: list[list[str]], log: Path) -> None:
    try:
        out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        stamp = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        commands = " && ".join(" ".join(step) for step in steps)
        os.write(1, f"dev.py, {stamp}: pid {os.getpid()}: {commands}\n".encode())
        env = native_env("")
        for step in steps[:-1]:
            if subprocess.call(step, cwd=ROOT, env=env) != 0:
                return
        os.chdir(ROOT)
        os.execve(steps[-1][0], steps[-1], env)
    finally:
        os._exit(1)


def say_when_serving(gateway: int, service: str, url: str) -> None:
    """Once ``service`` (its admin API URL) has a ready replica and ``url`` answers 200, print
    it, to try. A grandchild of this pid does it, so the gateway never reaps it; it gives up
    with the gateway, or after ``DEMO_WAIT``."""
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        return
    try:
        if os.fork() == 0:
            wait_and_say(gateway, service, url)
    finally:
        os._exit(0)


def wait_and_say(gateway: int, service: str, url: str, wait: float = DEMO_WAIT) -> bool:
    """Poll ``service`` until it has a ready replica, then ``url`` until it answers 200: then
    print the line to try (True). False if the pid ``gateway`` ends or ``wait`` passes."""
    asked = urllib.request.Request(service)
    if token := os.environ.get("GATEWAY_ADMIN_TOKEN"):
        asked.add_header("Authorization", f"Bearer {token}")
    local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(gateway, 0)
        except ProcessLookupError:
            return False
        try:  # the admin API first: polling the route would log a 503 a poll
            with local.open(asked, timeout=2) as answer:
                ready = json.load(answer).get("ready", 0) >= 1
            if ready:
                with local.open(f"http://{url}", timeout=2) as answer:
                    answer.read()  # the whole answer: a request cut short logs as cancelled
                    if answer.status == 200:
                        name = service.rstrip("/").rpartition("/")[2]
                        print(f"dev.py: {name} is serving, try: curl {url}", file=sys.stderr)
                        return True
        except (OSError, ValueError):
            pass
        time.sleep(0.25)
    return False


def native_env(value: str) -> dict[str, str]:
    """This environment with GATEWAY_NATIVE set (gateway/native.py: "0", "1" or unset "")."""
    return {**os.environ, "GATEWAY_NATIVE": value}


def run(argv: list[str], env: dict[str, str] | None = None) -> int:
    return subprocess.call(argv, cwd=ROOT, env=env)


def become(argv: list[str]) -> int:
    """Replace this process with ``argv`` run in ROOT, so signals sent to this pid reach it.

    A child would not get them: a supervisor's SIGTERM would end this script and leave the
    gateway and its replicas running, orphaned. Where there is no exec (Windows), run it.
    """
    if os.name != "posix":
        return run(argv)
    os.chdir(ROOT)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


ETCD_MEMBERS = (("e1", 2379, 2380), ("e2", 22379, 22380), ("e3", 32379, 32380))


def cluster() -> int:
    """Three etcd members on 127.0.0.1 and three gateway nodes on 127.0.0.2, .3 and .4 (the
    configs in configs/cluster/), until Ctrl-C; then the nodes stop, then etcd. Logs and etcd's
    data are in state/cluster/."""
    etcd = shutil.which("etcd")
    if etcd is None:
        print(
            "dev.py: etcd is not installed (Debian: apt-get install etcd-server)", file=sys.stderr
        )
        return 2
    ensure_venv("native")
    env = None if os.environ.get("GATEWAY_NATIVE") == "0" or ensure_native() else native_env("0")
    state = ROOT / "state" / "cluster"
    state.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM stops the cluster as Ctrl-C does
    initial = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, _, peer in ETCD_MEMBERS)
    members: list[subprocess.Popen[bytes]] = []
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        for name, client, peer in ETCD_MEMBERS:
            data = state / f"{name}.etcd"
            fresh = not data.exists()
            with open(state / f"{name}.log", "ab") as log:
                members.append(
                    subprocess.Popen(
                        [etcd, "--name", name, "--data-dir", str(data),
                         "--listen-client-urls", f"http://127.0.0.1:{client}",
                         "--advertise-client-urls", f"http://127.0.0.1:{client}",
                         "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                         "--initial-cluster", initial, "--initial-cluster-token", "gateway-demo",
                         "--initial-cluster-state", "new" if fresh else "existing"],
                        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    )
                )  # fmt: skip
        for i in (1, 2, 3):
            with open(state / f"n{i}.log", "ab") as log:
                nodes.append(
                    subprocess.Popen(
                        [str(BIN / "gateway"), "serve", "-c", f"configs/cluster/node{i}.yaml"],
                        cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )  # fmt: skip
        print(
            "dev.py: etcd on 127.0.0.1:2379, 22379, 32379; gateway nodes n1, n2, n3 on"
            " 127.0.0.2, .3, .4 (traffic :8080, admin :8081); logs in state/cluster/.\n"
            "  curl http://127.0.0.3:8080/hello/       any node serves\n"
            "  .venv/bin/gateway status --admin http://127.0.0.4:8081   the nodes, who leads\n"
            "Ctrl-C stops the nodes, then etcd.",
            file=sys.stderr,
        )
        for process in nodes:
            process.wait()
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        for group in (nodes, members):
            for process in group:
                if process.poll() is None:
                    process.terminate()
            for process in group:
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()


def main() -> int:
    task, *rest = sys.argv[1:] or ["help"]
    if task == "serve":
        ensure_venv(None)
        # "0" runs the pure modules: no build. A build under way (an earlier start's) is
        # waited for by the new one, which then builds nothing more.
        posix = os.name == "posix"  # elsewhere no fork: build first, as ``test`` does
        if os.environ.get("GATEWAY_NATIVE") != "0" and not native_status().startswith("compiled"):
            if posix:
                build_in_background()
            else:
                ensure_native()
        if posix and not any(arg.startswith(("-c", "--config")) for arg in rest):
            say_when_serving(os.getpid(), DEMO_SERVICE, DEMO_URL)
        return become([str(BIN / "gateway"), "serve", "-c", "configs/gateway.yaml", *rest])
    if task == "cluster":
        return cluster()
    if task == "test":
        ensure_venv("test")
        for step in (
            [str(BIN / "ruff"), "check", "."],
            [str(BIN / "ruff"), "format", "--check", "."],
            [str(BIN / "mypy")],
            [str(BIN / "lint-imports")],
        ):
            if code := run(step):
                return code
        # The suite tests the modules the gateway runs: compiled where they can be built
        # (GATEWAY_NATIVE=1 makes a stale build an error, not a silent fall-back). Then the
        # data plane's own tests run again on the pure modules, which run where no compiler
        # is (skipped when pytest arguments pick what to run).
        pytest = [str(BIN / "python"), "-m", "pytest"]
        # The suite names its slowest tests: without its slow tier (tests marked ``slow``) it
        # is to stay under 6 minutes on 2 cores; ``--slow`` runs that tier alone (.ci/run runs
        # it after the suite), ``--all`` both.
        tier = rest[0] if rest[:1] in (["--all"], ["--slow"]) else None
        rest = rest[1:] if tier else rest
        marker = {None: ["-m", "not slow"], "--all": [], "--slow": ["-m", "slow"]}[tier]
        # Most of an end-to-end test is waiting (probes, drains, processes starting), so the
        # suite runs in as many processes as there are CPUs, up to four (pytest-xdist), a
        # module to a process (its fixtures, an etcd member for one, start once). The slow
        # tier, clusters of processes each, runs alone: its measurements want the machine.
        spread = [] if tier == "--slow" else [*PARALLEL]
        picked = rest or ["--durations=20", *spread, *marker]
        if not ensure_native():
            return run([*pytest, *picked], env=native_env("0"))
        if code := run([*pytest, *picked], env=native_env("1")):
            return code
        if rest or tier == "--slow":
            return 0
        print("dev.py: the data plane's tests again, on its pure Python modules", file=sys.stderr)
        return run([*pytest, *PARALLEL, "tests/gateway"], env=native_env("0"))
    print(__doc__)
    return 0 if task == "help" else 2


if __name__ == "__main__":
    sys.exit(main())
