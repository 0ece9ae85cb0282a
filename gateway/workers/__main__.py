"""A worker process's entry point: ``python -m gateway.workers FD [SOURCES]``, as the supervisor
starts it.

The compiled data plane first (``gateway.native.use``), if built from these sources (SOURCES:
their digest, which the supervisor made as it started the worker: ``native.sources``), then
the worker (``worker.main``), which imports the data plane.
"""

import sys

from gateway import native

if __name__ == "__main__":
    native.use(sources=sys.argv[2] if len(sys.argv) > 2 else None)
    from gateway.workers.worker import main

    sys.exit(main())
