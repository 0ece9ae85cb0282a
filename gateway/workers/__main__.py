"""A worker process's entry point: ``python -m gateway.workers FD``, as the supervisor starts it.

The compiled data plane first (``gateway.native.use``), if built from these sources, then the
worker (``worker.main``), which imports the data plane.
"""

import sys

from gateway import native

if __name__ == "__main__":
    native.use()
    from gateway.workers.worker import main

    sys.exit(main())
