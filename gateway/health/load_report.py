"""A replica's own figures of its load, read from its Prometheus text exposition. PURE.

Only the lines of the few gauges wanted are read (``GAUGES``: vLLM's or SGLang's names); each
is ``name{labels} value [timestamp]``, its labels skipped with their quoting respected. A
gauge with several series (one per engine, per model) is summed, but the cache use, a share,
takes the largest. A figure missing or unreadable makes no report: the pick then counts
in-flight requests alone.
"""

from __future__ import annotations

import math
from typing import Final

from ..config import LoadFormat
from ..pool.inference import ReplicaLoad

GAUGES: Final[dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]]] = {
    # (waiting, running, KV-cache use): the names each figure may go by
    "vllm": (
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),  # V1's name, then V0's
    ),
    "sglang": (("sglang:num_queue_reqs",), ("sglang:num_running_reqs",), ("sglang:token_usage",)),
}


def _value(line: str, at: int) -> float | None:
    """The sample value of ``line`` whose labels (if any) begin at ``at``."""
    if at < len(line) and line[at] == "{":
        quoted = False
        i = at + 1
        while i < len(line):
            c = line[i]
            if quoted:
                if c == "\\":
                    i += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "}":
                break
            i += 1
        else:
            return None
        at = i + 1
    fields = line[at:].split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def figures(text: str, format: LoadFormat) -> tuple[float, float, float] | None:
    """(waiting, running, KV-cache use) from an exposition, or None if one is missing."""
    names = GAUGES[format]
    wanted = {name: k for k, group in enumerate(names) for name in group}
    prefix = format + ":"
    found: list[float | None] = [None, None, None]
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue  # comments, and every other series: most of the text
        k = -1
        end = 0
        for name, index in wanted.items():
            end = len(name)
            if line.startswith(name) and len(line) > end and line[end] in "{ \t":
                k = index
                break
        if k < 0:
            continue
        value = _value(line, end)
        if value is None:
            return None
        old = found[k]
        if old is None:
            found[k] = value
        else:
            found[k] = max(old, value) if k == 2 else old + value
    waiting, running, cache = found
    if waiting is None or running is None or cache is None:
        return None
    return waiting, running, cache


def report(
    text: str, format: LoadFormat, now: float, max_age: float, own: float = 0.0
) -> ReplicaLoad | None:
    """The replica's load as of ``now``, counting until ``now + max_age`` (``own``: the
    gateway's requests in flight on it then); None if the exposition lacks a figure."""
    read = figures(text, format)
    if read is None:
        return None
    waiting, running, cache = read
    return ReplicaLoad(waiting, running, cache, now, now + max_age, own)
