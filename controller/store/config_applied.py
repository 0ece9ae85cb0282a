"""What the gateway config last applied to each service: the digest of the document, so that
start-up applies a config entry again only once its content changed. A record stays with its
service's tombstone: it tells a service deleted through the API apart from a new name."""

from __future__ import annotations

from .database import Database
from .rows import ConfigAppliedRow
from .services import live_service


class ConfigApplied(Database):
    """The ``config_applied`` table."""

    def config_applied(self, service: str) -> ConfigAppliedRow | None:
        """What the gateway config last applied to the service (deleted or not), if ever."""
        with self._read() as conn:
            row = conn.execute(
                "SELECT service, source, digest, applied_at FROM config_applied WHERE service = ?",
                (service,),
            ).fetchone()
        return None if row is None else ConfigAppliedRow(*row)

    def record_config_applied(self, service: str, source: str, digest: str) -> ConfigAppliedRow:
        """Record that the config's document ``digest`` from ``source`` was applied to a live
        service (replacing the previous record)."""
        with self._write() as conn:
            live_service(conn, service)
            row = ConfigAppliedRow(service, source, digest, self._clock())
            conn.execute(
                "INSERT INTO config_applied (service, source, digest, applied_at)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (service) DO UPDATE SET"
                " source = excluded.source, digest = excluded.digest,"
                " applied_at = excluded.applied_at",
                (row.service, row.source, row.digest, row.applied_at),
            )
            return row
