"""What the README shows matches a real run and the code (issue 22).

The Quickstart's rollout is run for real: the demo config's services, then ``gateway apply``
of the README's v2 spec, whose output is compared with the README's sample. The config table
must name every setting of the gateway config, and ``.dockerignore`` must keep the
Quickstart's state, the venv and the repository out of the image.
"""

from __future__ import annotations

import asyncio
import fnmatch
import os
import re
import sys
from pathlib import Path
from typing import Any

import aiohttp
from pydantic import BaseModel

from controller.config import GatewayConfig
from tests.support.eventually import eventually

from .conftest import Gateways

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def readme_block(starting: str) -> list[str]:
    """The lines of the README's fenced block whose first line starts with ``starting``."""
    blocks = re.findall(r"^```\w*\n(.*?)^```", README, re.MULTILINE | re.DOTALL)
    return next(b for b in blocks if b.startswith(starting)).strip().splitlines()


async def test_the_readme_rollout_sample_is_what_a_real_run_prints(
    gateways: Gateways, tmp_path: Path
) -> None:
    services = [str(ROOT / "configs/services/hello.yaml")]
    services.append(str(ROOT / "configs/services/static-demo.yaml"))
    handle = await gateways.start(services=services)
    await eventually(
        lambda: handle.state("hello").observed.serving_revision == 1,
        timeout=15,
        what="hello serving revision 1, as when the Quickstart's curl answers",
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(handle.url + "/hello/") as response:
            answer = await response.json()  # JSON, as the README's curl and hello.py say
    assert answer["message"].startswith("hello from hello-1-")
    assert answer["version"] == "v1"

    # The README's sed, with the working directory made absolute for a file out of configs/.
    source = (ROOT / "configs/services/hello.yaml").read_text()
    assert "VERSION: v1" in source
    v2 = tmp_path / "hello-v2.yaml"
    v2.write_text(
        source.replace("VERSION: v1", "VERSION: v2").replace(
            "working_dir: ../apps", f"working_dir: {ROOT / 'configs/apps'}"
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_ADMIN")}
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "controller.main",
        "apply",
        "-f",
        str(v2),
        "--admin",
        f"http://127.0.0.1:{handle.gateway.admin.port}",
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 30)
    printed = output.decode().strip().splitlines()
    assert process.returncode == 0, printed

    sample = readme_block("hello: revision 1 -> 2")
    assert printed[0] == sample[0]
    assert printed[-1] == sample[-1]
    rollout = re.fullmatch(r"rollout (\d+) complete: .*", sample[-1])
    assert rollout is not None
    for line in sample[1:-1] + printed[1:-1]:
        assert line.startswith(f"rollout {rollout[1]}: revision 1 -> 2, progressing: "), line


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of every setting of a config model, nested models walked."""
    out = []
    for name, info in model.model_fields.items():
        kind: Any = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += leaf_fields(kind, f"{prefix}{name}.")
        else:
            out.append(prefix + name)
    return out


def test_the_readme_config_table_names_every_setting() -> None:
    start = README.index("| gateway config |")
    table = README[start : README.index("\n\n", start)]
    named = set(re.findall(r"`([\w.]+)`", table))
    missing = [
        path
        for path in leaf_fields(GatewayConfig)
        if path not in named and path.rsplit(".", 1)[-1] not in named
    ]
    assert not missing, f"the README's gateway config table does not name {missing}"


def test_dockerignore_keeps_state_venv_and_repository_out_of_the_image() -> None:
    path = ROOT / ".dockerignore"
    assert path.exists()
    patterns = [
        line.strip().rstrip("/")
        for line in path.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(name: str) -> bool:
        return any(fnmatch.fnmatch(name, p) for p in patterns if not p.startswith("!"))

    for name in (
        "configs/state",  # the Quickstart's database and replica logs (state_dir: ./state)
        ".venv",
        ".git",
        "gateway/_native",  # built for the host's Python; the image builds its own
        "gateway/__pycache__",
    ):
        assert ignored(name), f".dockerignore lets {name} into the build context"
    for name in ("gateway", "controller", "configs", "pyproject.toml", "README.md"):
        assert not ignored(name), f".dockerignore keeps out {name}, which the Dockerfile copies"
