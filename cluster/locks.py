"""The Redis connection the control plane shares: reconciler lock, and later the gateway's counters."""

import functools

import redis

from cluster import redis_options


@functools.cache
def redis_client() -> redis.Redis:
    return redis_options.client()
