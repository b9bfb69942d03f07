"""Test session set-up: real Redis (REDIS_URL) or the embedded Valkey; real PostgreSQL (DATABASE_URL) or SQLite."""

import os
import subprocess
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
    from cluster import throttle
    from cluster.locks import redis_client

    redis_client().flushdb()
    for door in (throttle.LOGIN, throttle.API, throttle.GATEWAY):
        door.forget()  # the doors this process shut: their counts were in the db just flushed
    yield


@pytest.fixture(autouse=True)
def _a_test_that_starts_a_process_is_marked(request, monkeypatch):
    """`-m "not integration"` is the fast set for working: a test that starts a process must say so."""
    if request.node.get_closest_marker("integration"):
        return

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it @pytest.mark.integration")

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
