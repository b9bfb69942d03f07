"""The planner's tests on plain data: builders for nodes, models, replicas and snapshots, and a tiny stand-in
for the reconciler that applies a plan to a snapshot (every placement ready at once)."""

from dataclasses import replace

from cluster.planner import (
    DRAINING,
    FAILED,
    PENDING,
    READY,
    RESTART_REPLACING,
    STOPPED,
    STOPPING,
    Assign,
    Create,
    DeleteModel,
    Drain,
    Evict,
    Fail,
    MarkNodeDisconnected,
    MarkReplacing,
    MarkStopped,
    ModelView,
    NodeView,
    ReplicaView,
    SetModelNote,
    SetNodeNote,
    Snapshot,
    Stop,
    Unplaceable,
    plan,
)

GiB = 1024**3
MiB = 1024**2
NOW = 10_000.0


def node(id, name=None, *, connected=True, seen=NOW - 1, schedulable=True, draining=False, engines=("llama.cpp",),
         ram=64 * GiB, gpus=(), **kw):
    return NodeView(id=id, name=name or f"n{id}", connected=connected, last_seen=seen, schedulable=schedulable,
                    draining=draining, engines=frozenset(engines), memory_bytes=ram, gpus=tuple(gpus), **kw)


def model(id, name=None, *, replicas=1, mem=4 * GiB, engine="llama.cpp", gpu=False, **kw):
    return ModelView(id=id, name=name or f"m{id}", replicas=replicas, memory_bytes=mem, engine_kind=engine,
                     uses_gpu=gpu, **kw)


def rep(id, model_id, node_id, state=READY, *, mem=4 * GiB, gpu=None, changed=0.0, name=None, **kw):
    return ReplicaView(id=id, name=name or f"r{id}", model_id=model_id, node_id=node_id, state=state,
                       memory_bytes=mem, gpu_index=gpu, state_changed_at=changed, **kw)


def snap(nodes=(), models=(), replicas=(), **kw):
    return Snapshot(now=NOW, nodes=tuple(nodes), models=tuple(models), replicas=tuple(replicas), **kw)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def creates(actions):
    return [(a.model_id, a.node_id, a.gpu_index) for a in of(actions, Create)]


def apply(s, actions):
    """A tiny stand-in for the reconciler: the snapshot after the actions, with every placement ready."""
    reps = {r.id: r for r in s.replicas}
    nodes = {n.id: n for n in s.nodes}
    models = {m.id: m for m in s.models}
    next_id = max(reps, default=0) + 1
    for a in actions:
        if isinstance(a, Create):
            reps[next_id] = rep(next_id, a.model_id, a.node_id, READY, mem=a.memory_bytes, gpu=a.gpu_index,
                                changed=s.now)
            next_id += 1
        elif isinstance(a, Unplaceable) and a.replica_id is None:
            reps[next_id] = rep(next_id, a.model_id, None, PENDING, mem=a.memory_bytes, reason=a.reason, changed=s.now,
                                waiting_for_room=a.waiting_for_room)
            next_id += 1
        elif isinstance(a, Unplaceable):
            reps[a.replica_id] = replace(reps[a.replica_id], reason=a.reason, waiting_for_room=a.waiting_for_room)
        elif isinstance(a, Assign):
            reps[a.replica_id] = replace(reps[a.replica_id], node_id=a.node_id, gpu_index=a.gpu_index, state=READY)
        elif isinstance(a, (Drain, Evict)):
            reps[a.replica_id] = replace(reps[a.replica_id], state=DRAINING, state_changed_at=s.now)
            if isinstance(a, Evict):  # its model wants one fewer (cluster.autoscaler.evicted)
                owner = models[reps[a.replica_id].model_id]
                models[owner.id] = replace(owner, replicas=max(owner.scaling.min, owner.replicas - 1))
        elif isinstance(a, Stop):
            r = reps[a.replica_id]
            reps[a.replica_id] = replace(r, state=STOPPING if r.node_id is not None else STOPPED)
        elif isinstance(a, (Fail, MarkStopped)):
            reps[a.replica_id] = replace(reps[a.replica_id], state=FAILED if isinstance(a, Fail) else STOPPED)
        elif isinstance(a, MarkNodeDisconnected):
            nodes[a.node_id] = replace(nodes[a.node_id], connected=False)
        elif isinstance(a, SetModelNote):
            models[a.model_id] = replace(models[a.model_id], placement_note=a.note)
        elif isinstance(a, MarkReplacing):
            reps[a.replica_id] = replace(reps[a.replica_id], restart=RESTART_REPLACING)
        elif isinstance(a, SetNodeNote):
            nodes[a.node_id] = replace(nodes[a.node_id], drain_note=a.note)
        elif isinstance(a, DeleteModel):
            del models[a.model_id]
    live = tuple(r for r in reps.values() if r.state not in (STOPPED, FAILED))
    return replace(s, nodes=tuple(nodes.values()), models=tuple(models.values()), replicas=live)



def step(s):
    """One reconciler run, then the agents: whatever was told to stop has stopped."""
    s = apply(s, plan(s))
    return replace(s, replicas=tuple(r for r in s.replicas if r.state != STOPPING))


def replacing(s, model_id=None):
    return [r for r in s.replicas if r.restart == RESTART_REPLACING and model_id in (None, r.model_id)]


def converge(s, model_ids, runs=40):
    """Step until nothing is left to do; check at every step that a model never has two replicas being
    replaced at once and never has fewer ready, serving replicas than it wants (there is room)."""
    for _ in range(runs):
        if not plan(s):
            return s
        s = step(s)
        for m in s.models:
            assert len(replacing(s, m.id)) <= 1, s.replicas
            if m.id in model_ids:
                serving = [r for r in s.replicas if r.model_id == m.id and r.state == READY]
                assert len(serving) >= m.replicas, s.replicas
    raise AssertionError("did not converge")
