"""Settings for the test run: a throw-away LLMGW_HOME; DATABASE_URL and REDIS_URL as the environment gives."""

import os
import tempfile

_worker = os.environ.get("PYTEST_XDIST_WORKER")  # a pytest-xdist worker: a home of its own, not its controller's
if "LLMGW_HOME" not in os.environ or (_worker and os.environ.get("LLMGW_TEST_HOME_IS_TEMPORARY")):
    os.environ["LLMGW_HOME"] = tempfile.mkdtemp(prefix=f"llmgw-test-{_worker or 'run'}-")
    os.environ["LLMGW_TEST_HOME_IS_TEMPORARY"] = "1"  # conftest removes it at the end of the run

from llmgw.settings import *  # noqa: E402,F403

LLMGW_CONTROL = False  # the test process is not a control-plane process: it must not register or obey restarts
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; tests only
ALLOWED_HOSTS = ALLOWED_HOSTS.with_names("testserver")  # noqa: F405 (the host Django's test client sends)
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":  # noqa: F405
    # A file, as an installation's is, not pytest-django's shared in-memory database: threads writing at once
    # there fail at once with "database table is locked" (shared-cache locks know no busy timeout).
    DATABASES["default"]["TEST"] = {"NAME": str(LLMGW_HOME / "test-db.sqlite3")}  # noqa: F405
