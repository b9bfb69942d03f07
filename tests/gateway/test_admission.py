"""Admission (gateway/admission.py) on real Redis: slots shared by every process, the queue's order (class, least
attained service between keys, first come within a key), its bounds, and nothing leaked by a waiter that gives up
or a process that dies."""

import asyncio
import secrets
import time

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from django.conf import settings

from gateway import admission
from gateway.admission import Admission
from gateway.errors import GatewayError

pytestmark = pytest.mark.asyncio

INTERACTIVE, STANDARD, BATCH = (admission.RANK[c] for c in admission.CLASSES)


@pytest_asyncio.fixture
async def processes():
    """Two web processes' admissions on one Redis."""
    clients = [aioredis.Redis.from_url(settings.REDIS_URL) for _ in range(2)]
    made = [Admission(c) for c in clients]
    yield made
    for a, c in zip(made, clients):
        await a.aclose()
        await c.aclose()


@pytest.fixture
def model():
    return f"m-{secrets.token_hex(4)}"  # no other test's queue


def replicas(*caps: int, model: str = ""):
    names = [(f"{model}-r{i}", cap) for i, cap in enumerate(caps)]
    return lambda: names


async def admit(a, model, reps, key="k1", rank=STANDARD, cost=10, prefs=(), limit=100, wait=10.0, on_wait=None):
    return await a.admit(model, reps, key=key, rank=rank, cost=cost, prefs=list(prefs), queue_limit=limit,
                         max_wait=wait, on_wait=on_wait)


def start(a, model, reps, **kw):
    return asyncio.create_task(admit(a, model, reps, **kw))


async def settled(tasks, n: int, timeout: float = 5.0) -> list:
    """The first `n` of `tasks` to finish, in the order they did."""
    done_order: list[asyncio.Task] = []
    pending = set(tasks)
    async with asyncio.timeout(timeout):
        while len(done_order) < n:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            done_order += sorted(done, key=tasks.index)
    return done_order[:n]


async def test_two_processes_never_admit_past_a_replicas_slots(processes, model):
    one, two = processes
    reps = replicas(2, model=model)
    held = [await admit(one, model, reps), await admit(two, model, reps)]
    waiting = [start(one, model, reps), start(two, model, reps)]
    await asyncio.sleep(0.3)
    assert not any(t.done() for t in waiting)
    await one.release(held[0], reps(), 10)
    (first,) = await settled(waiting, 1)
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in waiting) == 1  # one slot freed, one admitted
    await two.release(held[1], reps(), 10)
    await settled(waiting, 2)
    assert {t.result().replica for t in waiting} == {f"{model}-r0"}


async def test_a_quiet_key_goes_before_a_flood_that_queued_first(processes, model):
    one, two = processes
    reps = replicas(1, model=model)
    holding = await admit(one, model, reps, key="flood", cost=1000)
    flood = [start(one, model, reps, key="flood", cost=1000) for _ in range(4)]
    await asyncio.sleep(0.2)
    quiet = start(two, model, reps, key="quiet", cost=10)
    await asyncio.sleep(0.2)
    await one.release(holding, reps(), 1000)
    (first,) = await settled([*flood, quiet], 1)
    assert first is quiet  # the least attained service, though it came last
    await two.release(quiet.result(), reps(), 10)
    (second,) = await settled(flood, 1)
    assert second is flood[0]  # within a key: first come, first served
    for t in flood:
        t.cancel()


async def test_a_higher_class_goes_first_and_a_slot_is_held_back_for_it(processes, model):
    one, two = processes
    reps = replicas(2, model=model)
    # an interactive request was admitted a moment ago and is done
    done = await admit(two, model, reps, key="quiet", rank=INTERACTIVE)
    await two.release(done, reps(), 10)
    batch = [start(one, model, reps, key="batch", rank=BATCH) for _ in range(3)]
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in batch) == 1  # one of the two slots stays free for the interactive class
    quiet = await admit(two, model, reps, key="quiet", rank=INTERACTIVE, wait=0.5)
    assert quiet.replica == f"{model}-r0"
    await two.release(quiet, reps(), 10)
    for t in batch:
        t.cancel()


async def test_a_lower_class_takes_what_a_higher_one_leaves_idle(processes, model):
    one, _ = processes
    reps = replicas(2, model=model)
    both = [await admit(one, model, reps, key="batch", rank=BATCH, wait=0.5) for _ in range(2)]
    assert len(both) == 2  # no interactive request lately: no slot held back


async def test_the_queue_is_bounded_in_length_and_in_time(processes, model):
    one, _ = processes
    reps = replicas(1, model=model)
    await admit(one, model, reps)
    waiting = [start(one, model, reps) for _ in range(2)]
    await asyncio.sleep(0.2)
    with pytest.raises(GatewayError) as full:
        await admit(one, model, reps, limit=2)
    assert (full.value.status, full.value.code, full.value.retry_after) == (429, "queue_full", 2)
    with pytest.raises(GatewayError) as late:
        await admit(one, model, reps, limit=3, wait=0.3)
    assert (late.value.status, late.value.code, late.value.retry_after) == (503, "queue_timeout", 5)
    assert "no free slot for 0.3s" in late.value.message
    for t in waiting:
        t.cancel()


async def test_a_waiter_that_gives_up_leaves_the_queue_and_returns_a_slot_granted_meanwhile(processes, model):
    one, two = processes
    reps = replicas(1, model=model)
    held = await admit(one, model, reps)
    gone = start(two, model, reps, key="gone")
    await asyncio.sleep(0.2)
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert await one.redis.zcard(admission.model_prefix(model) + "c1") == 0  # its class's tickets
    await one.release(held, reps(), 10)
    # the slot is free again: nobody holds it
    again = await admit(one, model, reps, wait=0.5)
    await one.release(again, reps(), 10)


async def test_a_process_that_dies_leaks_no_slot(processes, model, monkeypatch):
    one, two = processes
    monkeypatch.setattr(admission, "LEASE_TTL", 1.0)
    reps = replicas(1, model=model)
    await admit(one, model, reps)  # never released, never renewed (its process is gone)
    one.leases.clear()
    lease = await admit(two, model, reps, wait=3.0)
    assert lease.replica == f"{model}-r0"


async def test_prefix_waits_for_its_replica_within_the_bound_and_moves_past_it(processes, model):
    """A conversation waits for a slot on its own replica (its cache) rather than move to a free one, until its
    replica's slots held and requests waiting pass prefix routing's bound (2 x the mean, as gateway/affinity.py)."""
    one, _ = processes
    reps = replicas(1, 1, 1, model=model)
    home, second, third = f"{model}-r1", f"{model}-r2", f"{model}-r0"
    walk = [home, second, third]
    first = await admit(one, model, reps, prefs=walk)
    assert first.replica == home
    waits = start(one, model, reps, prefs=walk)  # home 2 of bound ceil(2 x 2 / 3) = 2: it waits there
    await asyncio.sleep(0.3)
    assert not waits.done()
    third = start(one, model, reps, prefs=walk)  # home would be 3 of bound 2: one of the two moves on its walk
    (moved,) = await settled([waits, third], 1)
    assert moved.result().replica == second
    stays = third if moved is waits else waits
    await one.release(first, reps(), 10)
    assert (await asyncio.wait_for(stays, 2)).replica == home  # the slot it waited for


async def test_a_short_prompt_takes_a_free_slot_off_its_replica_rather_than_wait(processes, model):
    """Its cold prefill costs less than a wait for its replica's slot: it goes to the next on its walk with one
    free, and to its own replica when that has one."""
    one, _ = processes
    reps = replicas(1, 1, model=model)
    home, other = f"{model}-r1", f"{model}-r0"
    first = await admit(one, model, reps, prefs=[home, other])
    assert first.replica == home
    short = await asyncio.wait_for(one.admit(model, reps, key="k1", rank=STANDARD, cost=10, prefs=[home, other],
                                             queue_limit=100, max_wait=5, movable=True), 2)
    assert short.replica == other
    await one.release(first, reps(), 10)
    again = await one.admit(model, reps, key="k1", rank=STANDARD, cost=10, prefs=[home, other], queue_limit=100,
                            max_wait=5, movable=True)
    assert again.replica == home


async def test_a_request_that_must_wait_says_so(processes, model):
    one, _ = processes
    reps = replicas(1, model=model)
    said = []
    await admit(one, model, reps, on_wait=lambda: said.append("first"))
    waiting = start(one, model, reps, on_wait=lambda: said.append("second"))
    await asyncio.sleep(0.2)
    assert said == ["second"]
    waiting.cancel()


async def test_a_request_may_lower_its_class_and_never_raise_it():
    assert admission.rank_of("standard", "") == STANDARD
    assert admission.rank_of("standard", "batch") == BATCH
    assert admission.rank_of("batch", "Interactive") == BATCH
    with pytest.raises(GatewayError) as bad:
        admission.rank_of("standard", "urgent")
    assert bad.value.status == 400 and "X-Llmgw-Priority must be one of interactive, standard, batch" in bad.value.message


async def test_the_queue_is_seen_by_whoever_asks(processes, model):
    """What `ctl models`, the API and the dashboard show: requests waiting and since when the oldest has."""
    import redis

    from cluster import inflight

    one, _ = processes
    reps = replicas(1, model=model)
    await admit(one, model, reps)
    waiting = [start(one, model, reps) for _ in range(2)]
    await asyncio.sleep(0.2)
    client = redis.Redis.from_url(settings.REDIS_URL)
    n, since = inflight.queued(client, [model, "nothing"])[model]
    assert n == 2 and 0 < time.time() - since < 5
    assert inflight.queued(client, ["nothing"]) == {"nothing": (0, None)}
    for t in waiting:
        t.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    assert inflight.queued(client, [model])[model] == (0, None)
    client.close()


async def test_the_slot_an_interactive_request_gives_back_stays_for_its_class(processes, model):
    """The quiet interactive key's request ends while batch requests wait: its slot is the one held back, so the
    key's next request finds it free, not taken by the batch."""
    one, two = processes
    reps = replicas(2, model=model)
    quiet = await admit(two, model, reps, key="quiet", rank=INTERACTIVE)
    batch = [start(one, model, reps, key="batch", rank=BATCH) for _ in range(3)]
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in batch) == 1  # the other slot: the quiet key holds the one held back
    await two.release(quiet, reps(), 10)
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in batch) == 1  # still: the slot given back stays for the interactive class
    again = await admit(two, model, reps, key="quiet", rank=INTERACTIVE, wait=0.2)
    await two.release(again, reps(), 10)
    for t in batch:
        t.cancel()


async def test_a_key_holding_a_slot_leaves_the_last_one_to_another_active_key_of_its_class(processes, model,
                                                                                          monkeypatch):
    """The quiet key between its requests: the flood, holding a slot already, may not take the model's last
    one, so the quiet key's next request finds it free rather than wait for one of the flood's to end. Once the
    quiet key has not been seen for KEY_HOLD, the flood has it."""
    monkeypatch.setattr(admission, "KEY_HOLD", 1.5)
    monkeypatch.setattr(admission, "PROMOTE_AFTER", 0.3)
    one, two = processes
    reps = replicas(2, model=model)
    done = await admit(two, model, reps, key="quiet")
    await two.release(done, reps(), 10)
    flood = [start(one, model, reps, key="flood") for _ in range(3)]
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in flood) == 1  # the other slot stays for the quiet key
    await asyncio.sleep(0.7)  # the flood's class has risen twice as its tickets waited (they look every 0.5 s)
    assert sum(t.done() for t in flood) == 1  # risen, it is still the quiet key's class the slot is kept for
    quiet = await admit(two, model, reps, key="quiet", wait=0.2)
    await two.release(quiet, reps(), 10)
    await asyncio.sleep(0.3)
    assert sum(t.done() for t in flood) == 1  # and stays for it again once it is done
    await settled(flood, 2, timeout=3)  # the quiet key not seen for KEY_HOLD: the flood takes the slot
    for t in flood:
        t.cancel()


async def test_no_slot_is_left_for_a_lower_class_nor_by_a_key_holding_none(processes, model):
    one, two = processes
    reps = replicas(2, model=model)
    done = await admit(two, model, reps, key="nightly", rank=BATCH)
    await two.release(done, reps(), 10)
    both = [await admit(one, model, reps, key="flood", wait=0.5) for _ in range(2)]  # a batch key leaves none
    for lease in both:
        await one.release(lease, reps(), 10)
    single = replicas(1, model=model + "-single")
    done = await admit(two, model + "-single", single, key="quiet")
    await two.release(done, single(), 10)
    await admit(one, model + "-single", single, key="flood", wait=0.5)  # a key's first slot is never held back


async def test_slots_given_back_together_go_in_one_call_and_each_is_settled(processes, model):
    """A process under load gives slots back faster than Redis answers: those of a model given back while one
    release is on its way go together in the next call, and every one frees its slot and settles its service."""
    one, two = processes
    reps = replicas(4, model=model)
    keys = [f"{model}-k{i}" for i in range(4)]  # the service hash is shared by every model
    held = [await admit(one, model, reps, key=key) for key in keys]
    waiting = [start(two, model, reps, key=f"{model}-w{i}") for i in range(4)]
    await asyncio.sleep(0.2)
    calls = []
    call = one._call

    async def counted(model, batch):
        calls.append(len(batch.releases))
        return await call(model, batch)

    one._call = counted
    await asyncio.gather(*(one.release(lease, reps(), 100 * (i + 1)) for i, lease in enumerate(held)))
    assert calls == [4]  # all four given back before the first call left: one call
    await settled(waiting, 4)
    client = aioredis.Redis.from_url(settings.REDIS_URL)
    served = {k.decode(): float(v.decode().split("|")[0]) for k, v in (await client.hgetall(admission.SERVICE)).items()
              if k.decode() in keys}
    assert [round(served[key]) for key in keys] == [100, 200, 300, 400]
    for t in waiting:
        await two.release(t.result(), reps(), 10)
    three = [await admit(one, model, reps, key=keys[0]) for _ in range(3)]
    calls.clear()
    first = asyncio.create_task(one.release(three[0], reps(), 10))
    await asyncio.sleep(0.001)  # on its way to Redis
    await asyncio.gather(first, *(one.release(lease, reps(), 10) for lease in three[1:]))
    assert calls == [1, 2]  # the first alone, the two given back meanwhile together
    assert await client.zcard(admission.slots_key(f"{model}-r0")) == 0  # every slot back
    await client.aclose()


async def test_a_starved_class_rises_and_a_floods_long_wait_does_not_pass_a_quiet_key_of_its_class(processes, model,
                                                                                                  monkeypatch):
    """PROMOTE_AFTER raises a class whose oldest ticket has waited that long, one rank per wait: the batch,
    risen to the top, goes. It raises the class, not the ticket: the flood's tickets that have waited long stay
    behind a quiet key of their own class, which has had less service."""
    monkeypatch.setattr(admission, "PROMOTE_AFTER", 0.4)
    one, two = processes
    reps = replicas(1, model=model)
    holding = await admit(one, model, reps, key="flood", cost=1000)
    flood = [start(one, model, reps, key="flood", cost=1000) for _ in range(2)]
    nightly = start(one, model, reps, key="nightly", rank=BATCH, cost=10)
    await asyncio.sleep(0.9)  # the standard class and the batch class both rise, twice
    quiet = start(two, model, reps, key="quiet", cost=10)
    await asyncio.sleep(0.1)
    await one.release(holding, reps(), 1000)
    (first,) = await settled([*flood, nightly, quiet], 1)
    assert first is nightly  # risen as far as the top, beside the standard class: the least service, the first come
    await one.release(nightly.result(), reps(), 10)
    (second,) = await settled([*flood, quiet], 1)
    assert second is quiet  # not a flood ticket that has waited longer
    await two.release(quiet.result(), reps(), 10)
    await settled(flood, 1)
    for t in flood:
        t.cancel()

# issue 35, "a request lost in a restart": a ticket's walk (prefs) is fixed when it is queued. Queued while the
# model's only replica was the old one (walk: old), it was never granted the replacement once the old one drained
# and left the table: it waited out max_wait (120 s by default: the 123 s a test saw) and its client, with a 60 s
# timeout, got no answer. Replicas its walk does not name are now the end of its walk.
@pytest.mark.parametrize("movable", [False, True], ids=["long-prompt", "short-prompt"])
async def test_a_request_queued_before_a_restart_is_granted_the_replacement(processes, model, movable):
    one, two = processes
    old, new = f"{model}-old", f"{model}-new"
    table = {"ready": [(old, 1)]}  # the routing table's ready replicas, as both processes see them

    def reps():
        return list(table["ready"])

    held = await admit(one, model, reps, prefs=[old])  # a request in flight on the only replica
    waiting = asyncio.create_task(two.admit(model, reps, key="k2", rank=STANDARD, cost=10, prefs=[old],
                                            queue_limit=100, max_wait=6.0, movable=movable))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    table["ready"] = [(old, 1), (new, 1)]  # the replacement came ready
    await asyncio.sleep(0.3)
    table["ready"] = [(new, 1)]  # the old one drains: gone from the table
    await one.release(held, reps(), 10)  # its request ends; the release names the table of now
    lease = await asyncio.wait_for(waiting, 3)  # on the old code: 503 queue_timeout after max_wait
    assert lease.replica == new
    await two.release(lease, reps(), 10)


async def test_a_keys_next_request_takes_the_slot_its_last_gave_back_without_a_round_trip(processes, model):
    """A closed loop of one key (a GPU engine's streams, a benchmark): while nobody waits and no other key or
    higher class was admitted lately, the slot a request gives back is kept for the key's next request on the
    replica its routing picks: no Redis call for either. Its service is still counted, in the next call."""
    one, _ = processes
    reps = replicas(2, model=model)
    first = await admit(one, model, reps)
    calls = []
    call = one._call

    async def counted(model_, batch):
        calls.append((len(batch.releases), len(batch.news), dict(batch.service)))
        return await call(model_, batch)

    one._call = counted
    await one.release(first, reps(), 100)
    again = await one.admit(model, reps, key="k1", rank=STANDARD, cost=30, prefs=[], queue_limit=100, max_wait=1,
                            chosen=first.replica)
    assert again.replica == first.replica and again.member == first.member
    assert calls == []  # neither the slot given back nor the one taken went to Redis
    other = await one.admit(model, reps, key="k1", rank=STANDARD, cost=10, prefs=[], queue_limit=100, max_wait=1,
                            chosen=f"{model}-elsewhere")
    assert calls[0][:2] == (0, 1) and calls[0][2] == {"k1": 100 - 10 + 30}  # the kept slots' service, sent along
    for lease in (again, other):
        await one.release(lease, reps(), 10)


async def test_a_ticket_enqueued_anywhere_makes_a_kept_slot_go_back_at_once(processes, model, monkeypatch):
    monkeypatch.setattr(admission, "KEEP_FOR", 30.0)  # kept long: only the word of the ticket gives it back
    one, two = processes
    reps = replicas(1, model=model)
    await one.release(await admit(one, model, reps), reps(), 10)
    assert one._kept[model]  # kept for k1's next request
    started = time.monotonic()
    lease = await admit(two, model, reps, key="k2", wait=5)  # no free slot: enqueued, the word goes out
    assert time.monotonic() - started < 1 and not one._kept[model]
    await two.release(lease, reps(), 10)


async def test_no_slot_is_kept_while_another_key_was_admitted_lately(processes, model):
    """The slot stays in Redis, where the rules between keys (a slot left for a key between its requests, one
    held back for a higher class) decide who has it."""
    one, two = processes
    reps = replicas(2, model=model)
    await two.release(await admit(two, model, reps, key="k2"), reps(), 10)
    await one.release(await admit(one, model, reps, key="k1"), reps(), 10)
    assert not one._kept.get(model)
    alone = model + "-alone"  # one key, but a higher class of it admitted lately: its batch request's slot goes back
    reps = replicas(2, model=alone)
    await one.release(await admit(one, alone, reps, key="k1", rank=INTERACTIVE), reps(), 10)
    batch = await admit(one, alone, reps, key="k1", rank=BATCH)
    await one.release(batch, reps(), 10)
    assert batch.member not in {k.lease.member for k in one._kept.get(alone, [])}


async def test_a_client_that_hangs_up_while_its_slot_is_being_granted_gives_it_back_at_once(processes, model):
    """Issue 35: the grant on its way to Redis as the client hangs up left the slot held until it lapsed (30 s)."""
    one, two = processes
    reps = replicas(1, model=model)
    on_its_way = asyncio.Event()
    call = one._call

    async def watched(model_, batch):
        if batch.news:
            on_its_way.set()
        return await call(model_, batch)

    one._call = watched
    hangs_up = start(one, model, reps)
    await asyncio.wait_for(on_its_way.wait(), 2)
    hangs_up.cancel()  # the slot is granted in the call under way: its answer finds the waiter gone
    await asyncio.gather(hangs_up, return_exceptions=True)
    lease = await admit(two, model, reps, key="next", wait=1.0)  # in well under the 30 s a lapse takes
    await two.release(lease, reps(), 10)


async def test_a_request_failing_over_goes_first_but_holds_no_slot_back_as_a_higher_class(processes, model):
    """A request whose replica failed before its first byte goes ahead of every class (it was admitted once), but as
    its key's own class: on a one-slot model, that slot was then held back from every standard request for 10 s
    (a restart's requests waited 10 s, bench/restart_loss.py)."""
    one, two = processes
    reps = replicas(1, model=model)
    retried = await one.admit(model, reps, key="k1", rank=INTERACTIVE, klass=STANDARD, cost=10, prefs=[],
                              queue_limit=100, max_wait=1)
    await one.release(retried, reps(), 10)
    other = await admit(two, model, reps, key="k2", wait=1.0)  # standard, at once: not held for interactive
    await two.release(other, reps(), 10)


async def test_a_process_whose_clock_runs_ahead_frees_no_slot_in_use(processes, model, monkeypatch):
    """Issue 35: leases, tickets and windows were on each process's clock; one 30 s ahead freed slots still in use.
    Every time is Redis's now."""
    one, two = processes
    reps = replicas(1, model=model)
    held = await admit(one, model, reps)
    real = time.time
    monkeypatch.setattr(time, "time", lambda: real() + 3600)  # this machine's clock, an hour ahead
    with pytest.raises(GatewayError) as waited:
        await admit(two, model, reps, key="ahead", wait=0.6)
    assert waited.value.code == "queue_timeout"  # the slot in use was not freed for it
    monkeypatch.setattr(time, "time", real)
    await one.release(held, reps(), 10)
