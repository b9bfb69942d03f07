"""What the open dashboards hear of changes (cluster.notify.dashboard_changed), on the real channel layer."""

from concurrent.futures import ThreadPoolExecutor

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.db import connection, transaction

from cluster import notify
from cluster.events import record

FAMILIES = ("node", "replica", "model", "system", "service", "key")


def heard_by_dashboards(action) -> list[list[str]]:
    """The `families` of every `dashboard.changed` that `action` makes, up to a message of our own sent after."""
    layer = get_channel_layer()

    async def listen() -> list[list[str]]:
        channel = await layer.new_channel()
        await layer.group_add(notify.DASHBOARD_GROUP, channel)
        try:
            await sync_to_async(action, thread_sensitive=False)()
            await layer.send(channel, {"type": "end"})
            heard = []
            while (message := await layer.receive(channel))["type"] != "end":
                heard.append(message["families"])
            return heard
        finally:
            await layer.group_discard(notify.DASHBOARD_GROUP, channel)

    return async_to_sync(listen)()


@pytest.mark.django_db(transaction=True)
def test_changes_in_one_transaction_make_one_message():
    def change():
        with transaction.atomic():
            record("replica.ready", "test", "a")
            record("node.connected", "test", "b")
            record("replica.placed", "test", "c")

    assert heard_by_dashboards(change) == [["node", "replica"]]


@pytest.mark.django_db(transaction=True)
def test_changes_committed_at_once_by_many_threads_are_all_heard_in_fewer_messages():
    # hundreds of agents connecting at once: one message under way per process, the rest gathered into the next
    commits = 8 * 25

    def commit(i: int) -> None:
        try:
            with transaction.atomic():
                record(f"{FAMILIES[i % len(FAMILIES)]}.x", "test", f"change {i}")
        finally:
            connection.close()

    def burst():
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(commit, range(commits)))

    heard = heard_by_dashboards(burst)
    assert {f for families in heard for f in families} == set(FAMILIES)  # none lost
    assert all(families == sorted(set(families)) for families in heard)
    assert 1 <= len(heard) < commits  # ~80 of 200 here: 8 threads committing at once always overlap
    assert not notify._dashboard_sending and not notify._dashboard_waiting  # nothing left behind
