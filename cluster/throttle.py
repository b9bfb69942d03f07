"""Slowing down whoever guesses: failed logins, API tokens and client keys, counted in Redis.

Each door (`login`, `api`, `gateway`) counts its failures per client address, and logins also per user name,
in Redis, so every web process sees the same count. The first LLMGW_AUTH_FREE_FAILURES failures within
LLMGW_AUTH_WINDOW seconds of each other cost nothing; each one after that shuts the door on that address (or
user) for a delay that doubles, 1 s, 2 s, 4 s, up to the window, answered with 429 and `Retry-After` however
good the credentials are. A quiet window forgets the count. The first failure past the free ones writes an
Event (`auth.throttled`).

A web process remembers the doors it shut, so a request that gets in costs no Redis round trip; another
process learns of a shut door at its own first failure from there, which the shared count answers at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from django.conf import settings
from redis.exceptions import RedisError

from cluster import events

DOORS = {"login": "failed logins", "api": "failed API tokens", "gateway": "failed client keys"}
PREFIX = "llmgw:auth:"  # + door:kind:who -> failures; + door:kind:who:shut -> the door is shut while it lives
log = logging.getLogger("llmgw.throttle")
clock = time.monotonic  # when a shut door opens, as this process sees it (tests move it on)
REMEMBERED = 10_000  # shut doors a process keeps in memory before it forgets the ones open again

# one failure: count it (the window starts again), and past the free ones shut the door for 2^(n - free - 1)
# seconds, at most the window. Returns the count and the delay (0: still free).
FAIL = """
local n = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[1])
local over = n - tonumber(ARGV[2])
if over <= 0 then return {n, 0} end
local delay = math.min(2 ^ math.min(over - 1, 30), tonumber(ARGV[1]))
redis.call('SET', KEYS[2], '1', 'EX', delay)
return {n, delay}
"""


@dataclass(frozen=True)
class Subject:
    kind: str  # "address" or "user"
    who: str

    def key(self, door: str) -> str:
        return f"{PREFIX}{door}:{self.kind}:{self.who}"


def subjects(address: str, user: str = "") -> tuple[Subject, ...]:
    found = [Subject("address", address)]
    if user:
        found.append(Subject("user", user.strip().lower()[:150]))
    return tuple(found)


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
        script = redis.register_script(FAIL)
        for subject in found:
            try:
                n, delay = script(keys=self._keys(subject), args=self._args())
            except RedisError as exc:  # the refusal stands; only the count is lost
                log.warning("could not count a failure at %s for %s: %s", self.name, subject.who, exc)
                continue
            if self._remember(subject, delay) and self._first_over(n):
                self._record(subject, n)

    async def afailed(self, redis, found: tuple[Subject, ...]) -> None:
        """The same with an asyncio Redis client; the Event is written on a thread."""
        from asgiref.sync import sync_to_async

        script = redis.register_script(FAIL)
        for subject in found:
            try:
                n, delay = await script(keys=self._keys(subject), args=self._args())
            except RedisError as exc:
                log.warning("could not count a failure at %s for %s: %s", self.name, subject.who, exc)
                continue
            if self._remember(subject, delay) and self._first_over(n):
                await sync_to_async(self._record)(subject, n)

    def forget(self) -> None:
        """Open every door this process shut (its memory only; the counts live in Redis)."""
        self._shut.clear()

    def _keys(self, subject: Subject) -> list[str]:
        return [subject.key(self.name), subject.key(self.name) + ":shut"]

    @staticmethod
    def _args() -> list[int]:
        return [settings.LLMGW_AUTH_WINDOW, settings.LLMGW_AUTH_FREE_FAILURES]

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
    def _first_over(n: int) -> bool:
        return int(n) == settings.LLMGW_AUTH_FREE_FAILURES + 1

    def _record(self, subject: Subject, n: int) -> None:
        what = f"from {subject.who}" if subject.kind == "address" else f"for user {subject.who}"
        events.record(
            "auth.throttled",
            "throttle",
            f"{int(n)} {DOORS[self.name]} {what} within {settings.LLMGW_AUTH_WINDOW} s: each further attempt waits"
            " longer, up to the window",
            subject=subject.who[:120],
            door=self.name,
            who=subject.kind,
            failures=int(n),
        )


LOGIN, API, GATEWAY = Door("login"), Door("api"), Door("gateway")
