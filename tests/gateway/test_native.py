"""The compiled data plane (gateway/native.py): used only when built from the sources as they
are, and, when the suite runs with GATEWAY_NATIVE=1 (``dev.py test``), what is tested."""

from __future__ import annotations

import ctypes
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gateway import native


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    """A copy of the package's sources, as ``native`` sees its own package."""
    copy = tmp_path / "gateway"
    shutil.copytree(native.PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "_native"))
    build = copy / "_native" / native.TAG
    monkeypatch.setattr(native, "PACKAGE", copy)
    monkeypatch.setattr(native, "NATIVE", build)
    monkeypatch.setattr(native, "MANIFEST", build / "manifest.json")
    monkeypatch.delenv(native.ENV, raising=False)
    return copy


def built(package: Path, digest: str) -> None:
    """What ``build`` leaves: the manifest of the sources compiled (no compiler run here)."""
    native.NATIVE.mkdir(parents=True)
    native.MANIFEST.write_text(json.dumps({"digest": digest, "modules": list(native.MODULES)}))


def test_a_build_of_these_sources_goes_first_on_the_package_path(package):
    built(package, native.digest(package))
    path = [str(package)]
    assert native.check() is None
    assert native.use(path)
    assert path == [str(native.NATIVE), str(package)]
    assert native.running.startswith("compiled (mypyc): ")


def test_any_source_changed_since_the_build_runs_the_pure_modules(package):
    built(package, native.digest(package))
    config = package / "config.py"  # not even a compiled module: their types may depend on it
    config.write_text(config.read_text() + "\n# edited\n")
    path = [str(package)]
    assert not native.use(path)
    assert path == [str(package)]
    assert native.running == (
        "pure Python: the sources changed since the build (gateway native build)"
    )


def test_no_build_runs_the_pure_modules_and_says_how_to_build(package):
    path = [str(package)]
    assert not native.use(path)
    assert path == [str(package)]
    assert native.status() == "pure Python: not built (gateway native build)"


def test_gateway_native_0_runs_the_pure_modules_whatever_was_built(package, monkeypatch):
    built(package, native.digest(package))
    monkeypatch.setenv(native.ENV, "0")
    path = [str(package)]
    assert not native.use(path)
    assert path == [str(package)]
    assert native.status() == "pure Python: GATEWAY_NATIVE=0"


def test_gateway_native_1_makes_a_stale_build_an_error(package, monkeypatch):
    built(package, "0" * 64)
    monkeypatch.setenv(native.ENV, "1")
    with pytest.raises(ImportError, match=r"GATEWAY_NATIVE=1 but .* sources changed"):
        native.use([str(package)])


def test_a_worker_takes_the_digest_it_is_handed_if_made_of_its_own_package(package, monkeypatch):
    """A worker's supervisor hands it ``sources()`` (``python -m gateway.workers FD SOURCES``):
    the worker compares that with the build instead of reading and hashing the sources itself,
    and so imports no hashlib; a digest made of another directory is not taken."""
    built(package, native.digest(package))
    handed = native.sources()
    assert handed == f"{native.digest(package)} {package}"
    digest = native.digest
    made: list[Path | None] = []
    monkeypatch.setattr(native, "digest", lambda root=None: made.append(root) or digest(root))
    assert native.check(handed) is None
    stale = f"{'0' * 64} {package}"
    assert native.check(stale) == "the sources changed since the build (gateway native build)"
    path = [str(package)]
    assert not native.use(path, sources=stale)
    assert made == []
    assert native.check(f"{'0' * 64} {package.parent / 'elsewhere'}") is None
    assert made == [None]


def test_nothing_is_handed_to_a_worker_that_would_not_compare_it(package, monkeypatch):
    assert native.sources() is None  # not built
    built(package, native.digest(package))
    monkeypatch.setenv(native.ENV, "0")
    assert native.sources() is None


def test_the_digest_covers_names_and_contents(package):
    before = native.digest(package)
    (package / "wire" / "headers.py").rename(package / "wire" / "headers2.py")
    renamed = native.digest(package)
    assert renamed != before
    (package / "wire" / "headers2.py").rename(package / "wire" / "headers.py")
    assert native.digest(package) == before
    (package / "wire" / "headers.py").rename(package / "proxy" / "headers.py")
    assert native.digest(package) != before  # the same file in another subpackage
    (package / "proxy" / "headers.py").rename(package / "wire" / "headers.py")
    (package / "notes.txt").write_text("not a source")
    assert native.digest(package) == before


def test_a_subpackage_puts_its_compiled_modules_first_if_the_package_does(package, monkeypatch):
    """``gateway.proxy`` and ``gateway.wire`` call ``use_in``: their compiled modules are in
    the build's subdirectory of the same name."""
    top = type(sys)("gateway_copy")
    top.__path__ = [str(native.NATIVE), str(package)]
    monkeypatch.setitem(sys.modules, "gateway_copy", top)
    path = [str(package / "proxy")]
    native.use_in(path, "gateway_copy.proxy")
    assert path == [str(native.NATIVE / "proxy"), str(package / "proxy")]
    top.__path__ = [str(package)]
    path = [str(package / "wire")]
    native.use_in(path, "gateway_copy.wire")
    assert path == [str(package / "wire")]


def test_the_build_s_platform_is_sysconfig_s():
    """The tag a build is kept under names the platform as ``sysconfig`` does, though a
    process on Linux (a worker) makes it without importing sysconfig."""
    import sysconfig

    assert native._platform() == sysconfig.get_platform()
    assert native.TAG.endswith(f"-{sysconfig.get_platform()}")


def test_every_compiled_module_exists_and_errors_stays_pure():
    for name in native.MODULES:
        assert (native.PACKAGE / f"{name.replace('.', '/')}.py").is_file(), name
    assert "errors" not in native.MODULES  # subclasses of built-in exceptions (mypyc cannot)
    assert "native" not in native.MODULES  # it decides what is compiled


def test_the_suite_runs_the_modules_it_was_asked_to():
    """Under ``dev.py test`` (GATEWAY_NATIVE=1) every compiled module is the compiled one;
    under GATEWAY_NATIVE=0 every one is the source."""
    wanted = os.environ.get(native.ENV)
    if wanted not in ("0", "1"):
        pytest.skip("GATEWAY_NATIVE is not set: either may run")
    for name in native.MODULES:
        module = importlib.import_module(f"gateway.{name}")
        assert module.__file__ is not None
        compiled = not module.__file__.endswith(".py")
        assert compiled == (wanted == "1"), module.__file__


def test_every_module_of_the_request_path_and_the_wire_is_compiled():
    """A module split off one of them is easily left out of ``MODULES`` (and then runs pure
    under GATEWAY_NATIVE=1 without a word). The WebSocket relay runs only per frame;
    ``wire.upstream_tls`` runs only for a service with
    ``upstream_tls`` (a lookup per request, a context per changed file; its records are
    OpenSSL's work), never on a plain request."""
    interpreted = {
        "proxy.websocket",
        "wire.upstream_tls",
    }
    for sub in ("proxy", "wire"):
        for path in (native.PACKAGE / sub).glob("*.py"):
            name = f"{sub}.{path.stem}"
            if path.stem != "__init__" and name not in interpreted:
                assert name in native.MODULES, name


def test_the_compiled_library_exports_nothing_but_its_init():
    """Built with ``COMPILE_ARGS``: the group's functions are not exported, so that calls
    between them are direct (and small ones inlined) instead of through the PLT."""
    if os.environ.get(native.ENV) != "1":
        pytest.skip("runs on the compiled modules (GATEWAY_NATIVE=1)")
    importlib.import_module("gateway.wire.plainhead")
    group = sys.modules["gateway._native__mypyc"]
    assert group.__file__ is not None
    library = ctypes.CDLL(group.__file__)
    assert hasattr(library, "PyInit__native__mypyc")
    assert not hasattr(library, "CPyInit_gateway___wire___plainhead")
    assert not hasattr(library, "CPyDef_plainhead___answer")


def test_a_training_load_on_modules_not_compiled_is_refused_and_says_why(package):
    """``_train`` runs the load in the build's stage: there, on the sources alone, it finds
    nothing compiled to train, and the build goes on without a profile, saying so."""
    why = native._train(package.parent)
    assert why is not None
    assert why.startswith("the training load failed: ")
    assert "the modules are not compiled: nothing to train" in why


def test_the_second_compilation_starts_from_the_counts_alone(tmp_path):
    """Between the two compilations: objects, libraries and modules of the instrumented one
    go, so that every module is compiled again; its counts (``.gcda``) stay."""
    temp = tmp_path / "build" / "temp.linux-x86_64-cpython-311" / "build" / "gateway"
    (tmp_path / "build" / "lib.linux-x86_64-cpython-311" / "gateway").mkdir(parents=True)
    (tmp_path / "gateway" / "proxy").mkdir(parents=True)
    temp.mkdir(parents=True)
    kept = [
        temp / "__native__native.gcda",
        temp / "__native__native.c",
        tmp_path / "gateway" / "pool.py",
    ]
    gone = [
        temp / "__native__native.o",
        tmp_path / "gateway" / "proxy" / "handler.cpython-311-x86_64-linux-gnu.so",
    ]
    for path in kept + gone:
        path.write_bytes(b"")
    native._clean(tmp_path)
    assert [p.exists() for p in kept] == [True] * len(kept)
    assert [p.exists() for p in gone] == [False] * len(gone)
    assert not (tmp_path / "build" / "lib.linux-x86_64-cpython-311").exists()


@pytest.mark.parametrize(
    ("macros", "why"),
    [
        (("#define __GNUC__ 12", "#define __x86_64__ 1"), None),
        (("#define __GNUC__ 4", "#define __clang__ 1", "#define __clang_major__ 14"), "is not GCC"),
    ],
)
def test_only_gcc_builds_with_a_profile(tmp_path, monkeypatch, macros, why):
    """Clang's profiles need llvm-profdata to merge them: with Clang (or any compiler that is
    not GCC) the modules are compiled once, without a profile. The compiler is told by the
    macros it predefines (Clang defines ``__GNUC__`` too)."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\ncat >/dev/null\n" + "".join(f"echo '{m}'\n" for m in macros))
    cc.chmod(0o755)
    monkeypatch.setenv("CC", f"{cc} -pthread")
    found = native._compiler_why_not()
    if why is None:
        assert found is None
    else:
        assert found is not None
        assert why in found


@pytest.mark.parametrize(("status", "args"), [(0, native.PACKED_RELOCATIONS), (1, ())])
def test_relocations_are_packed_where_the_linker_takes_it(tmp_path, monkeypatch, status, args):
    """A linker that refuses ``-z pack-relative-relocs`` (older binutils, another linker)
    links the library as before: the flag is asked of the compiler with an empty library."""
    cc = tmp_path / "cc"
    cc.write_text(f"#!/bin/sh\ncat >/dev/null\nexit {status}\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", f"{cc} -pthread")
    assert native._link_args() == args


def test_this_machine_s_compiler_is_told_apart():
    """The real compiler answers the question (whichever it is): a ``-dM -E`` it runs."""
    found = native._compiler_why_not()
    assert found is None or "is not GCC" in found


def test_a_build_without_mypyc_says_what_to_install_and_keeps_the_last_build(package, monkeypatch):
    built(package, native.digest(package))
    monkeypatch.setitem(sys.modules, "mypyc", None)  # as in a venv of ``pip install .``
    with pytest.raises(native.BuildError) as refused:
        native.build()
    assert str(refused.value).startswith(f"mypyc not installed in this environment ({sys.prefix})")
    assert "install the project's native extra" in str(refused.value)
    assert native.MANIFEST.exists()  # the last build stays as it was


USE = r"""
import json, os, sys
from gateway import native

native.NATIVE.mkdir(parents=True)  # a build's manifest (no compiled module in it)
native.MANIFEST.write_text(json.dumps({"digest": native.digest(), "modules": []}))
for name in sys.argv[1:]:
    __import__(name)
try:
    used = [native.use(), native.use()]
except ImportError as exc:
    used = [str(exc)]
gateway = sys.modules["gateway"]
wire = sys.modules.get("gateway.wire")
print(json.dumps({
    "used": used,
    "running": native.running,
    "path": [os.path.relpath(p, native.PACKAGE) for p in gateway.__path__],
    "wire": [os.path.relpath(p, native.PACKAGE) for p in wire.__path__] if wire else None,
}))
"""


def use_in_a_copy(tmp_path: Path, *imported_first: str, native_env: str = "") -> dict:
    """``native.use()`` twice in a fresh interpreter that runs a copy of the package with a
    build of its sources, after importing ``imported_first``."""
    shutil.copytree(
        native.PACKAGE,
        tmp_path / "gateway",
        ignore=shutil.ignore_patterns("__pycache__", "_native"),
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), native.ENV: native_env}
    out = subprocess.run(
        [sys.executable, "-c", USE, *imported_first],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result: dict = json.loads(out.stdout)
    return result


BUILD = os.path.join("_native", native.TAG)


def test_use_puts_the_build_first_once(tmp_path):
    seen = use_in_a_copy(tmp_path, "gateway")
    assert seen["used"] == [True, True]
    assert seen["path"] == [BUILD, "."]
    assert seen["running"].startswith("compiled (mypyc): ")


def test_use_after_a_subpackage_was_imported_puts_its_build_first_too(tmp_path):
    seen = use_in_a_copy(tmp_path, "gateway.wire")  # its __init__ imports none of its modules
    assert seen["used"] == [True, True]
    assert seen["wire"] == [os.path.join(BUILD, "wire"), "wire"]


def test_use_after_a_compiled_module_was_imported_runs_the_pure_modules(tmp_path):
    """Not half of them compiled: the pure ``gateway.pool.balancer`` is imported already."""
    seen = use_in_a_copy(tmp_path, "gateway.pool.balancer")
    assert seen["used"] == [False, False]
    assert seen["path"] == ["."]
    assert seen["running"] == "pure Python: gateway.pool.balancer was imported before native.use()"
    seen = use_in_a_copy(tmp_path / "again", "gateway.pool.balancer", native_env="1")
    assert seen["used"] == [
        "GATEWAY_NATIVE=1 but the compiled modules cannot be used: "
        "gateway.pool.balancer was imported before native.use()"
    ]


def hold_the_lock(pid: str) -> int:
    """Hold the build lock as a build under way does (flock is per open file: this process
    can contend with itself); the descriptor, to close to let go."""
    import fcntl

    native.NATIVE.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(native.NATIVE.with_name(native.TAG + native.LOCK_SUFFIX), os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, pid.encode())
    return fd


def test_status_says_a_build_is_under_way_and_by_which_pid(package):
    assert native.building() is None
    fd = hold_the_lock("4242")
    try:
        assert native.building() == 4242
        assert native.status() == (
            "pure Python: not built (gateway native build); a build is under way (pid 4242)"
        )
    finally:
        os.close(fd)
    assert native.building() is None
    assert native.status() == "pure Python: not built (gateway native build)"


class Said(io.StringIO):
    """What is written to stderr, and an event set once ``waiting`` is in it (read as it is
    written: polling ``capsys.readouterr`` lost a write that came between its read and its
    reset, and the test then waited for ever)."""

    def __init__(self) -> None:
        super().__init__()
        self.waiting = threading.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        if "waiting" in self.getvalue():
            self.waiting.set()
        return written


def test_a_build_waits_for_the_one_under_way_and_builds_nothing_it_built(package, monkeypatch):
    """Two builds (a background one and ``gateway native build``, or two ``dev.py serve``
    starts) never write the same directories at once; the second one, once the first built
    these sources, builds nothing."""
    said = Said()
    monkeypatch.setattr(sys, "stderr", said)
    fd = hold_the_lock("4242")
    results: list[str] = []
    second = threading.Thread(target=lambda: results.append(native.build(profile=False)))
    second.start()
    try:
        assert said.waiting.wait(30), "the second build did not wait"
        assert said.getvalue() == "gateway: waiting for the build under way (pid 4242)\n"
        native.NATIVE.mkdir(parents=True)
        manifest = {"digest": native.digest(), "profile": "none: not asked for (--no-profile)"}
        native.MANIFEST.write_text(json.dumps(manifest))
    finally:
        os.close(fd)
        second.join(30)
    assert results == ["none: not asked for (--no-profile)"]
    assert native.status().startswith("compiled (mypyc): ")
