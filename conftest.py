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
        # the xdist controller: it runs no test (each worker has its Redis); it learns the groups from the workers
        import tempfile

        os.environ[GROUPS] = str(Path(tempfile.mkdtemp(prefix="llmgw-test-groups-")) / "groups.json")
        return

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


GROUPS = "LLMGW_TEST_GROUPS"  # the file where the workers tell the controller each test's group


def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`, with the groups pytest_collection_modifyitems makes: xdist 3.8 reads a test's group
    from a suffix it adds to the test's id, which pytest 9 no longer lets it set."""
    if config.getvalue("dist") != "loadgroup":
        return None
    import json

    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:
                self.groups = json.loads(Path(os.environ[GROUPS]).read_text())
            return self.groups.get(nodeid, nodeid)

    scheduler = GroupScheduling(config, log)
    config.option.loadscopereorder = False  # the groups go out in the order the workers collected them in
    return scheduler


# Integration groups that take longest, started first (the rest follow in the order they are collected).
LONGEST_FIRST = ("system", "tests/integration/test_fleet.py", "tests/integration/test_fuzz.py",
                 "tests/integration/test_on_demand.py", "tests/integration/test_up.py")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config, items):
    """How the suite is shared out among the xdist workers (`--dist loadgroup`: each group runs whole on one
    worker, and the next group in this order goes to the first worker free):
    - the tests that use the session's `system` are one group, so one worker starts it once; each other module's
      integration tests one group (the module's system started once); the longest of them first;
    - the other tests by file and by how they use the database: in a transaction (`db`), `transactional` (the
      tables emptied after each, the migrations' rows included), or not at all.
    Every group with a transactional test goes after every group with a test in a transaction, so no worker runs
    a test in a transaction after one of its flushes, as pytest-django orders a single run.
    """
    groups: dict[str, list] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        if item.get_closest_marker("integration") and "system" in item.fixturenames:
            group = "system"
        elif item.get_closest_marker("integration"):
            group = f"{module}:integration"
        else:
            group = f"{module}:{_database_kind(item)}"
        item.add_marker(pytest.mark.xdist_group(group))
        groups.setdefault(group, []).append(item)
    order = {}
    for group, tests in groups.items():
        kinds = {_database_kind(t) for t in tests}
        name = "system" if group == "system" else group.rsplit(":", 1)[0]
        if "transactional" in kinds:
            phase = 2
        elif group.endswith(":integration") or group == "system":
            phase = 0  # integration groups: started early, the longest first
        else:
            phase = 1 if "db" in kinds else 3
        rank = LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)
        for t in tests:
            order[id(t)] = (phase, rank)
    result = yield
    items.sort(key=lambda t: order[id(t)])
    if os.environ.get(GROUPS) and os.environ.get("PYTEST_XDIST_WORKER"):
        import json

        written = Path(f"{os.environ[GROUPS]}.{os.environ['PYTEST_XDIST_WORKER']}")
        written.write_text(json.dumps({t.nodeid: t.get_closest_marker("xdist_group").args[0] for t in items}))
        written.replace(os.environ[GROUPS])  # every worker's the same: the last one stays
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
    if os.environ.get(GROUPS) and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller's groups file
        import shutil

        shutil.rmtree(Path(os.environ[GROUPS]).parent, ignore_errors=True)
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
