"""Test session set-up: real Redis (REDIS_URL) or the embedded Valkey; real PostgreSQL (DATABASE_URL) or SQLite."""

import os
from pathlib import Path

import pytest

_valkey = None


def pytest_configure(config):
    global _valkey
    if os.environ.get("REDIS_URL"):
        return
    from django.conf import settings

    from llmgw.valkey import EmbeddedValkey, use

    _valkey = EmbeddedValkey(Path(settings.LLMGW_HOME) / "valkey")
    use(_valkey.start())


def pytest_unconfigure(config):
    if _valkey is not None:
        _valkey.stop()
    if os.environ.get("LLMGW_TEST_HOME_IS_TEMPORARY"):
        import shutil

        from django.conf import settings

        shutil.rmtree(settings.LLMGW_HOME, ignore_errors=True)


@pytest.fixture(autouse=True)
def _clean_redis():
    """Each test starts with an empty Redis db: no lock or counter leaks from one test to the next."""
    from cluster.locks import redis_client

    redis_client().flushdb()
    yield
