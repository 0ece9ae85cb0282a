"""bench/RESULTS.md is shared: run.py writes its head, other benches own marked sections.

A section is the text between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``. Writing one
replaces only it (appending it if absent); ``sections`` returns every marked section so that
run.py can keep them when it rewrites the head.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
_SECTION = re.compile(r"<!-- (\S+):start -->\n.*?<!-- \1:end -->\n?", re.S)


def sections(text: str) -> str:
    """All marked sections of ``text``, in order, each ending with a newline."""
    return "".join(m.group(0).rstrip("\n") + "\n" for m in _SECTION.finditer(text))


def publish(name: str, text: str, path: Path) -> None:
    """Print a benchmark's report and write it as the section ``name`` of ``path``."""
    print(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_section(name, text, path)
    print(f"\n{name}: written to {path}", file=sys.stderr)


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    block = f"<!-- {name}:start -->\n{body.rstrip()}\n<!-- {name}:end -->\n"
    text = path.read_text() if path.exists() else ""
    pattern = re.compile(
        rf"<!-- {re.escape(name)}:start -->\n.*?<!-- {re.escape(name)}:end -->\n?", re.S
    )
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block
    path.write_text(text)


def median(values: list[float | None]) -> float | None:
    """The median of the repetitions that gave a figure (None: none did)."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def figure(value: float | None, digits: int = 0) -> str:
    """A table's cell: thousands separated, ``digits`` decimals, ``-`` for no figure."""
    return "-" if value is None else f"{value:,.{digits}f}"
