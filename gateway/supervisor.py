"""Where ``Supervisor`` was: the worker processes are ``gateway.workers`` now.

Kept for code outside the package that imports it from here (``controller/main.py``,
``tests/e2e/test_workers.py``) until it imports ``from gateway import Supervisor,
WorkerSettings``; then this module goes.
"""

from .workers.supervisor import Supervisor, WorkerSettings

__all__ = ["Supervisor", "WorkerSettings"]
