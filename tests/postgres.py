"""PostgreSQL servers of the tests' own: what the tests that need PostgreSQL stand on when DATABASE_URL names
none (a fresh machine has neither DATABASE_URL nor a server), and what the fleet's fault matrix restarts.

`OwnPostgres` runs Debian's server programs (bin/setup-debian installs them) on a free port of loopback, as the
`postgres` user when the tests run as root (PostgreSQL refuses root), as the tests' own user otherwise.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ground.ports import free_port


def server_programs() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    return Path(found[-1]).parent if found else None


class OwnPostgres:
    """A PostgreSQL server of the test's own, started at once; `stop`/`start` restart it, `close` removes it."""

    def __init__(self, max_connections: int = 300, standby_of: OwnPostgres | None = None):
        programs = server_programs()
        if programs is None:
            raise RuntimeError("PostgreSQL's server programs are missing (/usr/lib/postgresql/*/bin): "
                               "bin/setup-debian installs them (Debian's postgresql)")
        self.bin = programs
        self.root = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        self.root.chmod(0o755)
        self._as_root = os.geteuid() == 0
        if self._as_root:
            shutil.chown(self.root, "postgres", "postgres")
        self.data = self.root / "data"
        self.port = free_port()
        self.max_connections = max_connections
        if standby_of is None:
            self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        else:
            self._base_backup(standby_of)
        self.start()

    def _base_backup(self, primary: OwnPostgres) -> None:
        """A streaming standby's data: the primary's as it is now, and the primary to follow (-R); the primary's
        checkpoint made at once (its default, spread, waits up to minutes on a server that has been busy)."""
        self._run(str(self.bin / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port), "-U", "postgres",
                  "-D", str(self.data), "-R", "-X", "stream", "--no-sync", "--checkpoint=fast")

    def _run(self, *argv: str) -> None:
        command = ["runuser", "-u", "postgres", "--", *argv] if self._as_root else list(argv)
        done = subprocess.run(command, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.stdout.strip()}")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                   f"-c max_connections={self.max_connections}")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "log"), "-o", options,
                  "-w", "-t", "60", "start")

    def standby(self) -> OwnPostgres:
        """A streaming standby of this server, started (Debian's pg_basebackup -R)."""
        return OwnPostgres(self.max_connections, standby_of=self)

    def rebuild_as_standby_of(self, primary: OwnPostgres) -> None:
        """A server lost (its data gone with it) made again, on its port, as a standby of `primary`."""
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.data, ignore_errors=True)
        self._base_backup(primary)
        self.start()

    def promote(self) -> None:
        """A standby made the primary (`pg_ctl promote`), waiting until it takes writes."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "promote")

    def stop(self, mode: str = "fast") -> None:
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def default_database(settings_dict: dict):
    """Django's `default` database is the one `settings_dict` names, in every thread, until the block ends: each
    thread opens a new connection to it (its connections to the other are kept, unused, and are its again after).
    For the tests that need PostgreSQL in a run whose database is SQLite."""
    from asgiref.local import Local
    from django.contrib.contenttypes.models import ContentType
    from django.db import connections

    saved_local = connections._connections  # type: ignore[attr-defined]  # Django's, private: not in its stubs
    saved_settings = connections.settings["default"]
    made = []
    create = connections.create_connection

    def create_and_keep(alias):
        made.append(create(alias))
        return made[-1]

    connections._connections = Local(connections.thread_critical)  # type: ignore[attr-defined]  # as above
    connections.settings["default"] = settings_dict
    connections.create_connection = create_and_keep  # type: ignore[method-assign]  # this handler's, until the end
    ContentType.objects.clear_cache()
    try:
        yield
    finally:
        del connections.create_connection
        connections._connections = saved_local  # type: ignore[attr-defined]  # as above
        connections.settings["default"] = saved_settings
        ContentType.objects.clear_cache()
        for conn in made:  # some were opened by threads that are gone: closed here, whichever thread this is
            if conn.connection is not None:
                with contextlib.suppress(Exception):
                    conn.connection.close()


def make_test_database(url: str) -> dict:
    """A migrated test database on the PostgreSQL server of `url`, as pytest-django makes the run's own; returns
    Django's settings for it."""
    import dj_database_url
    from django.conf import settings
    from django.db import connections
    from django.db.utils import ConnectionHandler

    configured = ConnectionHandler({"default": dj_database_url.parse(url)}).settings["default"]
    configured["TEST"]["NAME"] = f"test_llmgw_{os.getpid()}"
    name_before = settings.DATABASES["default"]["NAME"]
    try:
        with default_database(configured):
            connections["default"].creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    finally:  # create_test_db names its database in the settings too: they go on naming the run's own
        settings.DATABASES["default"]["NAME"] = name_before
    return configured


def flush_test_database(settings_dict: dict) -> None:
    """Empty every table, as pytest-django does after a transactional test."""
    from django.core.management import call_command

    with default_database(settings_dict):
        call_command("flush", verbosity=0, interactive=False, database="default", reset_sequences=False,
                     allow_cascade=False, inhibit_post_migrate=False)
