"""Automatic certificates: ACME (RFC 8555) orders by HTTP-01, for the hosts of the routes that
ask for them. ``schedule`` decides (pure), ``client`` talks to the CA, ``store`` keeps the
files under ``<state_dir>/acme``, ``manager`` runs the loop."""

from .errors import AcmeError, OrderFailed, StoreError
from .manager import AcmeManager, CertificateStatus

__all__ = ["AcmeError", "AcmeManager", "CertificateStatus", "OrderFailed", "StoreError"]
