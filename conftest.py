"""Test session set-up: real Redis (REDIS_URL) or the embedded Valkey; real PostgreSQL (DATABASE_URL) or SQLite,
and for the tests that need PostgreSQL, DATABASE_URL's server or one of the run's own."""

import os
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.workers import worker_index

_valkey = None
_start_process = subprocess.Popen._execute_child  # the run's own servers may start theirs in any test's set-up


def pytest_configure(config):
    global _valkey
    from llmgw.valkey import EmbeddedValkey, use

    if not os.environ.get("PYTEST_XDIST_WORKER") and (getattr(config.option, "numprocesses", None) or 0) > 0:
        return  # the xdist controller: it runs no test; each worker has its Redis

    if os.environ.get("REDIS_URL"):
        # one server for every worker: each its own 8 of its 16 databases (the integration tests' systems use
        # the 3rd to 7th of them, tests/integration/harness.py)
        if worker_index() > 1:
            raise pytest.UsageError("REDIS_URL is one server for at most two workers (-n 2): unset it, and each "
                                    "worker runs an embedded Valkey of its own")
        base = 8 * worker_index()
        os.environ["LLMGW_TEST_REDIS_DB_BASE"] = str(base)
        if base:
            use(urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path=f"/{base}")))
        return
    from django.conf import settings

    _valkey = EmbeddedValkey(Path(settings.LLMGW_HOME) / f"valkey-{worker_index()}")
    use(_valkey.start())


# Integration groups that take longest, started first (the rest follow in the order they are collected).
LONGEST_FIRST = ("system", "tests/integration/test_fleet.py", "tests/integration/test_fuzz.py",
                 "tests/integration/test_on_demand.py", "tests/integration/test_up.py")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """How the suite is shared out among the xdist workers (`--dist loadgroup`; each group runs whole on one
    worker, the next group going to the first worker free):
    - every integration module that uses the session's `system` in one group, so one worker starts it once; each
      other integration module a group of its own (its module's system started once); the longest first;
    - then the unit tests by file: first those in a transaction, then the transactional ones, which empty the
      tables after them (the migrations' rows included), then those without a database. A worker takes groups in
      this order, so none of its tests in a transaction runs after one of its flushes, as pytest-django orders a
      single run.
    """
    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = {}
    for module, tests in by_module.items():
        if any(t.get_closest_marker("integration") for t in tests):
            group = "system" if any("system" in t.fixturenames for t in tests) else module
            rank = LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)
            for t in tests:
                t.add_marker(pytest.mark.xdist_group(group))
                order[id(t)] = (0, rank)
            continue
        for t in tests:
            kind = _database_kind(t)
            t.add_marker(pytest.mark.xdist_group(f"{module}:{kind}"))
            order[id(t)] = (1, ("db", "transactional", "none").index(kind))
    result = yield
    items.sort(key=lambda t: order.get(id(t), (2, 0)))
    return result


def _database_kind(item) -> str:
    """As pytest-django orders tests: in a transaction (`db`), `transactional` (tables emptied after), or `none`."""
    from pytest_django.plugin import validate_django_db

    fixtures = getattr(item, "fixturenames", ())
    marker = item.get_closest_marker("django_db")
    transaction, reset_sequences = validate_django_db(marker)[:2] if marker else (False, False)
    if transaction or reset_sequences or "transactional_db" in fixtures or "live_server" in fixtures:
        return "transactional"
    return "db" if marker or "db" in fixtures else "none"


def pytest_unconfigure(config):
    if _valkey is not None:
        _valkey.stop()
    if os.environ.get("LLMGW_TEST_HOME_IS_TEMPORARY"):
        import shutil

        from django.conf import settings

        shutil.rmtree(settings.LLMGW_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def postgresql_server():
    """A PostgreSQL server's URL for the tests that need one: DATABASE_URL's when it names one, else a server of
    the run's own, started the first time a test asks (a fresh machine has none running) and gone with the run."""
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith(("postgres://", "postgresql://")):
        yield url
        return
    from tests.postgres import OwnPostgres

    refused, subprocess.Popen._execute_child = subprocess.Popen._execute_child, _start_process
    try:
        server = OwnPostgres()
    finally:
        subprocess.Popen._execute_child = refused
    try:
        yield server.url
    finally:
        server.close()


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
