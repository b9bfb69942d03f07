"""How every Redis client of llmgw is made: redis-py's own options, so that a connection the server closed while it
sat in a pool (Redis restarted, or it dropped the client) costs no command.

redis-py made from a URL retries nothing: each dead pooled connection failed the one command that next took it
(a client key's rate limit: a 503, long after the restart, whenever a quiet connection of the pool came up). Told
to retry ConnectionError, redis-py closes that connection and sends the command again on a new one; with a few
tries, backing off up to a second, a command also rides out a restart that `llmgw up`'s supervisor makes in well
under that. Why it is safe to send again: a ConnectionError says the command did not reach a live server (the
socket was dead) or reached one that died with it, and a Redis restarted without persistence has forgotten it
anyway, so an INCR (a Lua script) is counted once. A TimeoutError is not retried: the server may well have run
the command, and a second wait would double the first. TCP keepalive (redis-py's default, said here) finds a
server that went without a word.

Celery's broker (kombu) has options of its own, in llmgw/settings.py.
"""

from __future__ import annotations

import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

RETRIES = 4  # after the first try, 0.1-0.2 s, 0.2-0.4, 0.4-0.8, 0.5-1 s apart (EqualJitterBackoff)
BACKOFF = {"cap": 1.0, "base": 0.1}


def options(socket_timeout: float = 10, asyncio: bool = False) -> dict:
    """Keyword arguments for a redis-py client or pool made from a URL: `Redis.from_url(url, **options())`."""
    retry = (AsyncRetry if asyncio else Retry)(EqualJitterBackoff(**BACKOFF), RETRIES, (RedisConnectionError,))
    return {"socket_connect_timeout": 3, "socket_timeout": socket_timeout, "socket_keepalive": True, "retry": retry}


def channel_layer_retry() -> AsyncRetry:
    """The channel layer's: one try again at once, no back-off. A stale pooled connection is replaced, but a wait
    for messages (BZPOPMIN) that a restart of Redis cut still fails: Redis comes back empty, without the groups
    the stream had joined, so the stream must end and its client dial again (cluster.notify.EndsWhenTheLayerIsAway)
    rather than wait on for messages sent to groups it is no longer in. A server that has just closed its clients
    is not listening again a moment later; one that dropped a client (CLIENT KILL, an idle timeout) still is."""
    return AsyncRetry(NoBackoff(), 1, (RedisConnectionError,))


class CachePool(redis.ConnectionPool):
    """Django's Redis cache's pool (CACHES' `pool_class`), made with the options above: settings hold no objects."""

    def __init__(self, **kwargs):
        super().__init__(**{**options(), **kwargs})
