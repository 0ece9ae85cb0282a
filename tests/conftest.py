"""The suite is an entry point of the data plane: the compiled modules, if built from these
sources (``gateway.native.use``), go on the package's path before any test imports them, as
``gateway serve`` and a worker process do (GATEWAY_NATIVE=1, as ``dev.py test`` sets it:
they must be; GATEWAY_NATIVE=0: the pure modules)."""

from gateway import native

native.use()

from tests.support.fixtures import ca, etcd  # noqa: E402, F401 - fixtures, registered by import
