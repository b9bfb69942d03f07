"""Settings for the test run: a throw-away LLMGW_HOME; DATABASE_URL and REDIS_URL as the environment gives."""

import os
import tempfile

os.environ.setdefault("LLMGW_HOME", tempfile.mkdtemp(prefix="llmgw-test-"))

from llmgw.settings import *  # noqa: E402,F403

PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast; tests only
