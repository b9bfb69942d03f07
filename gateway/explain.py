"""Why a request went to the replica it went to, as its record says it (gateway/records.py's `Why`): the model's
routing policy, whether the replica its prefix or session maps to took it (a hit, its cache likely warm), and each
replica passed over before it, with why: tried already (and what became of that), unreachable lately, or busier
than the routing allows. Made as the replica is chosen, from what the choice was made on (the in-flight counts
this process knows), so it says why as the gateway saw it then; a few microseconds, on the request's way."""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from gateway.records import Why

PREFIX, LEAST = "prefix", "least in flight"


def explain(ready: Sequence[str], *, chosen: str, walk: Iterable[str] | None, load_of: Callable[[str], int],
            tried: Mapping[str, str], unreachable: Collection[str], session: bool = False, factor: float = 1.0,
            queued: bool = False) -> Why:
    """Why `chosen` of the `ready` replicas. `walk`: the replicas in the order the request's key meets them on its
    model's ring (prefix routing), None for least in flight. `tried`: the replicas it was sent to before, each with
    what became of it. `queued`: admission granted the slot (its queue chose among the replicas with one free)."""
    if walk is not None and not tried:  # most requests: the replica its key maps to took it, none passed over
        first = next(iter(walk), None)
        if first == chosen:
            return _hit("session" if session else "prefix", chosen, load_of(chosen))
        walk = itertools.chain((first,) if first is not None else (), walk)
    elif walk is None and len(ready) == 1:  # the one replica there is
        return _alone(chosen, load_of(chosen))
    loads = {name: load_of(name) for name in ready}
    policy = PREFIX if walk is not None else LEAST
    passed: list[tuple[str, str]] = []

    def why_not(name: str, busy: str) -> str:
        if name in tried:
            return f"tried: {tried[name]}"
        if name in unreachable:
            return "unreachable lately"
        return busy

    if walk is not None:
        open_loads = [n for name, n in loads.items() if name not in tried]
        bound = math.ceil(factor * (sum(open_loads) + 1) / len(open_loads)) if open_loads else 0
        for name in walk:
            if name == chosen:
                break
            if name in loads:
                busy = "no free slot" if queued else f"busy: {loads[name]} in flight, over the bound of {bound}"
                passed.append((name, why_not(name, busy)))
        hit = ("session" if session else "prefix") if not passed else ""  # its key's own replica took it
    else:
        hit = ""
        mine = loads.get(chosen, 0)
        for name, n in loads.items():
            if name != chosen:
                passed.append((name, why_not(name, f"{n} in flight" if n > mine or queued
                                            else f"{n} in flight, as few (chosen at random)")))
    return Why(policy, hit, f"{chosen} ({loads.get(chosen, 0)} in flight)", tuple(passed))


@functools.lru_cache(maxsize=4096)
def _hit(hit: str, chosen: str, load: int) -> Why:
    return Why(PREFIX, hit, f"{chosen} ({load} in flight)", ())


@functools.lru_cache(maxsize=4096)
def _alone(chosen: str, load: int) -> Why:
    return Why(LEAST, "", f"{chosen} ({load} in flight)", ())
