"""The e2e harness itself: what its fixtures promise the tests that use them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def test_asking_again_for_a_site_leaves_the_served_file_alone(site: Callable[[str], str]) -> None:
    """A site's replicas may be serving it when a test names it again (a bad revision of the
    same site). Rewriting index.html in place would empty it for a moment, and
    ``http.server`` sizes its answer by ``fstat`` before reading: a request in that moment got
    200 with ``Content-Length: 0`` (the flaky empty body in test_failures), or a length of 0
    followed by ``v1`` (a 502: data after ``Connection: close``)."""
    index = Path(site("v1")) / "index.html"
    os.utime(index, ns=(0, 0))  # any write from here on moves the mtime
    before = index.stat()

    assert site("v1") == str(index.parent)

    after = index.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, 0)
    assert index.read_text() == "v1"
