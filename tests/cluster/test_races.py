"""Two processes acting at once on PostgreSQL: an agent's report against a reconcile, two adds of one name,
two system restarts at once. Each test makes the interleaving happen for certain: one transaction holds its
rows until the other waits on them (PostgreSQL says so in pg_stat_activity), then commits. On PostgreSQL
whatever the run's database is (`on_postgresql`: the run's own server when DATABASE_URL names none)."""

import threading
import time

import pytest
from django.db import connection, transaction

from cluster import operations, reconciler, reports
from cluster.errors import OperationError
from cluster.models import Event, Model, Replica
from gateway import operations as gateway_operations
from tests.factories import make_agent_node, make_model, make_replica, seed_defaults

S = Replica.State

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _defaults(on_postgresql):
    seed_defaults()  # the transactional flush removed the migrations' profile and engines


def wait_until_someone_waits_on_a_lock(timeout: float = 15.0) -> None:
    """From inside the transaction that holds the rows: until another connection is blocked on a lock."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("nobody waited on the rows this transaction holds")


def holding(work):
    """Run `work` in a transaction in another thread, and commit it only once this thread waits on its rows.
    Returns (start, join): start() runs `work` up to the commit; join() waits for the commit."""
    done_work = threading.Event()
    errors = []

    def run():
        try:
            with transaction.atomic():
                work()
                done_work.set()
                wait_until_someone_waits_on_a_lock()
        except BaseException as exc:  # shown by join()
            errors.append(exc)
            done_work.set()
        finally:
            connection.close()

    thread = threading.Thread(target=run)

    def start():
        thread.start()
        assert done_work.wait(30), "the other transaction did not do its work"
        if errors:
            raise errors[0]

    def join():
        thread.join(30)
        if errors:
            raise errors[0]

    return start, join


@pytest.mark.parametrize(
    "reported, after",
    [
        ("ready", S.STOPPING),  # not `ready` over `stopping`: it would serve on, then fail once the agent stops it
        ("failed", S.STOPPED),  # not `failed` (with a back-off) over `stopping`: a replica told to stop, stopped
    ],
)
def test_a_report_never_overwrites_a_state_the_reconciler_just_wrote(reported, after):
    node = make_agent_node("n1")
    model = make_model("m", replicas=0)  # its one replica is surplus: the reconciler stops it
    replica = make_replica(model, node, S.STARTING)
    start, join = holding(reconciler.reconcile_once)
    start()  # the reconciler has set it stopping and not committed yet
    assert Replica.objects.get(pk=replica.pk).state == S.STARTING  # (what this transaction still sees)
    reports.report(node.pk, [{"name": replica.name, "state": reported}], full=False)  # waits for the commit
    join()
    replica.refresh_from_db()
    assert replica.state == after
    assert Model.objects.get(pk=model.pk).failures == 0


def test_the_reconciler_never_overwrites_a_state_a_report_just_wrote():
    node = make_agent_node("n1")
    model = make_model("m", replicas=0)
    replica = make_replica(model, node, S.STARTING)
    report = lambda: reports.report(node.pk, [{"name": replica.name, "state": "failed", "reason": "crashed"}], False)  # noqa: E731
    start, join = holding(report)
    start()  # the agent's report (failed) is written, not committed
    reconciler.reconcile_once()  # plans Stop from `starting`; waits on the row, then finds it failed
    join()
    replica.refresh_from_db()
    assert (replica.state, replica.reason) == (S.FAILED, "crashed")


@pytest.mark.parametrize(
    "add",
    [
        lambda: operations.add_node("twin", "test"),
        lambda: operations.add_profile("twin", "test"),
        lambda: operations.add_engine("twin", "command", "test", command="{python} -m http.server {port}"),
        lambda: operations.add_user("twin", "viewer", "test"),
        lambda: gateway_operations.create_key("twin", "test"),
    ],
    ids=["node", "profile", "engine", "user", "key"],
)
def test_two_adds_of_one_name_at_once_give_one_row_and_a_one_line_refusal(add):
    before = Event.objects.count()
    start, join = holding(add)
    start()  # the first add has inserted the row and not committed
    with pytest.raises(OperationError, match="already exists"):
        add()  # checks (sees nothing yet), inserts, waits on the first's row, then finds it taken
    join()
    assert Event.objects.count() == before + 1  # one add happened, with its Event


@pytest.mark.parametrize(
    "first, second, refusal",
    [
        (lambda: operations.set_model("a", "test", aliases=["gpt-5-codex"]),
         lambda: operations.set_model("b", "test", aliases=["gpt-5-codex"]), "already model a's"),
        (lambda: operations.set_model("a", "test", aliases=["gpt-5-codex"]),
         lambda: operations.add_model("gpt-5-codex", "test", file="f.gguf", engine="llama.cpp"), "an alias of model a"),
        (lambda: operations.add_model("gpt-5-codex", "test", file="f.gguf", engine="llama.cpp"),
         lambda: operations.set_model("b", "test", aliases=["gpt-5-codex"]), "is the name of a model"),
        (lambda: operations.add_model("c", "test", file="f.gguf", engine="llama.cpp", aliases=["gpt-5-codex"]),
         lambda: operations.add_model("d", "test", file="f.gguf", engine="llama.cpp", aliases=["gpt-5-codex"]),
         "already model c's"),
    ],
    ids=["alias-alias", "alias-then-name", "name-then-alias", "two-adds"],
)
def test_one_name_given_twice_at_once_names_one_model(first, second, refusal):
    """An alias and a model's name taken by two operations at once: the second waits for the first's commit
    (the lock on the settings row), then sees what it took and is refused."""
    from tests.factories import make_file

    make_file(name="f.gguf")
    make_model("a")
    make_model("b")
    start, join = holding(first)
    start()  # the first has checked and written, not committed
    with pytest.raises(OperationError, match=refusal):
        second()
    join()
    names = [n for name, aliases in Model.objects.values_list("name", "aliases") for n in (name, *aliases)]
    assert names.count("gpt-5-codex") == 1, names


def test_the_engine_key_is_made_once_whoever_asks_first():
    from cluster.models import ClusterSettings

    ClusterSettings.objects.filter(pk=1).update(engine_key="")  # a row without a key yet
    made_before = Event.objects.filter(kind="engine_key.created").count()
    keys = []
    start, join = holding(lambda: keys.append(ClusterSettings.load().engine_key))
    start()  # one process has made the key and not committed
    keys.append(ClusterSettings.load().engine_key)  # another asks meanwhile: waits, then takes that key
    join()
    assert keys[0] == keys[1] == ClusterSettings.objects.get().engine_key
    assert Event.objects.filter(kind="engine_key.created").count() == made_before + 1


def test_two_revocations_of_one_key_at_once_revoke_it_once():
    gateway_operations.create_key("twice", "test")
    start, join = holding(lambda: gateway_operations.revoke_key("twice", "test"))
    start()  # one revocation is written and not committed
    with pytest.raises(OperationError, match="already revoked"):
        gateway_operations.revoke_key("twice", "test")  # read it unrevoked, waits on the row, then finds it revoked
    join()
    assert Event.objects.filter(kind="key.revoked", subject="twice").count() == 1


def test_a_node_that_reports_while_the_reconciler_marks_it_silent_stays_connected():
    from datetime import timedelta

    from django.utils import timezone

    from cluster.models import Node

    node = make_agent_node("n1")
    Node.objects.filter(pk=node.pk).update(last_seen=timezone.now() - timedelta(seconds=30))
    start, join = holding(lambda: reports.seen(node.pk))
    start()  # its heartbeat is written and not committed
    reconciler.reconcile_once()  # saw it silent; waits on the row, then finds it seen
    join()
    node.refresh_from_db()
    assert node.connected
    assert not Event.objects.filter(kind="node.disconnected").exists()
