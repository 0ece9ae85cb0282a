"""The Python that runs the gateway under benchmark, and how it was built.

``--python PATH`` names an interpreter. If the project is already installed for it (a venv's
python, such as the default ``.venv/bin/python``), its ``gateway`` script is used as is.
Otherwise a venv is made with it once, under ``bench/out/venvs/`` (gitignored), and the
project installed into it in editable mode, so the gateway runs this work tree's sources
whichever interpreter runs them. The venv is remade when the interpreter or
``pyproject.toml`` changes.

The gateway's data plane is compiled with mypyc for each interpreter (``gateway native
build``, ``gateway/native.py``) unless already built from these sources; where that fails
(no Python headers for it), that interpreter's gateway runs the pure Python modules and the
report says so. A bench venv gets the test extras, which have the pinned mypy.

Whether an interpreter was built with PGO and LTO is read from ``sysconfig``'s
``CONFIG_ARGS`` (``--enable-optimizations``, ``--with-lto``). Debian builds its python3.X with
both on amd64 through its own rules and keeps the flags out of ``sysconfig`` (Debian bug
#934771), so a Debian-packaged interpreter is recognised by its package changelog instead.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from system import Failure

REPO = Path(__file__).resolve().parent.parent
VENVS = REPO / "bench" / "out" / "venvs"

# Run by the interpreter under test: what it is, how it was built, whether it has the project.
_PROBE = """
import json, os, platform, sys, sysconfig
config = sysconfig.get_config_var("CONFIG_ARGS") or ""
try:
    import controller
    project = os.path.dirname(os.path.dirname(os.path.realpath(controller.__file__)))
except ImportError:
    project = None
print(json.dumps({
    "executable": sys.executable,
    "realpath": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
    "version": platform.python_version(),
    "implementation": platform.python_implementation(),
    "pgo": "--enable-optimizations" in config,
    "lto": "--with-lto" in config,
    "in_venv": sys.prefix != sys.base_prefix,
    "project": project,
}))
"""


@dataclass(frozen=True)
class Interpreter:
    """A Python able to run the gateway: where its ``gateway`` script is and how it was built."""

    python: Path
    """The interpreter that runs the gateway (a venv's python)."""
    base: str
    """The interpreter it comes from (the real path of the venv's base executable)."""
    version: str
    pgo: bool
    lto: bool
    build: str
    """Where the PGO/LTO answer comes from: ``sysconfig`` or ``Debian package``."""
    native: str = ""
    """``gateway native status`` for it: ``compiled (mypyc): ...`` or ``pure Python: why``."""

    @property
    def compiled(self) -> bool:
        return self.native.startswith("compiled")

    @property
    def gateway(self) -> Path:
        return self.python.parent / "gateway"

    @property
    def tag(self) -> str:
        """Short, for a target's name: ``py3.11.2+pgo+lto``."""
        return f"py{self.version}" + ("+pgo" if self.pgo else "") + ("+lto" if self.lto else "")

    @property
    def label(self) -> str:
        """Long, for the report."""
        flags = f"PGO {'on' if self.pgo else 'off'}, LTO {'on' if self.lto else 'off'}"
        return f"Python {self.version} ({self.base}; {flags}, from {self.build}), {self.python}"

    @property
    def plane(self) -> str:
        """Which data plane its gateways run (unless a target asks for the pure one)."""
        if self.compiled:
            return "the data plane compiled with mypyc"
        return f"the pure Python data plane ({self.native or 'status unknown'})"


def _probe(python: Path) -> dict:
    try:
        out = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise Failure(f"--python {python}: cannot run it: {e}") from None
    info: dict = json.loads(out.stdout)
    return info


def _debian_pgo_lto(realpath: str, version: str) -> bool:
    """True if ``realpath`` is Debian's packaged python3.X, whose changelog enables LTO/PGO."""
    minor = ".".join(version.split(".")[:2])
    if realpath != f"/usr/bin/python{minor}":
        return False
    changelog = Path(f"/usr/share/doc/python{minor}/changelog.Debian.gz")
    try:
        text = gzip.decompress(changelog.read_bytes()).decode(errors="replace")
    except OSError:
        return False
    return "Enable LTO/PGO builds" in text


def _make_venv(base: Path, info: dict) -> Path:
    key = hashlib.sha256(
        (info["realpath"] + info["version"]).encode() + (REPO / "pyproject.toml").read_bytes()
    ).hexdigest()[:12]
    venv = VENVS / f"py{info['version']}-{key}"
    stamp = venv / "bench-installed"
    python = venv / "bin" / "python"
    if stamp.exists():
        return python
    print(f"bench: making {venv} with {base} and installing the project", flush=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    steps = [[str(base), "-m", "venv", "--clear", str(venv)], [*pip, "-e", f"{REPO}[test]"]]
    for argv in steps:
        try:
            subprocess.run(argv, check=True, timeout=900, capture_output=True, text=True)
        except subprocess.CalledProcessError as e:
            hint = ""
            if "ensurepip" in e.stdout + e.stderr:
                hint = "\n(on Debian: apt-get install python3-venv)"
            raise Failure(f"{' '.join(argv)} failed:\n{e.stdout}{e.stderr}{hint}") from None
        except subprocess.TimeoutExpired:
            raise Failure(f"{' '.join(argv)} took more than 900 s") from None
    stamp.write_text(json.dumps(info) + "\n")
    return python


def resolve(python: Path) -> Interpreter:
    """``python`` made ready to run this repository's gateway (a venv made if need be)."""
    info = _probe(python)
    if not (info["project"] == str(REPO) and (python.parent / "gateway").exists()):
        python = _make_venv(Path(info["realpath"]), info)  # not a pyenv shim
        venv_info = _probe(python)
        if venv_info["project"] != str(REPO):
            raise Failure(f"{python} runs the project from {venv_info['project']}, not {REPO}")
    else:
        python = Path(os.path.abspath(python))  # a venv's python: keep the link, not its target
    pgo, lto, build = info["pgo"], info["lto"], "sysconfig"
    if not (pgo or lto) and _debian_pgo_lto(info["realpath"], info["version"]):
        pgo, lto, build = True, True, "Debian package"
    native = _native(python.parent / "gateway")
    return Interpreter(python, info["realpath"], info["version"], pgo, lto, build, native)


def _native(gateway: Path) -> str:
    """The compiled data plane for this interpreter, built if need be: its status line."""

    def status() -> str:
        out = subprocess.run(
            [str(gateway), "native", "status"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "GATEWAY_NATIVE": ""},
        )
        return out.stdout.strip() or f"pure Python: status failed: {out.stderr.strip()}"

    current = status()
    if current.startswith("compiled"):
        return current
    print(f"bench: compiling the data plane for {gateway.parent.parent}", flush=True)
    built = subprocess.run(
        [str(gateway), "native", "build"], capture_output=True, text=True, timeout=900
    )
    if built.returncode != 0:
        why = (built.stderr.strip().splitlines() or ["?"])[-1]
        print(f"bench: not compiled, the pure modules run: {why}", flush=True)
    return status()
