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

Behind Sentinel (LLMGW_REDIS_SENTINELS, LLMGW_REDIS_MASTER) each client is redis-py's own Sentinel-managed one: a
connection asks the Sentinels where the master is when it opens, and a connection to a server that is no longer
the master (gone, or come back as a replica: READONLY) is closed and the command sent again, by the retry above,
to the master the Sentinels name now. The database number and password are REDIS_URL's. Celery uses kombu's own
Sentinel transport (sentinel_broker_url), the channel layer and Django's cache these pools.
"""

from __future__ import annotations

from typing import TypedDict
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelConnectionPool
from redis.backoff import EqualJitterBackoff, NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

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
    """Django's Redis cache's pool (CACHES' `pool_class`), made with the options above: settings hold no objects.
    Behind Sentinel, Django's `from_url` gets a Sentinel-managed pool for the master instead."""

    def __init__(self, **kwargs):
        super().__init__(**{**options(), **kwargs})

    @classmethod
    def from_url(cls, url, **kwargs):
        pool = sentinel_pool(SentinelConnectionPool, False, **{**options(), **kwargs})
        return pool if pool is not None else super().from_url(url, **kwargs)


class UrlAuth(TypedDict, total=False):
    db: int
    username: str
    password: str


def url_auth(url: str) -> UrlAuth:
    """The database number, user name and password a Redis URL gives (what a Sentinel-managed client keeps of it)."""
    parts = urlsplit(url)
    out: UrlAuth = {"db": int(parts.path.strip("/") or 0) if parts.path.strip("/").isdigit() else 0}
    if parts.username:
        out["username"] = unquote(parts.username)
    if parts.password:
        out["password"] = unquote(parts.password)
    return out


def sentinel_broker_url(url: str, sentinels: list[tuple[str, int]]) -> str:
    """kombu's Sentinel transport's URL: `sentinel://[:password@]host:port/db` for each Sentinel, `;` between."""
    auth = url_auth(url)
    cred = ""
    if "password" in auth:
        cred = f"{quote(auth.get('username', ''), safe='')}:{quote(auth['password'], safe='')}@"
    return ";".join(f"sentinel://{cred}{f'[{h}]' if ':' in h else h}:{p}/{auth['db']}" for h, p in sentinels)


def _sentinel_settings():
    from django.conf import settings

    if not settings.LLMGW_REDIS_SENTINELS:
        return None
    kwargs: dict[str, object] = (
        {"password": settings.LLMGW_REDIS_SENTINEL_PASSWORD} if settings.LLMGW_REDIS_SENTINEL_PASSWORD else {})
    kwargs |= {"socket_connect_timeout": 3, "socket_timeout": 3}
    return settings.LLMGW_REDIS_SENTINELS, settings.LLMGW_REDIS_MASTER, kwargs, url_auth(settings.REDIS_URL)


def client(socket_timeout: float = 10, asyncio: bool = False):
    """A redis-py client for llmgw's Redis: REDIS_URL's server, or the master the Sentinels name."""
    from django.conf import settings

    redis_class = aioredis.Redis if asyncio else redis.Redis
    kwargs = options(socket_timeout=socket_timeout, asyncio=asyncio)
    pool = sentinel_pool(AsyncSentinelConnectionPool if asyncio else SentinelConnectionPool, asyncio, **kwargs)
    return redis_class.from_url(settings.REDIS_URL, **kwargs) if pool is None else redis_class.from_pool(pool)


def sentinel_pool(pool_class, asyncio: bool, **kwargs):
    """A connection pool of `pool_class` (a Sentinel-managed one, mixed with a blocking one where wanted) for the
    master the Sentinels name, with `kwargs` as its connections' options; None when there are no Sentinels."""
    found = _sentinel_settings()
    if found is None:
        return None
    sentinels, master, sentinel_kwargs, auth = found
    manager = (AsyncSentinel if asyncio else Sentinel)(sentinels, sentinel_kwargs=sentinel_kwargs)
    return pool_class(master, manager, **{**auth, **kwargs})
