"""The bearer tokens added to services through the admin API: kept by their SHA-256 digest
only, never the token itself, so neither the file nor a backup of it gives a token away.

A token's SHA-256 is enough here: the tokens the gateway makes are 256 random bits, and
tokens a user brings are API keys of the same kind, not passwords a dictionary could guess;
a slow salted hash (bcrypt, scrypt) guards low-entropy secrets and would cost every request
milliseconds, where the data plane looks the digest up in a dict."""

from __future__ import annotations

from controller.errors import Conflict, NotFound

from .database import Database
from .rows import TokenRow
from .services import live_service

TOKEN_COLS = "id, service, digest, label, created_at"


class Tokens(Database):
    """The ``tokens`` table."""

    def tokens(self, service: str) -> list[TokenRow]:
        """The service's tokens in the order they were added (the API shows only ids)."""
        with self._read() as conn:
            rows = conn.execute(
                f"SELECT {TOKEN_COLS} FROM tokens WHERE service = ? ORDER BY rowid",
                (service,),
            ).fetchall()
        return [TokenRow(*row) for row in rows]

    def add_token(self, service: str, token_id: str, digest: str, label: str) -> TokenRow:
        """Keep a token of a live service by its digest; ``Conflict`` if it is there already."""
        with self._write() as conn:
            live_service(conn, service)
            if conn.execute(
                "SELECT 1 FROM tokens WHERE service = ? AND digest = ?", (service, digest)
            ).fetchone():
                raise Conflict(f"service {service!r} has this token already", service=service)
            row = TokenRow(token_id, service, digest, label, self._clock())
            conn.execute(
                f"INSERT INTO tokens ({TOKEN_COLS}) VALUES (?, ?, ?, ?, ?)",
                (row.id, row.service, row.digest, row.label, row.created_at),
            )
            return row

    def revoke_token(self, service: str, token_id: str) -> TokenRow:
        """Forget a token; ``NotFound`` if the service has none by that id."""
        with self._write() as conn:
            row = conn.execute(
                f"SELECT {TOKEN_COLS} FROM tokens WHERE service = ? AND id = ?",
                (service, token_id),
            ).fetchone()
            if row is None:
                raise NotFound(f"service {service!r} has no token {token_id!r}", service=service)
            conn.execute("DELETE FROM tokens WHERE service = ? AND id = ?", (service, token_id))
            return TokenRow(*row)
