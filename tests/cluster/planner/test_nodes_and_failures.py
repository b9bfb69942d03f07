"""Nodes that go silent or are lost, and a model's back-off after failures, on plain data."""

import math
import time
from dataclasses import replace

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


BACKOFF_NOTE = ("backing off after 3 failures; next try at "
                + time.strftime("%H:%M:%S", time.gmtime(math.ceil(NOW + 42.5))) + " UTC")


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


# --- agents on their way back (a control plane restarted) ------------------------------------------------------


def test_a_replica_waits_for_a_node_heard_from_within_the_lost_grace():
    """`llmgw up` started again: the model's replica cannot be placed until the local agent reconnects a few
    seconds later. It is on its way (the gateway's requests wait for it), not unplaceable (refused at once)."""
    back = [node(1, "a", connected=False, seen=NOW - 5)]
    assert of(plan(snap(back, [model(1)])), Unplaceable) == [
        Unplaceable(1, None, "no node is connected; waiting for node a to reconnect", 4 * GiB, waiting_for_room=True)]
    gone = [node(1, "a", connected=False, seen=NOW - 61)]  # lost: nothing is coming
    assert of(plan(snap(gone, [model(1)], node_lost_grace=60.0)), Unplaceable) == [
        Unplaceable(1, None, "no node is connected", 4 * GiB)]
    # an unplaced replica stops waiting once its node is lost, and waits again when a node is back within the grace
    waiting = rep(1, 1, None, PENDING, reason="no node is connected; waiting for node a to reconnect",
                  waiting_for_room=True)
    assert of(plan(snap(gone, [model(1)], [waiting])), Unplaceable) == [Unplaceable(1, 1, "no node is connected")]
    unplaceable = replace(waiting, reason="no node is connected", waiting_for_room=False)
    assert of(plan(snap(back, [model(1)], [unplaceable])), Unplaceable) == [
        Unplaceable(1, 1, "no node is connected; waiting for node a to reconnect", waiting_for_room=True)]
    assert of(plan(snap(back, [model(1)], [waiting])), Unplaceable) == []  # said already


def test_only_a_node_the_model_could_go_to_is_waited_for():
    def waits(n, m=None) -> list[bool]:
        return [a.waiting_for_room for a in of(plan(snap([n, node(9, "z", connected=False, seen=None)],
                                                          [m or model(1)])), Unplaceable)]

    assert waits(node(1, "a", connected=False, seen=NOW - 5)) == [True]
    assert waits(node(1, "a", connected=False, seen=NOW - 5, engines=("vllm",))) == [False]
    assert waits(node(1, "a", connected=False, seen=NOW - 5, schedulable=False)) == [False]
    assert waits(node(1, "a", connected=False, seen=NOW - 5, draining=True)) == [False]
    assert waits(node(1, "a", connected=False, seen=NOW - 5, ram=2 * GiB)) == [False]
    assert waits(node(1, "a", connected=False, seen=NOW - 5), model(1, nodes=frozenset({"b"}))) == [False]
    assert waits(node(1, "a", connected=False, seen=NOW - 5, cpus=4), model(1, threads=8)) == [False]
    # its memory taken by the replicas it had (they count until it is lost)
    full = snap([node(1, "a", connected=False, seen=NOW - 5, ram=6 * GiB)], [model(1), model(2)], [rep(1, 2, 1)])
    assert of(plan(full), Unplaceable) == [Unplaceable(1, None, "no node is connected", 4 * GiB)]


def test_a_connected_node_without_room_and_one_on_its_way_back():
    nodes = [node(1, "a", ram=2 * GiB), node(2, "b", connected=False, seen=NOW - 10)]
    (unplaceable,) = of(plan(snap(nodes, [model(1)])), Unplaceable)
    assert unplaceable.waiting_for_room
    assert unplaceable.reason == "needs 4.0 GiB RAM; the most free is 2.0 GiB on a; waiting for node b to reconnect"


def test_the_time_no_control_plane_ran_is_not_a_nodes_silence():
    """Stopped for five minutes and started again: the node's agent has the tolerance and the lost grace to
    reconnect, counted from the restart, and what it runs is not failed meanwhile."""
    away = (NOW - 290, NOW - 3)
    replicas = [rep(1, 1, 1, READY)]
    killed = node(1, "a", seen=NOW - 300)  # the control plane was killed: nobody marked the node disconnected
    assert plan(snap([killed], [model(1)], replicas, away=away)) == []
    assert plan(snap([killed], [model(1)], replicas)) == [
        MarkNodeDisconnected(1, "no word from the agent for 300s"), Fail(1, "node a lost"),
        Unplaceable(1, None, "no node is connected", 4 * GiB), SetModelNote(1, "no node is connected")]
    stopped = node(1, "a", connected=False, seen=NOW - 300)  # `llmgw up` stopped: its agent first, its engines
    (unplaceable,) = of(plan(snap([stopped], [model(1)], away=away)), Unplaceable)
    assert unplaceable.waiting_for_room
    later = replace(snap([killed], [model(1)], replicas, away=away), now=NOW + 13)  # 16 s after the restart
    assert plan(later) == [MarkNodeDisconnected(1, "no word from the agent for 26s")]
    # a node already silent past the grace when the control plane went away is lost as it was
    silent_before = node(1, "a", connected=False, seen=NOW - 360)
    assert of(plan(snap([silent_before], [model(1)], replicas, away=away)), Fail) == [Fail(1, "node a lost")]
