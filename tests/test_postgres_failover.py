"""PostgreSQL that fails over: DATABASE_URL naming a primary and its streaming standby (libpq's host list, with
`target_session_attrs=read-write`), on real servers (tests/postgres.py): the primary killed, the standby promoted
(`pg_ctl promote`), and Django's connection finding the new primary with nothing half-done."""

import pytest
from django.db import OperationalError
from django.db.utils import ConnectionHandler

from llmgw.settings import database
from tests.integration.harness import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture
def primary_and_standby():
    from tests.postgres import OwnPostgres

    primary = OwnPostgres(max_connections=20)
    standby = primary.standby()
    yield primary, standby
    standby.close()
    primary.close()


def one(conn, sql: str):
    with conn.cursor() as cursor:
        cursor.execute(sql)
        return cursor.fetchone() if cursor.description else None


def test_a_promoted_standby_is_found_and_a_transaction_cut_off_leaves_nothing_half_done(primary_and_standby,
                                                                                        django_db_blocker):
    with django_db_blocker.unblock():  # connections of this test's own, to servers of its own
        failover(*primary_and_standby)


def failover(primary, standby):
    # the standby first: libpq passes over it while it is read-only
    settings = database(f"postgres://postgres@127.0.0.1:{standby.port},127.0.0.1:{primary.port}/postgres"
                        "?target_session_attrs=read-write&connect_timeout=3")
    assert settings["HOST"] == "127.0.0.1,127.0.0.1" and settings["PORT"] == f"{standby.port},{primary.port}"
    conn = ConnectionHandler({"default": settings})["default"]
    assert one(conn, "SELECT inet_server_port(), pg_is_in_recovery()") == (primary.port, False)
    one(conn, "CREATE TABLE jobs (id serial PRIMARY KEY, what text NOT NULL)")
    one(conn, "INSERT INTO jobs (what) VALUES ('before') RETURNING id")
    reader = ConnectionHandler({"default": database(f"postgres://postgres@127.0.0.1:{standby.port}/postgres")})["default"]

    def replicated() -> bool:
        if not one(reader, "SELECT to_regclass('jobs') IS NOT NULL")[0]:
            return False
        return one(reader, "SELECT count(*) FROM jobs")[0] == 1

    wait_for(replicated, 30, what="the standby to have the row")
    reader.close()

    with pytest.raises(OperationalError):  # cut off by the failover: it fails, it is not half-done
        with conn.cursor() as cursor:
            cursor.execute("BEGIN")
            cursor.execute("INSERT INTO jobs (what) VALUES ('cut off')")
            primary.stop("immediate")  # the primary's machine gone
            cursor.execute("COMMIT")
    standby.promote()
    conn.close_if_unusable_or_obsolete()  # what Django does before each request and task: the dead one goes
    conn.close()
    assert one(conn, "SELECT inet_server_port(), pg_is_in_recovery()") == (standby.port, False)
    assert one(conn, "SELECT array_agg(what ORDER BY id) FROM jobs")[0] == ["before"]
    one(conn, "INSERT INTO jobs (what) VALUES ('after') RETURNING id")
    conn.close()
