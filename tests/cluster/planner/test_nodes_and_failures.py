"""Nodes that go silent or are lost, and a model's back-off after failures, on plain data."""

import math
import time

from cluster.planner import (
    DRAINING,
    PENDING,
    READY,
    STARTING,
    STOPPING,
    Create,
    Fail,
    MarkNodeDisconnected,
    MarkStopped,
    SetModelNote,
    Unplaceable,
    plan,
)
from tests.cluster.planner.snapshots import (
    NOW,
    GiB,
    creates,
    model,
    node,
    of,
    rep,
    snap,
)

# --- failures and back-off ----------------------------------------------------------------------------------


BACKOFF_NOTE = "backing off after 3 failures; next try at " + time.strftime("%H:%M:%S", time.gmtime(math.ceil(NOW + 42.5))) + " UTC"


def test_no_placement_while_backing_off():
    m = model(1, replicas=2, failures=3, backoff_until=NOW + 42.5)
    actions = plan(snap([node(1)], [m], [rep(1, 1, None, PENDING)]))
    assert actions == [SetModelNote(1, BACKOFF_NOTE)]


def test_back_off_note_not_repeated():
    note = BACKOFF_NOTE
    m = model(1, replicas=2, failures=3, backoff_until=NOW + 42.5, placement_note=note)
    assert plan(snap([node(1)], [m])) == []


def test_placement_after_the_back_off():
    note = "backing off after 3 failures; next try at 00:00:00 UTC"
    m = model(1, replicas=1, failures=3, backoff_until=NOW, placement_note=note)
    assert plan(snap([node(1)], [m])) == [Create(1, 1, None, 4 * GiB), SetModelNote(1, "")]


def test_back_off_does_not_matter_when_nothing_is_missing():
    m = model(1, replicas=1, failures=3, backoff_until=NOW + 100)
    assert plan(snap([node(1)], [m], [rep(1, 1, 1)])) == []


# --- nodes coming and going --------------------------------------------------------------------------------


def test_silent_node_is_marked_disconnected():
    s = snap([node(1, "a", seen=NOW - 20)], [], node_tolerance=15.0)
    assert plan(s) == [MarkNodeDisconnected(1, "no word from the agent for 20s")]
    assert plan(snap([node(1, "a", seen=NOW - 15)], [], node_tolerance=15.0)) == []
    # once marked, not again
    assert plan(snap([node(1, "a", connected=False, seen=NOW - 20)], [])) == []


def test_silent_node_takes_no_new_replica():
    s = snap([node(1, "a", seen=NOW - 20, ram=999 * GiB), node(2, "b")], [model(1)], node_tolerance=15.0)
    actions = plan(s)
    assert actions[0] == MarkNodeDisconnected(1, "no word from the agent for 20s")
    assert creates(actions) == [(1, 2, None)]


def test_replicas_on_a_node_within_the_grace_still_count():
    nodes = [node(1, "a", connected=False, seen=NOW - 30), node(2, "b")]
    replicas = [rep(1, 1, 1, READY), rep(2, 1, 1, STOPPING), rep(3, 1, 1, DRAINING, changed=NOW)]
    s = snap(nodes, [model(1, replicas=1)], replicas, node_lost_grace=60.0, inflight={"r3": 1})
    assert plan(s) == []  # no duplicate placed, nothing failed


def test_replicas_on_a_lost_node_fail_and_are_replaced_elsewhere_at_once():
    nodes = [node(1, "a", seen=NOW - 61), node(2, "b")]
    replicas = [rep(1, 1, 1, READY), rep(2, 2, 1, STOPPING), rep(3, 1, 1, DRAINING, changed=NOW)]
    s = snap(nodes, [model(1, replicas=1), model(2, replicas=0)], replicas, node_tolerance=15.0,
             node_lost_grace=60.0, inflight={"r3": 1})
    actions = plan(s)
    assert actions == [
        MarkNodeDisconnected(1, "no word from the agent for 61s"),
        Fail(1, "node a lost"),
        MarkStopped(2, "node a lost"),
        Fail(3, "node a lost"),
        Create(1, 2, None, 4 * GiB),
    ]


def test_lost_node_frees_no_memory_for_itself_and_takes_nothing():
    nodes = [node(1, "a", connected=False, seen=None)]
    actions = plan(snap(nodes, [model(1)], [rep(1, 1, 1, STARTING)]))
    assert actions[0] == Fail(1, "node a lost")
    assert of(actions, Unplaceable)[0].reason == "no node is connected"
