"""Slowing down whoever guesses: failed logins, API tokens and client keys, counted in Redis.

Each door (`login`, `api`, `gateway`) counts its failures per client address in Redis, so every web process sees
the same count. The first LLMGW_AUTH_FREE_FAILURES failures within LLMGW_AUTH_WINDOW seconds of each other cost
nothing; each one after that shuts the door on that address for a delay that doubles, 1 s, 2 s, 4 s, up to the
window, answered with 429 and `Retry-After` however good the credentials are. A quiet window forgets the count.

A login counts twice more, by its user name, so that nobody can shut a user out from afar:

- the user at that address, with the same free failures: who guesses alice's password from X shuts alice at X
  (and X itself, as above); alice from anywhere else logs in as before;
- the user from every address, with LLMGW_AUTH_FREE_USER_FAILURES free ones (100): a guess spread over many
  addresses still waits, but not at an address the user logged in from in the last KNOWN_FOR (30 days), which
  this count neither counts nor shuts. A distributed guess slows to the addresses' own pace, and the user, from
  where they are known, still gets in.

The first failure past the free ones of each count writes an Event (`auth.throttled`).

A web process remembers the doors it shut, so a request that gets in costs no Redis round trip (a login costs one,
to ask whether its address is a known place); another process learns of a shut door at its own first failure
from there, which the shared count answers at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.conf import settings
from redis.exceptions import RedisError

from cluster import events
from cluster.scripts import CLUSTER

DOORS = {"login": "failed logins", "api": "failed API tokens", "gateway": "failed client keys"}
PREFIX = "llmgw:auth:"  # + door:kind:who -> failures; + door:kind:who:shut -> the door is shut while it lives
KNOWN = PREFIX + "known:"  # + user@address -> the user logged in from there (a known place), while it lives
KNOWN_FOR = 30 * 86400  # seconds a successful login keeps its address known for its user
log = logging.getLogger("llmgw.throttle")
clock = time.monotonic  # when a shut door opens, as this process sees it (tests move it on)
REMEMBERED = 10_000  # shut doors a process keeps in memory before it forgets the ones open again


@dataclass(frozen=True)
class Subject:
    kind: str  # "address"; "user": a user name at one address (`at`); "user-anywhere": a user name from any address
    who: str
    at: str = ""

    def key(self, door: str) -> str:
        return f"{PREFIX}{door}:{self.kind}:{self.who}" + (f"@{self.at}" if self.at else "")

    @property
    def free(self) -> int:
        if self.kind == "user-anywhere":
            return settings.LLMGW_AUTH_FREE_USER_FAILURES
        return settings.LLMGW_AUTH_FREE_FAILURES


def subjects(address: str) -> tuple[Subject, ...]:
    """Whom a failed API token or client key counts against: its address."""
    return (Subject("address", address),)


def login_subjects(redis, address: str, user: str) -> tuple[Subject, ...]:
    """Whom a failed login counts against: its address, the user at that address, and the user from any address
    unless this one is a place the user logged in from (asked of Redis: a Redis client)."""
    name = user_name(user)
    if not name:
        return subjects(address)
    found = (Subject("address", address), Subject("user", name, at=address))
    try:
        known = redis.exists(f"{KNOWN}{name}@{address}")
    except RedisError as exc:  # counted as a place not known: the user at that address is still counted apart
        log.warning("could not ask whether %s is a known place for %s: %s", address, name, exc)
        known = False
    return found if known else (*found, Subject("user-anywhere", name))


def logged_in(redis, address: str, user: str) -> None:
    """The user logged in from this address: a known place for the next KNOWN_FOR seconds."""
    try:
        redis.set(f"{KNOWN}{user_name(user)}@{address}", "1", ex=KNOWN_FOR)
    except RedisError as exc:
        log.warning("could not remember %s as a known place for %s: %s", address, user, exc)


def user_name(user) -> str:
    """A user name as the counts key it: one name whatever its case."""
    return user.strip().lower()[:150] if isinstance(user, str) else ""


class Door:
    """One door's failures. `shut()` before checking credentials; `failed()` (or `afailed()`) when they were wrong."""

    def __init__(self, name: str):
        self.name = name
        self._shut: dict[Subject, float] = {}  # subject -> clock() when it opens again

    def shut(self, found: tuple[Subject, ...]) -> int:
        """Seconds until this door opens again for any of these subjects; 0: open."""
        if not self._shut:
            return 0
        now = clock()
        left = max((self._shut.get(s, 0.0) - now for s in found), default=0.0)
        return int(left) + 1 if left > 0 else 0

    def failed(self, redis, found: tuple[Subject, ...]) -> None:
        """Count a failure (a Redis client): shut the door past the free ones, and write the Event once."""
        script = CLUSTER.register(redis, "throttle")
        for subject in found:
            try:
                n, delay = script(keys=self._keys(subject), args=self._args(subject))
            except RedisError as exc:  # the refusal stands; only the count is lost
                log.warning("could not count a failure at %s for %s: %s", self.name, subject.who, exc)
                continue
            if self._remember(subject, delay) and self._first_over(subject, n):
                self._record(subject, n)

    async def afailed(self, redis, found: tuple[Subject, ...]) -> None:
        """The same with an asyncio Redis client; the Event is written on a thread."""
        from asgiref.sync import sync_to_async

        script = CLUSTER.aregister(redis, "throttle")
        for subject in found:
            try:
                n, delay = await script(keys=self._keys(subject), args=self._args(subject))
            except RedisError as exc:
                log.warning("could not count a failure at %s for %s: %s", self.name, subject.who, exc)
                continue
            if self._remember(subject, delay) and self._first_over(subject, n):
                await sync_to_async(self._record)(subject, n)

    def forget(self) -> None:
        """Open every door this process shut (its memory only; the counts live in Redis)."""
        self._shut.clear()

    def _keys(self, subject: Subject) -> list[str]:
        return [subject.key(self.name), subject.key(self.name) + ":shut"]

    @staticmethod
    def _args(subject: Subject) -> list[int]:
        return [settings.LLMGW_AUTH_WINDOW, subject.free]

    def _remember(self, subject: Subject, delay) -> bool:
        delay = float(delay)
        if delay <= 0:
            return False
        now = clock()
        if len(self._shut) >= REMEMBERED:
            self._shut = {s: until for s, until in self._shut.items() if until > now}
        self._shut[subject] = now + delay
        return True

    @staticmethod
    def _first_over(subject: Subject, n: int) -> bool:
        return int(n) == subject.free + 1

    def _record(self, subject: Subject, n: int) -> None:
        window, further = settings.LLMGW_AUTH_WINDOW, "each further attempt waits longer, up to the window"
        if subject.kind == "address":
            said = f"from {subject.who} within {window} s: {further}"
        elif subject.kind == "user":
            said = (f"for user {subject.who} from {subject.at} within {window} s: from there {further}; from"
                    " elsewhere the user logs in as before")
        else:
            said = (f"for user {subject.who} from any address within {window} s: {further}, but from an address"
                    " the user logged in from")
        where = {"address": subject.at} if subject.at else {}
        events.record(
            "auth.throttled",
            "throttle",
            f"{int(n)} {DOORS[self.name]} {said}",
            subject=subject.who[:120],
            door=self.name,
            who=subject.kind,
            failures=int(n),
            **where,
        )


LOGIN, API, GATEWAY = Door("login"), Door("api"), Door("gateway")
