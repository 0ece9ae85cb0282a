"""Serving with N worker processes (``gateway serve --workers N``).

supervisor  the controller's side: starts, feeds and restarts the workers
worker      one worker process: a proxy serving the shared port from pool snapshots
ipc         the messages between them, over a socketpair
metrics     their series at scrape time (the main process's: prometheus_client)
__main__    a worker process's entry point (python -m gateway.workers FD)
"""
