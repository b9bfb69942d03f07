"""The planner against a plain reference on random fleets, and the same plan for the same snapshot."""

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.planner import (
    DOWNLOADING,
    DRAINING,
    PENDING,
    READY,
    STARTING,
    STOPPING,
    MarkReplacing,
    plan,
)
from tests.cluster.planner.snapshots import (
    NOW,
    GiB,
    creates,
    model,
    node,
    rep,
    snap,
)

ENGINES = ["llama.cpp", "vllm", "xllamacpp"]
GIBS = lambda *sizes: st.sampled_from([n * GiB for n in sizes])  # noqa: E731
MOSTLY = st.integers(0, 9).map(lambda n: n != 9)  # True nine times in ten, and what a failure shrinks to


@st.composite
def fleets(draw, max_nodes: int = 12, max_models: int = 8, max_replicas: int = 30):
    """A snapshot of a random fleet: nodes connected or silent, schedulable or draining, with RAM and GPUs and one
    or two engines; models of any engine, some allowed on a few nodes only; replicas in every running state. A
    failing one shrinks to the smallest fleet that still fails."""
    nodes = []
    for i in range(1, draw(st.integers(1, max_nodes)) + 1):
        nodes.append(node(
            i, f"n{i:02d}", connected=draw(MOSTLY), seen=NOW - draw(st.sampled_from([1, 30, 100])),
            schedulable=draw(MOSTLY), draining=not draw(MOSTLY),
            engines=draw(st.lists(st.sampled_from(ENGINES), min_size=1, max_size=2, unique=True)),
            ram=draw(GIBS(8, 16, 32)), gpus=draw(st.lists(GIBS(8, 16, 24), max_size=3)),
        ))
    names = [n.name for n in nodes]
    models = []
    for j in range(1, draw(st.integers(1, max_models)) + 1):
        engine = draw(st.sampled_from(ENGINES))
        allowed = frozenset(draw(st.lists(st.sampled_from(names), max_size=3, unique=True))) if not draw(MOSTLY) else frozenset()
        models.append(model(j, f"m{j}", replicas=draw(st.integers(0, 6)), mem=draw(GIBS(2, 4, 6, 10)), engine=engine,
                            gpu=engine == "vllm", nodes=allowed))
    replicas = []
    for k in range(1, draw(st.integers(0, max_replicas)) + 1):
        m, n = draw(st.sampled_from(models)), draw(st.sampled_from(nodes))
        if m.uses_gpu and not n.gpus:
            continue
        gpu = draw(st.integers(0, len(n.gpus) - 1)) if m.uses_gpu else None
        state = draw(st.sampled_from([PENDING, STARTING, READY, READY, DRAINING, STOPPING]))
        replicas.append(rep(k, m.id, n.id, state, mem=m.memory_bytes, gpu=gpu, changed=draw(st.floats(0, NOW))))
    inflight = {r.name: draw(st.integers(0, 1)) for r in replicas}
    return snap(draw(st.permutations(nodes)), draw(st.permutations(models)), draw(st.permutations(replicas)),
                inflight=inflight)


def reference_placements(s, replacing=frozenset()):
    """Where the rules say each Create goes, by looking at every node for every replica: spread first (fewest
    replicas of the model that count, on the node), then the fullest that fits, then the name.

    `replacing`: replicas the planner marks replacing (on draining nodes): they stop counting."""
    silent = {n.id: None if n.last_seen is None else s.now - n.last_seen for n in s.nodes}
    alive = {n.id for n in s.nodes if n.connected and silent[n.id] is not None and silent[n.id] <= s.node_tolerance}
    lost = {i for i, t in silent.items() if i not in alive and (t is None or t > s.node_lost_grace)}
    ram = {n.id: n.memory_bytes for n in s.nodes}
    gpus = {n.id: list(n.gpus) for n in s.nodes}
    held = {}
    counting = {}
    for r in s.replicas:
        if r.node_id in lost:
            continue
        if r.state in (PENDING, DOWNLOADING, STARTING, READY, DRAINING, STOPPING):
            if r.gpu_index is None:
                ram[r.node_id] -= r.memory_bytes
            else:
                gpus[r.node_id][r.gpu_index] -= r.memory_bytes
        if r.state in (PENDING, DOWNLOADING, STARTING, READY) and r.id not in replacing:
            held[(r.model_id, r.node_id)] = held.get((r.model_id, r.node_id), 0) + 1
            counting[r.model_id] = counting.get(r.model_id, 0) + 1
    out = []
    for m in sorted(s.models, key=lambda m: m.name):
        for _ in range(m.replicas - counting.get(m.id, 0)):
            best = None
            for n in s.nodes:
                if n.id not in alive or not n.schedulable or n.draining or m.engine_kind not in n.engines:
                    continue
                if m.nodes and n.name not in m.nodes:
                    continue
                if m.uses_gpu:
                    fits = [(gpus[n.id][i], i) for i in range(len(n.gpus)) if gpus[n.id][i] >= m.memory_bytes]
                    if not fits:
                        continue
                    free, gpu = min(fits)
                else:
                    if ram[n.id] < m.memory_bytes:
                        continue
                    free, gpu = ram[n.id], None
                key = (held.get((m.id, n.id), 0), free - m.memory_bytes, n.name)
                if best is None or key < best[0]:
                    best = (key, n.id, gpu)
            if best is None:
                break
            _, node_id, gpu = best
            if gpu is None:
                ram[node_id] -= m.memory_bytes
            else:
                gpus[node_id][gpu] -= m.memory_bytes
            held[(m.id, node_id)] = held.get((m.id, node_id), 0) + 1
            out.append((m.id, node_id, gpu))
    return out


@settings(max_examples=300, deadline=None)
@given(fleets())
def test_placements_agree_with_a_plain_reference_on_random_fleets(s):
    actions = plan(s)
    marked = {a.replica_id for a in actions if isinstance(a, MarkReplacing)}
    assert creates(actions) == reference_placements(s, marked)


def test_many_replicas_of_one_model_agree_with_the_reference():
    # large batches take another path through the planner; the answer must not change
    rnd = random.Random(7)
    nodes = [node(i, f"n{i:03d}", engines=["vllm", "llama.cpp"], ram=rnd.choice([16, 32, 64]) * GiB,
                  gpus=[rnd.choice([16, 24, 40]) * GiB for _ in range(rnd.randint(1, 4))]) for i in range(1, 80)]
    models = [
        model(1, "cpu", replicas=150, mem=3 * GiB),
        model(2, "gpu", replicas=150, mem=7 * GiB, engine="vllm", gpu=True),
        model(3, "some", replicas=20, mem=5 * GiB, nodes=frozenset(f"n{i:03d}" for i in range(1, 40, 3))),
    ]
    existing = [rep(k, 1, rnd.randint(1, 79), READY, mem=3 * GiB) for k in range(1, 60)]
    s = snap(nodes, models, existing)
    assert creates(plan(s)) == reference_placements(s)


@settings(max_examples=100, deadline=None)
@given(fleets())
def test_same_snapshot_same_plan_whatever_the_order(s):
    first = plan(s)
    assert plan(s) == first
    shuffled = replace(s, nodes=tuple(reversed(s.nodes)), models=tuple(reversed(s.models)),
                       replicas=tuple(reversed(s.replicas)))
    assert plan(shuffled) == first
