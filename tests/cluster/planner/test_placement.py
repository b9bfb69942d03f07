"""Placement on plain data: spread before stacking, then the fullest node that fits; RAM and GPUs."""


from cluster.planner import (
    DRAINING,
    READY,
    STOPPED,
    STOPPING,
    Create,
    Unplaceable,
    plan,
)
from tests.cluster.planner.snapshots import (
    NOW,
    GiB,
    apply,
    creates,
    model,
    node,
    of,
    rep,
    snap,
)

# --- placement ---------------------------------------------------------------------------------------------


def test_places_missing_replicas_and_is_quiet_once_placed():
    s = snap([node(1)], [model(1, replicas=2)])
    actions = plan(s)
    assert creates(actions) == [(1, 1, None), (1, 1, None)]
    assert of(actions, Create)[0].memory_bytes == 4 * GiB
    assert plan(apply(s, actions)) == []


def test_spreads_across_nodes_before_stacking():
    nodes = [node(1, ram=100 * GiB), node(2, ram=10 * GiB), node(3, ram=10 * GiB)]
    actions = plan(snap(nodes, [model(1, replicas=4)]))
    placed = [c[1] for c in creates(actions)]
    assert sorted(placed[:3]) == [1, 2, 3]
    # the fourth stacks on the node with a replica and the least room left after it: n2 or n3 (6 GiB free -> 2)
    assert placed[3] == 2


def test_spread_counts_existing_replicas_of_the_model_only():
    nodes = [node(1, ram=16 * GiB), node(2, ram=64 * GiB)]
    existing = [rep(1, 1, 1), rep(2, 2, 2)]  # n1 holds m1; n2 holds another model
    actions = plan(snap(nodes, [model(1, replicas=2), model(2)], existing))
    assert creates(actions) == [(1, 2, None)]


def test_bin_packs_onto_the_fullest_node_that_fits():
    nodes = [node(1, "a", ram=64 * GiB), node(2, "b", ram=8 * GiB), node(3, "c", ram=5 * GiB),
             node(4, "d", ram=3 * GiB)]
    assert creates(plan(snap(nodes, [model(1)]))) == [(1, 3, None)]


def test_bin_pack_ties_go_by_name():
    nodes = [node(1, "zeta", ram=8 * GiB), node(2, "alpha", ram=8 * GiB)]
    assert creates(plan(snap(nodes, [model(1)]))) == [(1, 2, None)]


def test_counts_memory_of_running_and_stopping_replicas_not_terminal_ones():
    nodes = [node(1, "a", ram=10 * GiB), node(2, "b", ram=12 * GiB)]
    other = model(2, replicas=1, mem=4 * GiB)
    # On a: 4 GiB stopping + 4 GiB draining = 8 used, 2 free: m1 (4 GiB) no longer fits there.
    replicas = [rep(1, 2, 1, STOPPING), rep(2, 2, 1, DRAINING, changed=NOW), rep(3, 2, 1, STOPPED), rep(4, 2, 1, READY)]
    actions = plan(snap(nodes, [model(1), other], replicas, inflight={"r2": 1}))
    assert creates(actions) == [(1, 2, None)]


def test_later_placements_see_earlier_ones():
    nodes = [node(1, "a", ram=6 * GiB), node(2, "b", ram=6 * GiB)]
    actions = plan(snap(nodes, [model(1, "first"), model(2, "second"), model(3, "third")]))
    assert creates(actions) == [(1, 1, None), (2, 2, None)]
    assert of(actions, Unplaceable)[0].model_id == 3


def test_gpu_model_needs_one_gpus_memory_not_the_sum():
    nodes = [node(1, "g", engines=["vllm"], ram=512 * GiB, gpus=[16 * GiB, 16 * GiB])]
    actions = plan(snap(nodes, [model(1, mem=24 * GiB, engine="vllm", gpu=True)]))
    assert creates(actions) == []
    [u] = of(actions, Unplaceable)
    assert u.reason == "needs 24.0 GiB on one GPU; the most free is 16.0 GiB on g GPU 0"
    assert u.replica_id is None and u.memory_bytes == 24 * GiB


def test_gpu_model_goes_to_the_fullest_gpu_that_fits():
    nodes = [node(1, "g", engines=["vllm"], gpus=[80 * GiB, 24 * GiB, 40 * GiB, 24 * GiB])]
    actions = plan(snap(nodes, [model(1, mem=20 * GiB, engine="vllm", gpu=True)]))
    assert creates(actions) == [(1, 1, 1)]


def test_gpu_memory_in_use_is_per_gpu():
    nodes = [node(1, "g", engines=["vllm"], gpus=[24 * GiB, 24 * GiB])]
    existing = [rep(1, 2, 1, READY, mem=20 * GiB, gpu=0)]
    models = [model(1, mem=10 * GiB, engine="vllm", gpu=True), model(2, mem=20 * GiB, engine="vllm", gpu=True)]
    assert creates(plan(snap(nodes, models, existing))) == [(1, 1, 1)]


def test_gpu_replicas_do_not_use_ram_and_cpu_replicas_do_not_use_gpus():
    nodes = [node(1, "g", engines=["vllm", "llama.cpp"], ram=8 * GiB, gpus=[8 * GiB])]
    models = [model(1, "cpu", mem=8 * GiB), model(2, "gpu", mem=8 * GiB, engine="vllm", gpu=True)]
    assert creates(plan(snap(nodes, models))) == [(1, 1, None), (2, 1, 0)]


def test_cpu_model_fits_in_ram():
    nodes = [node(1, "n1", ram=1 * GiB)]
    [u] = of(plan(snap(nodes, [model(1, mem=2 * GiB)])), Unplaceable)
    assert u.reason == "needs 2.0 GiB RAM; the most free is 1.0 GiB on n1"


def test_gpu_engine_without_gpus_is_unplaceable():
    nodes = [node(1, engines=["vllm"])]
    [u] = of(plan(snap(nodes, [model(1, engine="vllm", gpu=True)])), Unplaceable)
    assert u.reason == "no connected, schedulable node with engine vllm has a GPU"


def test_only_connected_schedulable_undrained_nodes_with_the_engine_take_replicas():
    nodes = [
        node(1, "off", connected=False, seen=NOW - 5),
        node(2, "silent", seen=NOW - 100),
        node(3, "cordoned", schedulable=False),
        node(4, "draining", draining=True),
        node(5, "other-engine", engines=["vllm"]),
        node(6, "never", connected=False, seen=None),
        node(7, "good", ram=128 * GiB),
    ]
    actions = plan(snap(nodes, [model(1, replicas=3)]))
    assert {c[1] for c in creates(actions)} == {7}
    assert len(creates(actions)) == 3


def test_allowed_nodes_constrain_placement():
    nodes = [node(1, "a", ram=8 * GiB), node(2, "b", ram=64 * GiB), node(3, "c", ram=5 * GiB)]
    actions = plan(snap(nodes, [model(1, replicas=2, nodes=frozenset({"a", "b"}))]))
    assert creates(actions) == [(1, 1, None), (1, 2, None)]


# --- CPU cores: a node's cores against its engines' threads ----------------------------------------------------


def test_a_thousand_replicas_fit_only_as_many_as_the_cores_hold():
    # the typo that took a cluster down: memory for hundreds, two cores
    s = snap([node(1, ram=1000 * GiB, cpus=2)], [model(1, replicas=1000, mem=1 * GiB, threads=1)])
    actions = plan(s)
    assert len(creates(actions)) == 2
    refused = of(actions, Unplaceable)
    assert len(refused) == 998
    assert refused[0].reason == "needs 1 CPU core (its threads); the most free is 0 of 2 on n1"


def test_threads_count_against_the_cores_left_by_running_replicas():
    nodes = [node(1, ram=64 * GiB, cpus=8), node(2, ram=64 * GiB, cpus=8)]
    running = [rep(1, 2, 1, threads=6), rep(2, 2, 2, threads=4)]  # n1 has 2 cores left, n2 4
    s = snap(nodes, [model(1, replicas=2, threads=4), model(2, replicas=2)], running)
    actions = plan(s)
    assert creates(actions) == [(1, 2, None)]  # n2 only, and once: 4 threads fill it
    assert of(actions, Unplaceable)[0].reason == "needs 4 CPU cores (its threads); the most free is 2 of 8 on n1"


def test_many_replicas_placed_at_once_count_cores_too():
    # more than SHARED_MAX_BATCH: the placer's private lists
    nodes = [node(i, ram=1000 * GiB, cpus=4) for i in (1, 2, 3)]
    actions = plan(snap(nodes, [model(1, replicas=40, mem=GiB, threads=2)]))
    placed = [c[1] for c in creates(actions)]
    assert sorted(placed) == [1, 1, 2, 2, 3, 3]


def test_gpu_engines_count_cores_too():
    nodes = [node(1, engines=("vllm",), gpus=(80 * GiB,), cpus=1)]
    actions = plan(snap(nodes, [model(1, replicas=3, mem=GiB, engine="vllm", gpu=True, threads=1)]))
    assert creates(actions) == [(1, 1, 0)]
    assert of(actions, Unplaceable)[0].reason.startswith("needs 1 CPU core (its threads)")


def test_memory_short_is_said_before_cores():
    s = snap([node(1, ram=2 * GiB, cpus=1)], [model(1, mem=4 * GiB, threads=2)])
    assert of(plan(s), Unplaceable)[0].reason.startswith("needs 4.0 GiB RAM")


def test_a_node_that_did_not_say_its_cores_is_not_counted():
    actions = plan(snap([node(1, ram=64 * GiB)], [model(1, replicas=10, mem=GiB, threads=4)]))
    assert len(creates(actions)) == 10
