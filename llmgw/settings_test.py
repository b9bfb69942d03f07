"""Settings for the test run: a throw-away LLMGW_HOME; DATABASE_URL and REDIS_URL as the environment gives."""

import os
import tempfile

if "LLMGW_HOME" not in os.environ:
    os.environ["LLMGW_HOME"] = tempfile.mkdtemp(prefix="llmgw-test-")
    os.environ["LLMGW_TEST_HOME_IS_TEMPORARY"] = "1"  # conftest removes it at the end of the run

from llmgw.settings import *  # noqa: E402,F403

LLMGW_CONTROL = False  # the test process is not a control-plane process: it must not register or obey restarts
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; tests only
ALLOWED_HOSTS = [*ALLOWED_HOSTS, "testserver"]  # noqa: F405 (the host Django's test client sends)
