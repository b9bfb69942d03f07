"""The channel layer: channels_redis's, with a bounded pool of Redis connections that waits for a free one.

redis-py 8 caps an asyncio pool at 100 connections and raises `MaxConnectionsError` at the 101st. A web process
holds one connection per channel-layer call under way (a group_send, a group_add), so hundreds of agents
connecting at once (every agent after a control plane's restart) failed their handshakes with HTTP 500. A
blocking pool has them wait their turn for a connection instead, as a PostgreSQL pool does. A connection Redis
closed while it sat in the pool is replaced at once (cluster.redis_options.channel_layer_retry says how, and why
only once).
"""

from __future__ import annotations

from channels_redis.core import RedisChannelLayer as _RedisChannelLayer
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.sentinel import SentinelConnectionPool

from cluster.redis_options import channel_layer_retry, sentinel_pool

POOL_SIZE = 50  # connections per web process; a call that finds them all busy waits (below)
POOL_WAIT = 30  # seconds a call waits for a free connection before it fails (redis.ConnectionError)


class BlockingSentinelPool(SentinelConnectionPool, BlockingConnectionPool):
    """Behind Sentinel (cluster.redis_options): connections to the master the Sentinels name, in a pool that waits."""


class RedisChannelLayer(_RedisChannelLayer):
    def create_pool(self, index):
        host = dict(self.hosts[index])
        address = host.pop("address")
        host.setdefault("max_connections", POOL_SIZE)
        host.setdefault("timeout", POOL_WAIT)
        host.setdefault("socket_keepalive", True)
        host.setdefault("retry", channel_layer_retry())
        pool = sentinel_pool(BlockingSentinelPool, True, **host)  # the address's database and password
        return pool if pool is not None else BlockingConnectionPool.from_url(address, **host)
