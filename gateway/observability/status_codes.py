"""Answers counted by their ``code`` label, on the request path.

``code_label`` is the label of one answer: the exact status of an answer the gateway made
itself (a ``GatewayError``'s, or 499 for a client that went away), else the status class.
``StatusCounts`` counts answers by the label to be without working it out per request: a
status is kept as an int and turned into its class at scrape time (``code_counts``).

Invariants:
- The label set is bounded: a status class or the status of a ``GatewayError`` subclass.
- No Prometheus, no lock: only the event loop counts, and a scrape on the same loop reads a
  consistent state (through ``settled``).
"""

from __future__ import annotations

from typing import Final

from mypy_extensions import i64

from ..errors import GatewayError


def _gateway_statuses() -> dict[str, int]:
    """Error code -> status of every answer the gateway makes itself."""
    out: dict[str, int] = {}
    todo: list[type[GatewayError]] = [GatewayError]
    while todo:
        cls = todo.pop()
        out[cls.code] = cls.status
        todo.extend(cls.__subclasses__())
    out["cancelled"] = 499  # the client went away before an answer (proxy.handle)
    return out


_GATEWAY_STATUS: Final = _gateway_statuses()
_CLASS: Final = {1: "1xx", 2: "2xx", 3: "3xx", 4: "4xx", 5: "5xx"}


def code_label(status: int, error: str | None) -> str:
    """The ``code`` label: the exact status of an answer the gateway made, else its class.

    An error code alone does not make the answer the gateway's: a body that broke off after
    the upstream's status line keeps the upstream's status (and so its class).
    """
    if error is not None and _GATEWAY_STATUS.get(error) == status:
        return str(status)
    if status < 100:
        return "500"  # the handler raised before any status: aiohttp answered 500
    return _CLASS.get(status // 100) or str(status)


class StatusCounts:
    """Answers by ``code`` label to be, in order of first appearance."""

    __slots__ = ("_run", "_status", "codes")

    def __init__(self) -> None:
        self.codes: dict[int | str, int] = {}
        """Answers by ``code`` label to be: an int is a status whose label (its class) is
        worked out at scrape time, saving ``on_request`` the work; a str is the exact code of
        an answer the gateway made. In order of first appearance, as the series are shown.
        Read through ``settled``: the run of one status being counted is not in it."""
        self._status: i64 = -1
        self._run: i64 = 0
        """Consecutive answers with status ``_status`` not yet in ``codes``: counted as a
        machine integer (an int past 256 in the dict is an object made at every increment)."""

    def answered(self, status: i64) -> None:
        """One more answer with ``status`` and no gateway error (else ``add``): the hot path."""
        if status == self._status:
            self._run += 1
            return
        codes = self.settled()
        self._status = status
        self._run = 1
        if status not in codes:
            codes[status] = 0  # its place, in order of first appearance

    def add(self, status: int, error: str | None, n: int) -> None:
        """``n`` more answers of one kind, ``error`` the gateway error code if any: the slow
        path, for answers with an error or retries and for the workers' counts."""
        code: int | str = status  # its class, at scrape time (``codes``)
        if error is not None and _GATEWAY_STATUS.get(error) == status:
            code = str(status)
        codes = self.codes
        codes[code] = codes.get(code, 0) + n

    def settled(self) -> dict[int | str, int]:
        """``codes``, with the run being counted in them."""
        run = self._run
        codes = self.codes
        if run:
            status = self._status
            codes[status] = codes.get(status, 0) + run
            self._run = 0
        return codes

    def code_counts(self) -> dict[str, int]:
        """The counts by ``code`` label, each label where its first status appeared."""
        out: dict[str, int] = {}
        for key, count in list(self.settled().items()):
            code = key if isinstance(key, str) else code_label(key, None)
            out[code] = out.get(code, 0) + count
        return out
