"""bench/RESULTS.md: everything after run.py's head is in a marked section, so the next
``bench/run.py`` (which rewrites the head and keeps only the sections) loses no result."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_every_result_after_the_head_is_in_a_section_run_py_keeps() -> None:
    spec = importlib.util.spec_from_file_location("bench_results", BENCH / "results.py")
    assert spec is not None
    assert spec.loader is not None
    results = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(results)
    text = (BENCH / "RESULTS.md").read_text()
    first = re.search(r"^<!-- \S+:start -->$", text, re.M)
    assert first is not None, "no marked section"
    after_head = text[first.start() :]
    kept = results.sections(text)
    assert re.sub(r"\n+", "\n", after_head) == re.sub(r"\n+", "\n", kept), (
        "text after the head outside a <!-- NAME:start --> ... <!-- NAME:end --> section"
    )
