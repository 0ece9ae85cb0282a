"""Bytecode instructions the event loop runs per proxied request: a deterministic figure.

    .venv/bin/python bench/instructions.py
    .venv/bin/python bench/instructions.py --top 40

It counts the pure Python data plane (``GATEWAY_NATIVE=0``): compiled code runs no bytecode.
CPU time on this shared machine moves by ±10-20% from run to run; the number of Python
bytecode instructions and Python-level calls a request takes does not. It tracks the CPU
cost of the Python part of the hot path (about 30 ns an instruction here), so a change can be
judged in seconds, before the noisy CPU figures of ``run.py`` confirm it.

It starts the upstream (nginx, as ``run.py`` does, in a fresh temporary directory) and runs
the gateway in this process, as users run it (``targets.gateway_config``: access log, metrics,
an http probe every second, retries). Once the gateway serves, ``wrk -t1 -c4`` runs for
``--seconds`` while ``sys.settrace`` counts opcode events per code object, on the event
loop's thread only (the access log's writer thread is not counted). Requests are counted by
the calls of ``Exchange.record`` (one per request), so the slower traced run does not skew the
figures. Tracing slows the gateway about twenty times: only the counts mean anything.
Everything it starts is stopped by pid, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import subprocess
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

from system import (
    Failure,
)
from targets import run_in_process, until_routable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ["GATEWAY_NATIVE"] = "0"  # bytecode is what is counted: the pure Python modules

from controller.config import load_config  # noqa: E402
from controller.serving import run_gateway  # noqa: E402


class Counts:
    """Opcode events per code object and calls per function name, while installed."""

    def __init__(self) -> None:
        self.opcodes: collections.Counter[CodeType] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def _local(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "opcode":
            self.opcodes[frame.f_code] += 1
        return self._local

    def _global(self, frame: FrameType, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        self.calls[frame.f_code.co_qualname] += 1
        return self._local

    def install(self) -> None:
        sys.settrace(self._global)

    def remove(self) -> None:
        sys.settrace(None)


async def measure(config: Path, port: int, seconds: float, top: int) -> None:
    stop = asyncio.Event()
    counts = Counts()

    async def started(gateway: object) -> None:
        try:
            url = f"http://127.0.0.1:{port}/"
            await until_routable(url)
            wrk = await asyncio.create_subprocess_exec(
                "wrk", "-t1", "-c4", f"-d{seconds:g}", url, stdout=subprocess.DEVNULL
            )
            await asyncio.sleep(0.3)  # every connection open, the pool warm
            counts.install()
            try:
                await wrk.wait()
            finally:
                counts.remove()
        finally:
            stop.set()

    await run_gateway(load_config(config), stop, started=started)
    requests = counts.calls["Exchange.record"]
    if not requests:
        raise Failure("no request was proxied while traced")
    total = sum(counts.opcodes.values())
    calls = sum(counts.calls.values())
    print(f"requests traced: {requests}")
    print(f"bytecode instructions per request: {total / requests:.0f}")
    print(f"Python-level calls per request:    {calls / requests:.1f}")
    for code, n in counts.opcodes.most_common(top):
        where = f"{Path(code.co_filename).name}:{code.co_firstlineno}"
        print(f"  {n / requests:7.1f}  {where:<22} {code.co_qualname}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of traced load (2)")
    p.add_argument("--top", type=int, default=25, help="functions listed, costliest first")
    args = p.parse_args(argv)
    return run_in_process(
        "instructions", lambda config, port: measure(config, port, args.seconds, args.top)
    )


if __name__ == "__main__":
    sys.exit(main())
