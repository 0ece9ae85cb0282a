"""What the tests share: one ``eventually()`` (``tests.support.eventually``) and the fixtures and
helpers of more than one test directory (free ports, etcd members, an admin API client, stray
replica processes, a test CA). The fixtures in ``fixtures`` are registered for the whole suite
by ``tests/conftest.py``."""
