"""The data plane's hot modules compiled with mypyc: an optional build of the same code.

    gateway native build     compile them for this interpreter, guided by a profile
    gateway native build --no-profile    compile them once, in half the time (``dev.py``)
    gateway native status    say whether the compiled or the pure modules run, and why

The modules of the request path (``MODULES``) are plain, fully typed Python; mypyc compiles
them to C extension modules with the same behaviour, which take less than half the CPU a
request (``bench/RESULTS.md``). The build needs the ``native`` extra (mypy, setuptools) and a
C compiler; without them, or before a build, the pure Python modules run, as they always can.

The compiled modules are kept in ``gateway/_native/<interpreter>/`` with a manifest: the
digest of every source file of the package they were built from. ``import gateway`` alone
gives the pure modules: a process that wants the compiled ones calls ``use()`` before it
imports the data plane (the entry points do: ``gateway serve``, a worker process's
``gateway.workers.__main__``, the tests' ``conftest``, the benches that run it in-process).
If the manifest matches the sources as they are now, that directory goes first on the
package's ``__path__``, and each subpackage's ``__init__`` calls ``use_in()`` to put its own
compiled modules first on its ``__path__``, so ``import gateway.proxy.handler`` loads the
compiled module. Any source changed since the build (an edit, a checkout) and the pure
modules run instead: a compiled module is never a stale copy of the code. Nor is a process
run half compiled: a module of ``MODULES`` imported before ``use()`` keeps the whole process
on the pure modules. ``GATEWAY_NATIVE=0`` runs the pure modules whatever was built;
``GATEWAY_NATIVE=1`` makes a missing or stale build (or a late ``use()``) an error (the tests
use it to make sure they test the compiled modules).

One build at a time for an interpreter: a build holds ``<interpreter>.lock`` beside the
builds (with its pid in it) from start to end. A build that finds another under way waits
for it, and does nothing more if that one built what it was to build. A new build replaces
the directory whole, by renames: a process that runs the old one keeps the files it loaded,
and a process started before it was built keeps running the pure modules.

With GCC the build is guided by a profile: the modules are compiled once instrumented
(``-fprofile-generate``), run under a training load on loopback (``native_training``), and
compiled again with the branch counts that load left (``-fprofile-use``), which lay out
and inline the code for the paths a request takes. If the training load fails, or the
compiler is not GCC, the modules are compiled once, without a profile, and the build says
why.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import MutableSequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import subprocess

PACKAGE = Path(__file__).resolve().parent


def _platform() -> str:
    """``sysconfig.get_platform()``: on Linux, made as it makes it (``linux-<machine>``)
    without importing ``sysconfig``, which every worker would hold for this one string."""
    if os.name == "posix" and "_PYTHON_HOST_PLATFORM" not in os.environ:
        sysname, _, _, _, machine = os.uname()
        osname = sysname.lower().replace("/", "")
        if osname.startswith("linux"):
            return f"{osname}-{machine.replace(' ', '_').replace('/', '-')}"
    import sysconfig

    return sysconfig.get_platform()


TAG = f"{sys.implementation.name}-{sys.version.split()[0]}-{_platform()}"
"""The interpreter the modules are compiled for: each has its own build, side by side (a
module compiled for one patch release is not assumed to work with another). Its version as
``platform.python_version()`` writes it (``3.11.7``, ``3.13.0rc1``), read from ``sys.version``:
importing ``platform`` would cost every worker memory (bench/RESULTS.md `code-figures`)."""
NATIVE = PACKAGE / "_native" / TAG
MANIFEST = NATIVE / "manifest.json"
LOCK_SUFFIX = ".lock"
"""``NATIVE`` with this suffix: the lock a build holds (``building``)."""
ENV = "GATEWAY_NATIVE"

MODULES = (
    "observability.accesslog",
    "observability.metrics",
    "observability.status_codes",
    "observability.tally",
    "observability.span_buffer",
    "observability.spans",
    "observability.tracing",
    "pool.balancer",
    "pool.events",
    "pool.hashring",
    "pool.inference",
    "pool.models",
    "pool.outlier",
    "pool.pool",
    "pool.prefixes",
    "pool.service_pool",
    "pool.snapshot",
    "pool.ratelimit",
    "pool.router",
    "pool.upstream",
    "proxy.answers",
    "proxy.chunked_answer",
    "proxy.codec",
    "proxy.connector",
    "proxy.exchange",
    "proxy.guard",
    "proxy.h2_downstream",
    "proxy.h2_stream",
    "proxy.h2_upstream",
    "proxy.http1_downstream",
    "proxy.handler",
    "proxy.limits",
    "proxy.messages",
    "proxy.openai",
    "proxy.parking",
    "proxy.preview",
    "proxy.request",
    "proxy.retry",
    "proxy.routing",
    "proxy.streams",
    "proxy.sticky",
    "proxy.tokens",
    "proxy.upstream_connection",
    "proxy.wheel",
    "tls.handshake",
    "tls.transport",
    "wire.batch",
    "wire.headers",
    "wire.http1",
    "wire.http2",
    "wire.hpack_codec",
    "wire.hpack_tables",
    "wire.h2_session",
    "wire.grpc",
    "wire.chunked",
    "wire.plainhead",
    "wire.splice",
)
"""The modules compiled: every module a proxied request runs code of."""

COMPILE_ARGS = ("-fvisibility=hidden", "-fno-semantic-interposition")
"""The group's functions call each other directly, and small ones are inlined: by default a
shared library's every function may be replaced by another library's of the same name, so
each call between them went through the PLT and none was inlined (``plainhead``'s scanning
helpers among them). Only the modules' ``PyInit_`` functions are exported (PyMODINIT_FUNC):
the modules reach the group's code through a capsule, not by symbol."""

PACKED_RELOCATIONS = ("-Wl,-z,pack-relative-relocs",)
"""Linked with, where the linker takes it (``_link_args``): the library's relative relocations
(its tables of types, methods and attributes point into it, several thousand pointers) as a
packed bitmap (DT_RELR, glibc 2.36, binutils 2.38) instead of 24 bytes each, which the
dynamic loader reads at every start, so each process maps that much less of the file. The code
is the same."""

PROFILE_GENERATE = ("-fprofile-generate",)
"""The first compilation's, and its link's: each branch counted, written at the exit."""

PROFILE_USE = ("-fprofile-use", "-fprofile-partial-training", "-Wno-missing-profile")
"""The second's: code the training load never ran is optimized as without a profile
(``-fprofile-partial-training``), not as if it never ran."""

TRAINING_TIMEOUT = 300.0
"""Seconds the training load may take (it takes a few)."""

_BUILD = """
import sys
from setuptools import setup
from mypyc.build import mypycify

compile_args, link_args, modules = sys.argv[1].split(), sys.argv[2].split(), sys.argv[3:]
sys.argv[1:] = ["build_ext", "--inplace", "--quiet"]
extensions = mypycify(
    [f"gateway/{m.replace('.', '/')}.py" for m in modules], group_name="gateway._native"
)
for extension in extensions:
    extension.extra_compile_args += compile_args
    extension.extra_link_args += link_args
setup(name="gateway-native", ext_modules=extensions)
"""
"""Run in a copy of the package: a group name under ``gateway`` puts mypyc's shared
library beside the modules, where the package's ``__path__`` finds it."""


def digest(package: Path | None = None) -> str:
    """The digest of the package's sources: every ``.py`` file, subpackages' too, by path
    and content."""
    import hashlib  # here: a worker whose supervisor gives it the digest loads no digests

    root = package or PACKAGE
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root)
        if name.parts[0] != "_native":
            h.update(name.as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def sources() -> str | None:
    """What a process hands another it starts (a worker's supervisor, its workers) for its
    ``use``: ``digest()`` made now, with the package's directory; None if ``check`` would
    not compare the digest with a build's."""
    if os.environ.get(ENV) == "0" or not MANIFEST.exists():
        return None
    return f"{digest()} {PACKAGE}"


def check(sources: str | None = None) -> str | None:
    """Why the compiled modules cannot be used now (None: they can). ``sources``: what
    ``sources()`` gave the process that started this one just now; its digest stands for
    ``digest()`` if it was made of this package's directory."""
    if os.environ.get(ENV) == "0":
        return f"{ENV}=0"
    try:
        manifest = json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        return "not built (gateway native build)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest: {exc}"
    made, _, where = (sources or "").partition(" ")
    if manifest.get("digest") != (made if made and where == str(PACKAGE) else digest()):
        return "the sources changed since the build (gateway native build)"
    return None


class BuildError(Exception):
    """The compiler failed: the message is the end of its output."""


running = "pure Python: use() was not called"
"""Which modules this process runs, as ``use`` found them (``status`` words)."""


def use(path: MutableSequence[str] | None = None, sources: str | None = None) -> bool:
    """Put the compiled modules first on the package's ``__path__`` (or ``path``) if they
    match the sources; for an entry point, before it imports the data plane. Calling it
    again changes nothing. Returns whether the compiled modules run. ``sources``: as for
    ``check`` (a worker's supervisor passes it: ``gateway.workers.__main__``)."""
    global running
    package = sys.modules[__name__.rpartition(".")[0]]
    if path is None:
        path = package.__path__
    if str(NATIVE) in path:
        return True
    why = check(sources)
    if why is None and path is package.__path__:
        early = [m for m in MODULES if f"{package.__name__}.{m}" in sys.modules]
        if early:
            why = f"{package.__name__}.{early[0]} was imported before native.use()"
    running = _describe(why)
    if why is None:
        path.insert(0, str(NATIVE))
        for sub in sorted({m.rpartition(".")[0] for m in MODULES if "." in m}):
            module = sys.modules.get(f"{package.__name__}.{sub}")
            if module is not None:  # imported already (with none of its compiled modules)
                use_in(module.__path__, module.__name__)
        return True
    if os.environ.get(ENV) == "1":
        raise ImportError(f"{ENV}=1 but the compiled modules cannot be used: {why}")
    return False


def use_in(path: MutableSequence[str], name: str) -> None:
    """For a subpackage's ``__init__`` (``name``: its ``__name__``): its compiled modules
    first on its ``path`` if ``use`` put the package's on the package's."""
    top, _, sub = name.partition(".")
    where = str(NATIVE.joinpath(*sub.split(".")))
    if str(NATIVE) in sys.modules[top].__path__ and where not in path:
        path.insert(0, where)


def status() -> str:
    """Whether a process starting now would run the compiled modules, and if not why (and
    whether a build is under way)."""
    why = check()
    under_way = building() if why is not None else None
    if under_way is None:
        return _describe(why)
    return f"{_describe(why)}; a build is under way ({_pid_words(under_way)})"


def building() -> int | None:
    """The pid of the build under way for this interpreter (0 if it has not written it yet),
    None if there is none."""
    import fcntl

    try:
        fd = os.open(_lock_path(), os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.read(fd, 32).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        return None  # (closing the file lets go of the lock just taken)
    finally:
        os.close(fd)


def _lock_path() -> Path:
    return NATIVE.with_name(NATIVE.name + LOCK_SUFFIX)


def _pid_words(pid: int) -> str:
    return f"pid {pid}" if pid else "pid not known yet"


def _describe(why: str | None) -> str:
    if why is None:
        return f"compiled (mypyc): {', '.join(MODULES)}"
    return f"pure Python: {why}"


def build(profile: bool = True) -> str:
    """Compile ``MODULES`` from a copy of the package; replace this interpreter's build
    (only once the new one is complete). With ``profile``, guided by the training load's
    (twice the compile time). Returns the profile: ``trained``, or ``none:`` and why not.

    Waits for a build under way; if that one built these sources (with a profile, when
    ``profile``), returns its profile without building again."""
    import fcntl
    import importlib.util

    # ``pip install .`` brings neither (the native extra does): say so, not a traceback.
    missing = [name for name in ("mypyc", "setuptools") if importlib.util.find_spec(name) is None]
    if missing:
        raise BuildError(
            f"{' and '.join(missing)} not installed in this environment ({sys.prefix}):"
            " install the project's native extra (pip install 'gateway[native]': mypy at the"
            " version it pins, and setuptools). Without the build, the same modules run as"
            " pure Python."
        )
    NATIVE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_path(), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            under_way = os.read(fd, 32).decode(errors="replace").strip()
            print(
                f"gateway: waiting for the build under way (pid {under_way or 'not known yet'})",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
            done = _built(profile)
            if done is not None:
                return done
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        return _build(profile)
    finally:
        os.close(fd)  # and with it the lock (the file stays: removing it would race)


def _built(profile: bool) -> str | None:
    """The profile of the build there is, if it is of the sources as they are (and was
    trained, if ``profile``); else None."""
    try:
        manifest = json.loads(MANIFEST.read_text())
    except (OSError, ValueError):
        return None
    trained = str(manifest.get("profile", ""))
    if manifest.get("digest") != digest() or (profile and trained != "trained"):
        return None
    return trained


def _build(profile: bool) -> str:
    # Here, not at the top: every process imports this module to choose its modules, and
    # these two (with random, bz2 and lzma under them) cost a worker memory it never uses.
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gateway-native-") as tmp:
        stage = Path(tmp)
        shutil.copytree(
            PACKAGE, stage / "gateway", ignore=shutil.ignore_patterns("__pycache__", "_native")
        )
        built_from = digest(stage / "gateway")  # what is compiled, even if edited meanwhile
        why_not = _compiler_why_not() if profile else "not asked for (--no-profile)"
        link = _link_args()
        if why_not is None:
            why_not = _profiled(stage, link)
        if why_not is not None:
            _compile(stage, COMPILE_ARGS, link)
        new = NATIVE.with_name(TAG + ".new")
        shutil.rmtree(new, ignore_errors=True)
        new.mkdir(parents=True)
        for so in (stage / "gateway").rglob("*.so"):
            into = new / so.relative_to(stage / "gateway")
            into.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(so, into)
        trained = "trained" if why_not is None else f"none: {why_not}"
        manifest = {"digest": built_from, "modules": list(MODULES), "profile": trained}
        (new / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        old = NATIVE.with_name(TAG + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if NATIVE.exists():
            NATIVE.rename(old)
        new.rename(NATIVE)
        shutil.rmtree(old, ignore_errors=True)
    return trained


def _compile(stage: Path, compile_args: tuple[str, ...], link_args: tuple[str, ...] = ()) -> None:
    import subprocess  # the build's alone, as in _build

    done = subprocess.run(
        [sys.executable, "-c", _BUILD, " ".join(compile_args), " ".join(link_args), *MODULES],
        cwd=stage,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise BuildError("\n".join(_last_lines(done, 20)))


def _last_lines(done: subprocess.CompletedProcess[str], n: int) -> list[str]:
    """The last ``n`` lines a command printed, its output then its errors."""
    return (done.stdout + done.stderr).strip().splitlines()[-n:]


def _profiled(stage: Path, link: tuple[str, ...] = ()) -> str | None:
    """Compile instrumented, run the training load, compile again with its counts: None if
    all three went through, else why not (and nothing of it is left in ``stage``)."""
    try:
        _compile(stage, COMPILE_ARGS + PROFILE_GENERATE, PROFILE_GENERATE + link)
    except BuildError as exc:
        _clean(stage)
        return f"the instrumented compilation failed: {str(exc).splitlines()[-1]}"
    why_not = _train(stage)
    _clean(stage)  # the instrumented objects and modules; the counts stay
    if why_not is not None:
        return why_not
    try:
        _compile(stage, COMPILE_ARGS + PROFILE_USE, link)
    except BuildError as exc:  # an older GCC without -fprofile-partial-training, say
        _clean(stage)
        return f"the compilation with the profile failed: {str(exc).splitlines()[-1]}"
    return None


def _link_args() -> tuple[str, ...]:
    """``PACKED_RELOCATIONS`` if the compiler links a shared library with it (an older
    linker, or one without DT_RELR, refuses it), else nothing."""
    import subprocess
    import sysconfig
    import tempfile

    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    with tempfile.TemporaryDirectory(prefix="gateway-link-") as tmp:
        argv = [*cc, "-shared", "-fPIC", *PACKED_RELOCATIONS, "-x", "c", "-", "-o", "probe.so"]
        try:
            done = subprocess.run(argv, input="int x;\n", cwd=tmp, capture_output=True, text=True)
        except OSError:
            return ()
    return PACKED_RELOCATIONS if done.returncode == 0 else ()


def _compiler_why_not() -> str | None:
    """Why the compiler cannot build with a profile (None: it is GCC, it can), from the
    macros it predefines. Clang's profiles take a tool of their own (llvm-profdata) to
    merge: not done here."""
    import subprocess
    import sysconfig

    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()
    try:
        done = subprocess.run(
            [*cc, "-dM", "-E", "-x", "c", "-"], input="", capture_output=True, text=True
        )
    except OSError as exc:
        return f"{cc[0]}: {exc}"
    macros = done.stdout.split()
    if done.returncode != 0 or "__GNUC__" not in macros or "__clang__" in macros:
        return f"the compiler ({' '.join(cc)}) is not GCC"
    return None


def _train(stage: Path) -> str | None:
    """Run the training load on the instrumented modules in ``stage`` (None: it ran, and
    left its counts beside their objects), else why it did not."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != ENV}  # the stage's modules, in place
    try:
        done = subprocess.run(
            [sys.executable, "-m", "gateway.native_training"],
            cwd=stage,
            env=env,
            capture_output=True,
            text=True,
            timeout=TRAINING_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        return f"the training load did not end within {TRAINING_TIMEOUT:.0f} s"
    if done.returncode != 0:
        return "the training load failed: " + " / ".join(_last_lines(done, 3))
    if not any(stage.glob("build/**/*.gcda")):
        return "the training load left no counts"
    return None


def _clean(stage: Path) -> None:
    """Remove the instrumented build (objects, libraries, modules) but its counts
    (``.gcda``), so that the second compilation compiles every module again."""
    import shutil

    for built in stage.glob("build/lib.*"):
        shutil.rmtree(built)
    for path in [*stage.glob("build/**/*.o"), *(stage / "gateway").rglob("*.so")]:
        path.unlink()
